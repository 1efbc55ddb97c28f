"""Which machine a command looks at: ``--input`` (saved ``topo -m`` text, a JSON snapshot, NCCL topology
XML, ``sample:NAME``) read through the pure parsers of ``topology/``, or this machine, live through
``system/``; its health sample, the last check's state, and the node's facts.

These are the reads below ``services/`` (``probe/pool`` calls them too). A command reaches them through
the one machine step, ``services.machine.read``, which reads each once and applies the rules on top (the
drain rule, the preset ``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.errors import InputError
from gputopo.model import DEFAULT_NVML_TIMEOUT_S, Topology

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gputopo.findings import Finding
    from gputopo.health.judge import Judgement
    from gputopo.health.state import CheckState, StateDoc

SAMPLE_PREFIX = "sample:"
STDIN = "-"
# How NCCL topology XML begins (a pasted `topo -m` can begin with HTML tags, so not just "<").
NCCL_XML_STARTS = ("<?xml", "<system", "<graphs", "<!DOCTYPE")


def load_topology(spec: str | None, nvml_timeout_s: float | None = None) -> Topology:
    """The topology named by ``--input``, or this machine's when ``spec`` is ``None``.

    ``spec`` is ``sample:NAME``, a path to a JSON snapshot (``gputopo topo --json``), NCCL topology XML
    (``NCCL_TOPO_DUMP_FILE``: a ``.xml`` name or text starting ``<?xml``, ``<system``, ...), saved
    ``nvidia-smi topo -m`` text, or ``-`` for any of them on stdin. Raises ``InputError`` (exit 2) for
    anything unreadable and ``UnavailableError`` (exit 3) when reading live without an NVIDIA driver.
    ``nvml_timeout_s`` bounds each live NVML read (``--nvml-timeout``; default
    ``system.nvml_worker.DEFAULT_TIMEOUT_S``).
    """
    if spec is None:
        from gputopo.system.inventory import read_live

        return read_live() if nvml_timeout_s is None else read_live(nvml_timeout_s=nvml_timeout_s)
    if spec.startswith(SAMPLE_PREFIX):
        from gputopo.topology import samples

        return samples.load(spec[len(SAMPLE_PREFIX) :])
    if spec == STDIN:
        return _from_text(_read_stdin(), "stdin")
    from gputopo.inputs import read_capped

    path = Path(spec)
    raw = read_capped(
        path,
        f"--input {spec}",
        hint="give a saved `nvidia-smi topo -m` output, a JSON snapshot, "
        "or sample:NAME (gputopo topo --list-samples)",
    )
    return _from_text(decode(raw), str(path), xml_name=path.suffix.lower() == ".xml")


def _read_stdin() -> str:
    import sys

    if sys.stdin is None or sys.stdin.isatty():
        raise InputError(
            "--input -: stdin is a terminal, not a saved output",
            "pipe it in: nvidia-smi topo -m | gputopo topo --input -",
        )
    from gputopo.inputs import read_stream_capped

    stream = getattr(sys.stdin, "buffer", None) or sys.stdin
    return decode(read_stream_capped(stream, "--input -"))


def _from_text(text: str, source: str, xml_name: bool = False) -> Topology:
    """Read text as whichever input it is: NCCL XML, a JSON snapshot, or `topo -m` output."""
    head = text.lstrip("\ufeff \t\r\n")
    if xml_name or head.startswith(NCCL_XML_STARTS):
        from gputopo.topology.nccl_xml import parse_nccl_xml  # NCCL_TOPO_DUMP_FILE output

        return parse_nccl_xml(text, source=source)
    if head.startswith("{"):
        from gputopo.topology import snapshot

        return snapshot.loads(text.lstrip("\ufeff"), source=source)
    from gputopo.topology.parse_smi import parse_topo_text

    return parse_topo_text(text, source=source)


def decode(raw: bytes) -> str:
    """Bytes of a saved output as text: UTF-16 with a byte-order mark (what PowerShell's ``>`` writes)
    or UTF-8 (with or without one); bytes that are neither become U+FFFD, which the parser judges."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return raw.decode("utf-16", errors="replace")  # the codec reads the BOM and drops it
    return raw.decode("utf-8-sig", errors="replace")


def read_live_health(
    nvml_timeout_s: float | None = None, sample_s: float = 0.0, gpus: Sequence[int] | None = None
) -> Judgement:
    """This machine's health as ``topo``, ``recommend`` and ``probe`` use it: one NVML health sample judged
    by its states (ECC, row remaps, clocks, link width, recovery action, ...); with ``sample_s`` above 0,
    two samples that far apart, so rising counters are judged too. ``gpus`` limits the single sample to
    those GPUs (a probe's sets). Never raises for a machine that cannot be read: NVML missing or failing
    comes back as one ``not_checked`` entry (health unknown, never healthy).
    """
    from gputopo.health.judge import Judgement, NotChecked, judge, judge_one
    from gputopo.system import nvml
    from gputopo.system.health_reads import sample_health

    timeout_s = nvml_timeout_s if nvml_timeout_s is not None else DEFAULT_NVML_TIMEOUT_S
    try:
        first, last = sample_health(sample_s if sample_s > 0 else None, gpus=gpus, timeout_s=timeout_s)
    except nvml.NvmlUnavailable as exc:
        return Judgement((), (NotChecked("health", exc.message),))
    judged = judge(first, last) if first is not None else judge_one(last)
    return with_last_check(judged, {g.index: g.uuid for g in last.gpus})


def with_last_check(judged: Judgement, live_uuids: Mapping[int, str | None]) -> Judgement:
    """``judged`` with the last ``gputopo check``'s problems added while it is fresh, so recommend, run,
    topo and probe leave out the GPUs check found sick (rates over minutes included); a GPU already judged
    sick here keeps its own finding. A state file that could not be used is one ``not_checked`` entry
    saying why (never a silent nothing)."""
    from gputopo.health.judge import Judgement, NotChecked
    from gputopo.health.state import LAST_CHECK_WHAT

    sick = set(judged.unhealthy_gpus())
    problems, warning = last_check(live_uuids)
    added = tuple(f for f in problems if f.gpu not in sick)
    not_checked = judged.not_checked
    if warning is not None:
        not_checked = (*not_checked, NotChecked(LAST_CHECK_WHAT, warning))
    if not added:
        return Judgement(judged.findings, not_checked) if warning is not None else judged
    findings = sorted((*judged.findings, *added), key=lambda f: f.severity != "problem")
    return Judgement(tuple(findings), not_checked)


def last_check_problems(live_uuids: Mapping[int, str | None]) -> list[Finding]:
    """The last ``gputopo check``'s problems on single GPUs while fresh (``health.state.FRESH_S``), each
    saying how old, from its state file: ``GPUTOPO_CHECK_STATE``, or root's
    ``/var/lib/gputopo/check-state.json`` (for every user: it is 0644). Empty when there is none, it is
    stale, or it cannot be read (``last_check`` also says why)."""
    return last_check(live_uuids)[0]


def last_check(live_uuids: Mapping[int, str | None]) -> tuple[list[Finding], str | None]:
    """``last_check_problems`` and the warning when the state file could not be used (``None``: it
    could, or there is none)."""
    import time

    from gputopo.health.state import last_check_findings

    state, warning = check_state_read()
    if state is None:
        return [], warning
    return last_check_findings(state, time.time(), live_uuids)[0], warning


def node_facts(topo: Topology | None = None, warnings: Sequence[str] = ()) -> dict[str, Any]:
    """What ``gputopo topo --json`` adds on the live machine so it can stand for the node across machines
    (``gputopo nodes``): ``node``, Slurm's name for it (``SLURMD_NODENAME``) or the short host name, and
    ``check``, the last fresh ``gputopo check`` judgement (``health.state.fresh_judgement``) or ``None``;
    and ``warnings`` (the snapshot's own, given, and why the state file could not be used, if so)."""
    import time

    from gputopo.health.state import fresh_judgement
    from gputopo.system.slurm_node import node_name

    doc, state, warning = _state_read()
    facts: dict[str, Any] = {
        "node": node_name(),
        "check": fresh_judgement(state, time.time()) if state else None,
        "accept": _accept_status(doc, topo),
    }
    if warning is not None:
        facts["warnings"] = (*warnings, warning)
    return facts


def check_state_path() -> Path | None:
    """The state file commands read the last check from (``system.state_file.reader_path``):
    ``GPUTOPO_CHECK_STATE`` (empty: none), else root's ``/var/lib/gputopo/check-state.json``, for every
    user (root saves it 0644 in a 0755 folder)."""
    from gputopo.system.state_file import reader_path

    return reader_path()


def check_state_read() -> tuple[CheckState | None, str | None]:
    """``gputopo check``'s state for this node, read through ``system.state_file`` (a regular file only,
    no link, capped; as root only root's own), and one warning line when it could not be used: ``None``
    and no warning when there is none."""
    _, state, warning = _state_read()
    return state, warning


def _state_read() -> tuple[StateDoc | None, CheckState | None, str | None]:
    """The state document (every section: check's, ``accept``'s), check's state in it, and the warning
    (see ``check_state_read``); one read serves both."""
    from gputopo.health.state import check_state
    from gputopo.system.slurm_node import node_name
    from gputopo.system.state_file import read_state

    path = check_state_path()
    if path is None:
        return None, None, None
    node = node_name()
    read = read_state(path, node, label=f"the check state {path}", fresh="not used")
    if read.refused is not None:
        return None, None, f"{read.refused}; not used"
    warning = "; ".join(read.warnings) or None
    if read.doc is None:
        return None, None, warning
    return read.doc, check_state(read.doc, node), warning


def _accept_status(doc: StateDoc | None, topo: Topology | None) -> dict[str, Any] | None:
    """``gputopo accept``'s verdict in the state (its ``accept`` section) and whether it holds for
    ``topo``'s driver and GPUs (``accept.record.status``)."""
    from gputopo.accept import record

    gpus = [{"index": g.index, "uuid": g.uuid} for g in topo.gpus] if topo is not None else None
    return record.status(record.from_doc(doc), topo.driver_version if topo else None, gpus)
