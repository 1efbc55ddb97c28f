"""A training job that hangs, for `gputopo run` + `gputopo hang` end to end (run under torchrun).

Every rank joins a gloo group (torchrun's env:// rendezvous), all-reduces a few times, then the last
rank "stalls in its data loader" and never enters the next all-reduce while the others wait in it. A
timer in every rank plays the NCCL watchdog's dump-on-timeout (gloo has none): it writes the rank's
Flight Recorder dump with torch's dump API to ``TORCH_FR_DUMP_TEMP_FILE<rank>``, the file `gputopo run`
armed, while the other ranks are still stuck inside the collective, and ends the rank.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

DUMP_AFTER_S = 4.0


def train_step(dist, t):
    dist.all_reduce(t)


def stall_in_data_loader(seconds):
    time.sleep(seconds)


def dump_and_leave(rank: int) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace

    Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)).write_bytes(_dump_fr_trace())
    os._exit(0)  # skip gloo's teardown: the peers are stuck


def main() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(8)
    for _ in range(3):
        train_step(dist, t)
    dist.barrier()
    threading.Timer(DUMP_AFTER_S, dump_and_leave, args=(rank,)).start()
    if rank == world - 1:
        stall_in_data_loader(60)
    else:
        train_step(dist, t)
    time.sleep(60)


if __name__ == "__main__":
    main()
