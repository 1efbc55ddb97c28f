"""A training loop with one slow rank, for `gputopo run` + `gputopo slow` end to end (run under torchrun).

Every rank joins a gloo group (torchrun's env:// rendezvous) and runs STEPS steps of "compute" (a
sleep of STEP_MS) and one all-reduce. ``SLOW_JOB_RANK`` (if set) sleeps ``SLOW_JOB_EXTRA_MS`` more each
step: the rank the others wait for. At the end each rank writes its Flight Recorder dump with torch's
dump API to ``TORCH_FR_DUMP_TEMP_FILE<rank>``, the file `gputopo run` armed (gloo never dumps by itself).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

STEPS = int(os.environ.get("SLOW_JOB_STEPS", "40"))
STEP_MS = float(os.environ.get("SLOW_JOB_STEP_MS", "20"))


def compute(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    slow = os.environ.get("SLOW_JOB_RANK")
    extra = float(os.environ.get("SLOW_JOB_EXTRA_MS", "0")) if slow is not None and int(slow) == rank else 0.0
    t = torch.ones(1024)
    dist.barrier()
    for _ in range(STEPS):
        compute((STEP_MS + extra) / 1000.0)
        dist.all_reduce(t)
    dist.barrier()
    Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)).write_bytes(_dump_fr_trace())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
