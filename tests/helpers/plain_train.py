"""A training loop as a user writes it: no worker_main(), no Flight Recorder dump call, nothing for
gputopo. Every rank joins a gloo group and runs STEPS steps of "compute" (a sleep of STEP_MS) and one
all-reduce; ``PLAIN_TRAIN_RANK`` (if set) sleeps ``PLAIN_TRAIN_EXTRA_MS`` more each step."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

STEPS = int(os.environ.get("PLAIN_TRAIN_STEPS", "600"))
STEP_MS = float(os.environ.get("PLAIN_TRAIN_STEP_MS", "20"))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    slow = os.environ.get("PLAIN_TRAIN_RANK")
    extra = (
        float(os.environ.get("PLAIN_TRAIN_EXTRA_MS", "0")) if slow is not None and int(slow) == rank else 0
    )
    t = torch.ones(1024)
    for _ in range(STEPS):
        time.sleep((STEP_MS + extra) / 1000.0)
        dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
