"""``gputopo nodes``'s service: many nodes' facts read from files or gathered over Slurm, and Slurm's own
view of the racks (a topology file, ``scontrol show topology``, ``scontrol show job``). The planning and
the audit are pure (``topology.domains``, ``topology.slurm_blocks``); the machine is reached through
``system/`` (``slurm_gather``, ``scontrol``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gputopo.errors import InputError, UsageError
from gputopo.inputs import loads_bounded, read_capped
from gputopo.topology.domains import FACTS_HINT, NodeFacts, compress_hostlist, facts_from_doc

# The most facts files one folder may hold (a 288-rack NVL72 site has 5,184 trays).
MAX_FACTS_FILES = 100_000
# How long gathering over Slurm may take by default, and the share of it scontrol may use.
DEFAULT_BUDGET_S = 60.0
SCONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Gathered:
    """The nodes' facts, the nodes asked that did not answer (``unanswered``: node -> why) and warnings."""

    facts: list[NodeFacts]
    unanswered: dict[str, str]
    warnings: list[str]


def read_facts(paths: list[Path]) -> list[NodeFacts]:
    """Facts from files, or from every ``*.json`` in a folder named (not its sub-folders)."""
    files: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
            if not found:
                raise InputError(f"{path}: a folder with no .json facts files in it", FACTS_HINT)
            files.extend((p, str(p)) for p in found)
        else:
            files.append((path, str(path)))
        if len(files) > MAX_FACTS_FILES:
            raise InputError(f"more than {MAX_FACTS_FILES} facts files", "give fewer files or folders")
    if not files:
        raise UsageError(
            "no facts to read", "give facts files or a folder of them, or --slurm to gather them"
        )
    return [_read_one(path, label) for path, label in files]


def _read_one(path: Path, label: str) -> NodeFacts:
    raw = read_capped(path, label, hint=FACTS_HINT)
    try:
        doc = loads_bounded(raw.decode("utf-8-sig"), label)
    except UnicodeDecodeError:
        raise InputError(f"{label}: binary data, not facts", FACTS_HINT) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{label}: not JSON (line {exc.lineno}: {exc.msg})", FACTS_HINT) from None
    return facts_from_doc(doc, label)


def slurm_nodes(nodelist: str | None) -> list[str]:
    """The nodes to gather from: ``--nodelist``, else the allocation's (``SLURM_JOB_NODELIST``)."""
    from gputopo.launch.slurm import expand_hostlist
    from gputopo.system.scontrol import hostnames

    text = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not text:
        raise UsageError(
            "--slurm: no allocation (SLURM_JOB_NODELIST is not set) and no --nodelist",
            "run inside salloc/sbatch, or name the nodes: --nodelist gpu-[01-18]",
        )
    return hostnames(text, SCONTROL_TIMEOUT_S) or expand_hostlist(text)


def gather_slurm(nodes: list[str], budget_s: float) -> Gathered:
    """``gputopo topo --json`` once on each node with ``srun``, within ``budget_s``; nodes that did not
    answer (or answered with something that is not facts) are named with why."""
    from gputopo.system.slurm_gather import run_on_nodes

    argv = [sys.executable, "-m", "gputopo", "topo", "--json"]
    outputs, error = run_on_nodes(compress_hostlist(nodes), len(nodes), argv, budget_s)
    facts: list[NodeFacts] = []
    warnings: list[str] = []
    for task, text in sorted(outputs.items()):
        try:
            facts.append(facts_from_doc(loads_bounded(text, f"srun task {task}"), f"srun task {task}"))
        except (InputError, json.JSONDecodeError) as exc:
            what = exc.message if isinstance(exc, InputError) else f"not JSON ({exc.msg})"
            warnings.append(f"srun task {task}: {what}")
    answered = {f.node for f in facts}
    why = error or "no facts came back"
    unanswered = {n: why for n in nodes if n not in answered}
    strangers = sorted(answered - set(nodes))
    if strangers:
        warnings.append(f"facts from nodes not asked for: {', '.join(strangers)} (SLURMD_NODENAME differs?)")
    return Gathered(facts, unanswered, warnings)


def read_slurm_view(audit: str, budget_end: float) -> tuple[str, str]:
    """Slurm's block topology as text and where it came from: ``--audit FILE``, or ``--audit scontrol``
    (``scontrol show topology`` now)."""
    if audit == "scontrol":
        from gputopo.system.scontrol import show

        text = show(["show", "topology"], _left(budget_end))
        if text is None:
            raise InputError(
                "--audit scontrol: `scontrol show topology` failed or is not here",
                "give the topology.conf file instead: --audit /etc/slurm/topology.conf",
            )
        return text, "scontrol show topology"
    label = f"--audit {audit}"
    raw = read_capped(
        Path(audit), label, hint="give a topology.conf or saved `scontrol show topology` output"
    )
    return raw.decode("utf-8", errors="replace"), audit


def read_job(job_id: str, budget_end: float) -> str:
    """``scontrol show job ID``'s text."""
    from gputopo.system.scontrol import show

    if not job_id.strip().replace("_", "").isdigit():
        raise UsageError(
            f"--job {job_id!r} is not a Slurm job id", "give the number squeue shows, e.g. --job 4242"
        )
    text = show(["show", "job", job_id.strip()], _left(budget_end))
    if text is None:
        raise InputError(
            f"--job {job_id}: `scontrol show job {job_id}` failed or is not here",
            "check the job id with squeue; the audit needs scontrol on PATH",
        )
    return text


def _left(budget_end: float) -> float:
    return max(0.5, min(SCONTROL_TIMEOUT_S, budget_end - time.monotonic()))
