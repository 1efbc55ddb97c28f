"""torch's own analyzer (``torch.distributed.flight_recorder``, the code behind ``torchfrtrace``) as a
second opinion on the dumps the safe loader read. Imported only when asked for.

Fed as-is, torch 2.14's analyzer raises ``KeyError: ('0', 0)`` on gloo dumps: its
``build_groups_memberships`` keys groups by ``pg_config``'s names, gloo records every group there under
``''`` while the entries name it ``'0'`` (see ``match``). So the analyzer gets each dump's entries with a
``pg_config`` rebuilt from the groups our matching found (name, desc, members); everything else is what
the dump holds. Its findings (the first collective per group with missing ranks or a mismatch) are
compared with ours. It must never be what makes ``gputopo hang`` fail: any exception it raises becomes
``error`` here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from gputopo.hang.load import Dump
from gputopo.hang.match import MatchResult

MODULE = "torch.distributed.flight_recorder"


@dataclass(frozen=True)
class TorchOpinion:
    """What torch's analyzer said about the first troubled collective of each group."""

    ran: bool
    torch_version: str | None
    error: str | None = None
    # (pg, seq) -> {"op", "missing_ranks", "culprits", "mismatch"}
    problems: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    messages: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "ran": self.ran,
            "module": MODULE,
            "torch_version": self.torch_version,
            "error": self.error,
            "problems": [{"pg": pg, "seq": seq, **info} for (pg, seq), info in sorted(self.problems.items())],
        }


def torch_available() -> bool:
    """Whether torch's analyzer can be imported, found without importing torch."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def ask_torch(dumps: list[Dump], ours: MatchResult) -> TorchOpinion:
    """Run torch's ``build_db`` on ``dumps`` with ``pg_config`` rebuilt from the groups ``ours`` found
    (name -> desc, global ranks); never raises."""
    members = ours.members
    logger = logging.getLogger("Flight Recorder")
    logger.disabled = True  # its import says "tabulate is not installed" on stderr
    try:
        import torch  # noqa: TID251 -- torch's analyzer, on request only; see the module docstring
        from torch.distributed.flight_recorder.components.builder import (  # noqa: TID251
            build_db,
        )
    except Exception as exc:  # torch missing or broken: no opinion
        return TorchOpinion(False, None, f"cannot import {MODULE}: {type(exc).__name__}: {exc}")
    finally:
        logger.disabled = False
    version = str(getattr(torch, "__version__", "")) or None
    shared = {
        name: {"name": name, "desc": desc, "ranks": str(sorted(ranks))}
        for name, (desc, ranks) in members.items()
    }

    def pg_config(rank: int) -> dict[str, dict[str, str]]:
        """The rank's own groups (a name can stand for different ranks on different ranks: split_group),
        as torch's builder reads them per rank (``_pg_guids[(pg_uid, global_rank)]``)."""
        own = ours.rank_groups.get(rank)
        if not own:
            return shared
        return {
            **shared,
            **{n: {"name": n, "desc": desc, "ranks": str(sorted(rs))} for n, (desc, rs) in own.items()},
        }

    details = {
        f"rank{d.rank}": {
            "host_name": f"rank{d.rank}",
            "rank": d.rank,
            "entries": list(d.entries),
            "version": d.version,
            "pg_config": pg_config(d.rank),
        }
        for d in dumps
    }
    args = argparse.Namespace(
        verbose=False,
        just_print_entries=False,
        allow_incomplete_ranks=True,
        mismatch_cap=10,
        selected_ranks=None,
        pg_filters=None,
        print_stack_trace=False,
        output=None,
    )
    captured = _Capture()
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers = [captured]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        db = build_db(details, args, dumps[0].version if dumps else "")
    except BaseException as exc:  # noqa: BLE001 -- its failures must not become ours (SystemExit too)
        return TorchOpinion(True, version, f"{type(exc).__name__}: {exc}", messages=tuple(captured.lines))
    finally:
        logger.handlers, level, logger.propagate = saved[0], saved[1], saved[2]
        logger.setLevel(level)
    problems: dict[tuple[str, int], dict[str, Any]] = {}
    for c in db.collectives:
        if c.pass_check and not c.missing_ranks:
            continue
        key = (str(c.group_id), int(c.collective_seq_id))
        if any(k[0] == key[0] for k in problems):
            continue  # the first troubled collective of each group, as ours
        mism = c.mismatch_collectives or {}
        kinds = sorted(
            {str(getattr(getattr(m, "type_of_mismatch", None), "state", "")) for m in mism.values()}
        )
        problems[key] = {
            "op": str(c.collective_name).rpartition(":")[2],
            "missing_ranks": sorted(c.missing_ranks or ()),
            "culprits": sorted(mism),
            "mismatch": [k.rpartition(".")[2] for k in kinds if k],
        }
    return TorchOpinion(True, version, None, problems, tuple(captured.lines))


def compare(opinion: TorchOpinion, ours: MatchResult, missing: set[int]) -> list[str]:
    """Where torch's analyzer and ours disagree on a group's first troubled collective, in words."""
    if not opinion.ran or opinion.error:
        return []
    diffs: list[str] = []
    for g in ours.groups:
        if g.p2p:
            # torch's analyzer files point-to-point ops under their collective_seq_id, with the op's
            # name ("send 0->1"): the group's problem whose op is a send or recv is the same one.
            theirs = next(
                (
                    v
                    for (pg, _), v in opinion.problems.items()
                    if pg == g.pg and str(v["op"]).split(" ")[0] in ("send", "recv")
                ),
                None,
            )
        else:
            theirs = opinion.problems.get((g.pg, g.collective.seq))
        our_ranks = set(g.never_entered) | {m.rank for m in g.mismatches}
        if theirs is None and not our_ranks:
            continue  # ours names only ranks without a dump; torch's cannot decide without them
        if theirs is None:
            diffs.append(f"group {g.pg}: torch's analyzer finds nothing wrong at seq {g.collective.seq}")
            continue
        their_ranks = (set(theirs["missing_ranks"]) | set(theirs["culprits"])) - missing
        if our_ranks != their_ranks:
            diffs.append(
                f"group {g.pg} seq {g.collective.seq}: torch's analyzer names ranks {sorted(their_ranks)}, "
                f"ours {sorted(our_ranks)}"
            )
    for pg, seq in opinion.problems:
        if not any(g.pg == pg for g in ours.groups):
            diffs.append(f"group {pg}: torch's analyzer reports seq {seq}, ours finds the group healthy")
    return diffs


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # a message that cannot format is not ours to fix
            self.lines.append(record.getMessage())
