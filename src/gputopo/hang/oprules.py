"""When two ranks' calls of one collective agree, op by op, as torch's own analyzer decides it (pure).

torch's rules (torch/distributed/flight_recorder/components/types.py, ``Op.match`` and
``Op.dtype_mismatch``; the same in torch 2.14 and main), in its order:
1. the op types must be equal (``COLLECTIVE_TYPE_MISMATCH``);
2. input sizes must be equal, except for ``all_to_all`` and ``scatter`` (an MoE's uneven splits, and
   scatter's input that only its root holds);
3. output sizes must be equal, except for ``all_to_all`` and ``gather`` (gather's output is the root's);
4. ``all_reduce`` / ``allreduce_coalesced``: the input sizes equal the other's output sizes;
5. ``all_gather`` (``_all_gather_base``, ``all_gather_into_tensor_coalesced``): the other's first output
   holds the first input's elements times the group size;
6. ``reduce_scatter`` (``_reduce_scatter_base``, ``reduce_scatter_tensor_coalesced``): the other's first
   input holds the first output's elements times the group size;
7. dtypes (as sets): input vs output, except scatter/gather/broadcast; input vs the other's input, except
   scatter/broadcast; output vs the other's output, except gather; each only where both lists are
   non-empty;
8. ``coalesced`` / ``ALLGATHER_coalesced`` / ``REDUCE_SCATTER_coalesced``: only the type is compared.

gputopo's one widening: torch names the size-free op ``all_to_all``; the profiling names
``all_to_all_single``, ``all_to_all_v_single`` and ``alltoall_base`` are the same exchange with
per-rank splits (gloo 2.14 records ``all_to_all_single`` as ``gloo:all_to_all``, measured), so they get
its rule. A sum over every rank of ``all_to_all``'s input elements must still equal the sum of its
output elements (torch's ``check_size_alltoall``): see ``alltoall_totals``.
"""

from __future__ import annotations

import math
from typing import Any

ALL_TO_ALL = frozenset({"all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall_base"})
FREE_INPUT = ALL_TO_ALL | {"scatter"}
FREE_OUTPUT = ALL_TO_ALL | {"gather"}
IN_EQUALS_OUT = frozenset({"all_reduce", "allreduce_coalesced"})
GATHERS = frozenset({"all_gather", "all_gather_base", "_all_gather_base", "all_gather_into_tensor_coalesced"})
SCATTERS = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"})
TYPE_ONLY = frozenset({"coalesced", "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced"})
# Rule 7's exceptions.
NO_IN_OUT_DTYPE = frozenset({"scatter", "gather", "broadcast"})
NO_IN_DTYPE = frozenset({"scatter", "broadcast"})
NO_OUT_DTYPE = frozenset({"gather"})
# The ops whose sizes or dtypes need more than "equal everywhere": entries of these take the full rules.
LOOSE = FREE_INPUT | FREE_OUTPUT | GATHERS | SCATTERS | TYPE_ONLY | NO_IN_OUT_DTYPE


def op_name(e: dict[str, Any]) -> str:
    """``nccl:all_reduce`` -> ``all_reduce``; ``nccl:send 0->1`` -> ``send``."""
    prof = str(e.get("profiling_name", ""))
    return prof.rpartition(":")[2].split(" ", 1)[0]


def entry_key(e: dict[str, Any]) -> tuple[Any, ...]:
    """What two ranks' entries must share to match under rules 1-3 and 7 (hashable): the profiling name,
    the sizes and dtypes that torch compares for this op."""
    op = op_name(e)
    prof = e.get("profiling_name")
    if op in TYPE_ONLY:
        return (prof,)
    ins = e.get("input_sizes") or []
    outs = e.get("output_sizes") or []
    in_dt = frozenset(e.get("input_dtypes") or ()) if ins and op not in NO_IN_DTYPE else None
    out_dt = frozenset(e.get("output_dtypes") or ()) if outs and op not in NO_OUT_DTYPE else None
    return (
        prof,
        None if op in FREE_INPUT else tuple(map(tuple, ins)),
        None if op in FREE_OUTPUT else tuple(map(tuple, outs)),
        in_dt,
        out_dt,
    )


def _numel(sizes: list[Any]) -> int | None:
    return math.prod(sizes[0]) if sizes and isinstance(sizes[0], list) else None


def mismatch(mine: dict[str, Any], ref: dict[str, Any], pg_size: int) -> tuple[str, str] | None:
    """(kind, what) when ``mine`` does not match the reference call ``ref`` by torch's rules 1-8, else
    ``None``. kind is ``op``, ``size`` or ``dtype``."""
    a, b = op_name(mine), op_name(ref)
    if a != b:
        return "op", f"calls {a} where the others call {b}"
    if a in TYPE_ONLY:
        return None
    ins, outs = mine.get("input_sizes") or [], mine.get("output_sizes") or []
    r_ins, r_outs = ref.get("input_sizes") or [], ref.get("output_sizes") or []
    if a not in FREE_INPUT and ins != r_ins:
        return "size", f"{a} with input sizes {ins} where the others have {r_ins}"
    if a not in FREE_OUTPUT and outs != r_outs:
        return "size", f"{a} with output sizes {outs} where the others have {r_outs}"
    if a in IN_EQUALS_OUT and ins != r_outs:
        return "size", f"{a} with input sizes {ins} where the others' outputs are {r_outs}"
    n_in, n_out, r_n_in, r_n_out = _numel(ins), _numel(outs), _numel(r_ins), _numel(r_outs)
    if a in GATHERS and r_n_out is not None and n_in is not None and r_n_out != n_in * pg_size:
        return "size", (
            f"{a} of {_numel(ins)} elements per rank, but the others gather {_numel(r_outs)} "
            f"(not {pg_size} x {_numel(ins)})"
        )
    if a in SCATTERS and r_n_in is not None and n_out is not None and r_n_in != n_out * pg_size:
        return "size", (
            f"{a} into {_numel(outs)} elements per rank, but the others scatter {_numel(r_ins)} "
            f"(not {pg_size} x {_numel(outs)})"
        )
    in_dt, out_dt = set(mine.get("input_dtypes") or ()), set(mine.get("output_dtypes") or ())
    r_in_dt, r_out_dt = set(ref.get("input_dtypes") or ()), set(ref.get("output_dtypes") or ())
    if (
        (a not in NO_IN_OUT_DTYPE and ins and outs and in_dt != out_dt)
        or (a not in NO_IN_DTYPE and ins and r_ins and in_dt != r_in_dt)
        or (a not in NO_OUT_DTYPE and outs and r_outs and out_dt != r_out_dt)
    ):
        return "dtype", (
            f"{a} with dtype {sorted(in_dt | out_dt)} where the others have {sorted(r_in_dt | r_out_dt)}"
        )
    return None


def alltoall_totals(calls: list[dict[str, Any]]) -> tuple[int, int] | None:
    """Every rank's all_to_all at one sequence id: (input elements, output elements) summed over the
    ranks, when they differ (torch's ``check_size_alltoall``: what one rank sends another must receive),
    else ``None``."""
    total_in = sum(math.prod(t) for e in calls for t in e.get("input_sizes") or [])
    total_out = sum(math.prod(t) for e in calls for t in e.get("output_sizes") or [])
    return (total_in, total_out) if total_in != total_out else None
