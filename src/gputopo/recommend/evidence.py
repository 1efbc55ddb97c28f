"""Probe evidence for recommend: a probe report (or the probe section of a doctor report) read into the
GPU groups that failed together (kept apart) and the pair bandwidths it measured (used instead of the
model's), with the machine the report was written on (``topology.identity`` judges whether it is this
one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.errors import InputError

PROBE_SCHEMA = "gputopo/probe/v1"
DOCTOR_SCHEMA = "gputopo/doctor/v1"  # mirrors gputopo.services.doctor.SCHEMA (floors above)


# A probe finding of "slow" is about bandwidth, which the measured figure already carries; every other
# failure kind (nan, diverged, desync, corrupt, hung, crashed) means the GPUs must not work together.
_PERFORMANCE_ONLY_KINDS = frozenset({"slow"})
# The per-GPU check (``gpu``) judges each GPU on its own: a GPU it found slow or corrupt, or whose rank
# crashed there, is left out by itself (mirrors ``gputopo.probe.judge.pergpu.LEAVE_OUT``, which is the
# probe's; recommend reads only the report).
PER_GPU_CHECK = "gpu"
_PER_GPU_LEAVE_OUT = frozenset({"slow", "corrupt", "crashed"})


@dataclass(frozen=True)
class FailedGroup:
    """GPUs a probe check failed on: never all of them in one set (a pair: never together)."""

    gpus: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class Measurement:
    """A measured all-reduce peak busbw for a GPU set (a pair's replaces the model's estimate)."""

    gpus: tuple[int, ...]
    busbw_gbps: float


@dataclass(frozen=True)
class ProbeEvidence:
    """What a probe report says about this machine's GPU sets."""

    source: str
    failed: tuple[FailedGroup, ...] = ()
    measured: tuple[Measurement, ...] = ()
    warnings: tuple[str, ...] = ()
    # The report's ``machine`` record (``None``: an older report without one) and its device.
    machine: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    device: str | None = None


def evidence_from_report(doc: Any, source: str) -> ProbeEvidence:
    """Read a probe report (schema ``gputopo/probe/v1``, already parsed from JSON), or a doctor report
    (``gputopo/doctor/v1``), whose probe document sits under ``probe``.

    The per-GPU check (``gpu``) leaves out each GPU it found slow, corrupt or crashed, by itself. A failed
    check (other than ``slow``) on a set of two GPUs keeps that pair apart; on a larger set it
    keeps the pairs in ``metrics.failed_pairs`` (``[[a, b], ...]``) apart when the check names them, and
    otherwise forbids the whole set together; on one GPU it excludes that GPU. An ``allreduce`` check's
    ``metrics.peak_busbw_gbps`` is a measurement, used only from reports that ran on GPUs
    (``device: cuda``). Raises ``InputError`` when the document is not such a report.
    """

    def bad(what: str) -> InputError:
        return InputError(
            f"--from-report {source}: {what}",
            "give the JSON report that `gputopo probe` or `gputopo doctor` wrote under reports/",
        )

    outer_machine = None
    if isinstance(doc, Mapping) and doc.get("schema") == DOCTOR_SCHEMA:
        outer_machine = doc.get("machine") if isinstance(doc.get("machine"), Mapping) else None
        if doc.get("probe") is None:
            raise bad(
                "a doctor report without a probe section (it ran with --skip-probe or found no GPU to "
                "probe): nothing was measured"
            )
        doc = doc["probe"]
    if not isinstance(doc, Mapping) or doc.get("schema") != PROBE_SCHEMA:
        schema = doc.get("schema") if isinstance(doc, Mapping) else None
        found = f"its schema is {schema!r}" if schema else "it has no schema field"
        raise bad(
            f"not a gputopo probe or doctor report ({found}; "
            f"theirs are {PROBE_SCHEMA!r} and {DOCTOR_SCHEMA!r})"
        )
    sets = doc.get("sets")
    if not isinstance(sets, list):
        raise bad("no 'sets' list")
    on_gpus = doc.get("device") == "cuda"
    failed: list[FailedGroup] = []
    measured: list[Measurement] = []
    skipped_measurements = 0
    for entry in sets:
        gpus = entry.get("gpus") if isinstance(entry, Mapping) else None
        if not isinstance(gpus, list) or not gpus or not all(_is_index(g) for g in gpus):
            raise bad(f"a set without a valid 'gpus' list: {entry!r:.80}")
        group = tuple(sorted(set(gpus)))
        checks = entry.get("checks", [])
        if not isinstance(checks, list):
            raise bad(f"set {list(group)}: 'checks' is not a list")
        for check in checks:
            if not isinstance(check, Mapping):
                raise bad(f"set {list(group)}: a check that is not an object")
            name = str(check.get("name", "?"))
            metrics = check.get("metrics") if isinstance(check.get("metrics"), Mapping) else {}
            if name == PER_GPU_CHECK:
                failed.extend(_per_gpu_groups(metrics, source))
                continue
            if check.get("verdict") == "fail" and check.get("kind") not in _PERFORMANCE_ONLY_KINDS:
                kind = check.get("kind")
                why = f"{name} check failed{f' ({kind})' if kind else ''} in {source}"
                failed.extend(_failed_groups(group, metrics.get("failed_pairs"), why))
            peak = metrics.get("peak_busbw_gbps")
            if name == "allreduce" and isinstance(peak, (int, float)) and peak > 0 and len(group) >= 2:
                if on_gpus:
                    measured.append(Measurement(group, float(peak)))
                else:
                    skipped_measurements += 1
    warnings = ()
    if skipped_measurements:
        warnings = (
            f"{source} ran on {doc.get('device')!s} ranks: its bandwidth says nothing about GPU links, "
            "so the model's estimates stand",
        )
    machine = doc.get("machine") if isinstance(doc.get("machine"), Mapping) else outer_machine
    device = doc.get("device") if isinstance(doc.get("device"), str) else None
    return ProbeEvidence(
        source, tuple(dict.fromkeys(failed)), tuple(measured), warnings, machine=machine, device=device
    )


def _per_gpu_groups(metrics: Mapping[str, Any], source: str) -> list[FailedGroup]:
    """One GPU each for the per-GPU check's slow, corrupt or crashed GPUs (its ``metrics.rows``)."""
    out = []
    for row in metrics.get("rows") or []:
        if (
            isinstance(row, Mapping)
            and row.get("verdict") in _PER_GPU_LEAVE_OUT
            and _is_index(row.get("gpu"))
        ):
            out.append(FailedGroup((row["gpu"],), f"per-GPU check: {row['verdict']} in {source}"))
    return out


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _failed_groups(group: tuple[int, ...], pairs: Any, why: str) -> list[FailedGroup]:
    if len(group) > 2 and isinstance(pairs, list) and pairs:
        named = [
            tuple(sorted(p)) for p in pairs if isinstance(p, list) and len(p) == 2 and all(map(_is_index, p))
        ]
        if named:
            return [FailedGroup(p, why) for p in named if p[0] != p[1]]
    return [FailedGroup(group, why)]
