"""The one rule for a list of GPUs on the command line (``probe --gpus``, ``recommend --exclude``,
``kill-stale --gpus``).

A list is items separated by commas; spaces around an item are ignored. An item is

- a GPU index as nvidia-smi numbers them: ``5``;
- the same with nvidia-smi's label: ``GPU5`` (any case), as pasted from ``nvidia-smi topo -m``;
- an inclusive range: ``0-3`` is ``0,1,2,3`` (``GPU0-GPU3`` too).

The result keeps the order given. An empty item (``5,,6``), anything else (``a``, ``-1``, ``3-1``) or a
GPU listed twice is a usage error naming the item, so a typo never silently changes the set.
Whether the GPUs exist is for the caller to judge: it knows the machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gputopo.errors import UsageError

_ITEM_RE = re.compile(r"(?:GPU)?(\d+)(?:\s*-\s*(?:GPU)?(\d+))?", re.IGNORECASE)
_MAX_INDEX = 1023  # far above any machine; keeps `0-999999999` from building a huge list


def parse_gpu_list(text: str, option: str = "--gpus") -> tuple[int, ...]:
    """``"5,6"`` -> ``(5, 6)``; ``"GPU0-GPU3"`` -> ``(0, 1, 2, 3)``; ``UsageError`` naming the bad item."""
    hint = f"give nvidia-smi GPU indices separated by commas, e.g. {option} 5,6 (or GPU5,GPU6, or 0-3)"
    if not text.strip():
        raise UsageError(f"{option}: the GPU list is empty", hint)
    out: list[int] = []
    for raw in text.split(","):
        item = raw.strip()
        m = _ITEM_RE.fullmatch(item)
        if not m:
            what = "an empty item" if not item else f"'{item}' is not a GPU index or range"
            raise UsageError(f"{option} {text}: {what}", hint)
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if last < first:
            raise UsageError(f"{option} {text}: the range '{item}' runs backwards", hint)
        if last > _MAX_INDEX:
            raise UsageError(f"{option} {text}: GPU{last} is beyond any machine", hint)
        for g in range(first, last + 1):
            if g in out:
                raise UsageError(f"{option} {text}: GPU{g} is listed twice", "list each GPU once")
            out.append(g)
    return tuple(out)


def format_id_ranges(ids: Iterable[int]) -> str:
    """Ids (GPUs, ranks, CPUs, NUMA nodes) the way nvidia-smi writes CPU affinity: ``[0..31, 64..95]`` ->
    ``0-31,64-95``; the inverse of a list's ranges above."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
