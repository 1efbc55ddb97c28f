"""A training job that hangs, for `gputopo run` + `gputopo hang` end to end (run under torchrun).

Every rank joins a gloo group (torchrun's env:// rendezvous), all-reduces a few times, then the last
rank "stalls in its data loader" and never enters the next all-reduce while the others wait in it. A
timer in every rank plays the NCCL watchdog's dump-on-timeout (gloo has none): it writes the rank's
Flight Recorder dump with torch's dump API to ``TORCH_FR_DUMP_TEMP_FILE<rank>``, the file `gputopo run`
armed, while the other ranks are still stuck inside the collective, and ends the rank.

``HANG_JOB_DUMP_AFTER_S=never`` leaves the timer out: the job hangs until it is stopped (what a job
under NCCL's default 10-minute watchdog does for its first 10 minutes), for ``gputopo hang --live`` and
for the evidence a stopped ``gputopo run`` takes. ``HANG_JOB_TIMEOUT_S`` sets gloo's timeout (60 s).
``HANG_JOB_CONTROL_PLANE=1`` runs main inside torch's control plane (``worker_main``) on the socket
docs/hang.md tells a script to use, so the Flight Recorder can be read while the job hangs.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

DUMP_AFTER_S = os.environ.get("HANG_JOB_DUMP_AFTER_S", "4")
TIMEOUT_S = float(os.environ.get("HANG_JOB_TIMEOUT_S", "60"))


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

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(8)
    for _ in range(3):
        train_step(dist, t)
    dist.barrier()
    if DUMP_AFTER_S != "never":
        threading.Timer(float(DUMP_AFTER_S), dump_and_leave, args=(rank,)).start()
    stuck = int(os.environ.get("HANG_JOB_STUCK_RANK", world - 1))
    if rank == stuck:
        stall_in_data_loader(TIMEOUT_S)
    else:
        train_step(dist, t)
    time.sleep(TIMEOUT_S)


if __name__ == "__main__":
    if os.environ.get("HANG_JOB_CONTROL_PLANE") == "1":
        import tempfile

        from torch.distributed.elastic.control_plane import worker_main

        # docs/hang.md: one socket per rank, where gputopo looks for it
        sock = Path(tempfile.gettempdir()) / f"gputopo-worker-{os.getpid()}.sock"
        os.environ.setdefault("TORCH_WORKER_SERVER_SOCKET", str(sock))
        with worker_main():
            main()
    else:
        main()
