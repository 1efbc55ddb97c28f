"""The program each rank runs: ``python -m gputopo.probe.worker SPEC.json`` (started by ``launch``).

It joins the process group torch's elastic agent set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
the rendezvous in the environment), runs the launch's checks in order and writes what it measured, one
``check-<name>.json`` per check, from rank 0. Checks that drive every device from one process (p2p, dp)
run in rank 0 while the other ranks wait at a barrier; ddp and the all-reduce sweep run in every rank.

Before any check, every rank records the ``NCCL_*`` and ``CUDA_*`` variables it got, pins its numerics
(``checks.pin_numerics``) and, on GPUs, points NCCL's INIT log at a file of its own; rank 0 gathers the
records into ``env.json`` and, after each NCCL check, reads which transport every connection used. The
logs hold every communicator of the rank, DataParallel's single-process one included (it shows as
``P2P/direct pointer``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

# Grace on top of the parent's --timeout: the parent must always be the one that declares a hang, with
# its diagnosis, before a collective's own timeout turns it into a crash.
COLLECTIVE_TIMEOUT_GRACE_S = 60


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` so a reader never sees half a file: a temporary name, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def environment(device: Any, world: int, gpus: list[int]) -> dict[str, Any]:
    """Versions and devices as rank 0 sees them: torch, CUDA, NCCL, cuDNN, GPU names and bus ids."""
    import torch
    import torchvision

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "cudnn": None,
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "devices": [],
    }
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        env["cudnn"] = torch.backends.cudnn.version()
        for local, index in enumerate(gpus[:world]):
            props = torch.cuda.get_device_properties(local)
            env["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "pci_bus_id": _bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id),
                    "uuid": str(props.uuid),
                    "memory_total_mib": props.total_memory >> 20,
                }
            )
    else:
        env["devices"] = [
            {"index": index, "name": f"CPU rank {r} (stand-in)", "pci_bus_id": None}
            for r, index in enumerate(gpus)
        ]
    return env


def recorded_rank_environment(environ: Any) -> dict[str, str]:
    """The ``NCCL_*`` and ``CUDA_*`` variables this rank got from the launch, before the probe adds any."""
    from gputopo.probe.environment import recorded_variables

    return recorded_variables(environ)


def prepare_rank_environment(environ: Any, device: str, out_dir: Path, rank: int) -> dict[str, str]:
    """Set what this rank needs before CUDA or NCCL start; return what was set (recorded apart).

    cuBLAS is deterministic only with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, see the note under
    ``torch.use_deterministic_algorithms``); NCCL names its transports only in its INIT debug log, so
    each rank logs to a file of its own in ``out_dir`` (``NCCL_DEBUG_FILE``; NCCL reads these variables
    when its first communicator starts, which is after this).
    """
    added: dict[str, str] = {}
    if "CUBLAS_WORKSPACE_CONFIG" not in environ:
        added["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if device == "cuda":
        added["NCCL_DEBUG"] = "INFO"
        added["NCCL_DEBUG_SUBSYS"] = "INIT"
        added["NCCL_DEBUG_FILE"] = str(out_dir / f"nccl-rank{rank}.log")
    for name, value in added.items():
        environ[name] = value
    return added


def rank_records(records: list[Any], backend: str) -> dict[str, Any]:
    """Per-rank variables and numerics as the report shows them, with the caveats they put on the verdict."""
    from gputopo.probe.environment import environment_caveats

    records = sorted((r for r in records if r is not None), key=lambda r: r["rank"])
    return {
        "rank_variables": {str(r["rank"]): r["variables"] for r in records},
        "set_by_probe": records[0]["set_by_probe"] if records else {},
        "numerics": records[0]["numerics"] if records else None,
        "numerics_same_in_every_rank": all(r["numerics"] == records[0]["numerics"] for r in records),
        "caveats": environment_caveats({r["rank"]: r["variables"] for r in records}, backend),
    }


def _bus_id(domain: int, bus: int, device: int) -> str:
    """NVML's spelling of a PCI address, e.g. ``00000000:3B:00.0``."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def run(spec_path: str) -> None:
    """Join the group, run the checks, write the results; any exception ends the rank non-zero."""
    import torch
    import torch.distributed as dist

    from gputopo.probe import checks

    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    variables = recorded_rank_environment(os.environ)
    added = prepare_rank_environment(os.environ, spec["device"], out_dir, rank)
    numerics = checks.pin_numerics()
    if spec["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    ctx = checks.RankContext(rank, world, local_rank, device, spec, out_dir)
    ctx.progress("setup", "join")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=float(spec["timeout_s"]) + COLLECTIVE_TIMEOUT_GRACE_S),
        device_id=device if device.type == "cuda" else None,
    )
    # Every rank's variables and numerics reach rank 0, which writes them with the versions.
    mine = {"rank": rank, "variables": variables, "set_by_probe": added, "numerics": numerics}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        env = environment(device, world, spec["gpus"])
        env.update(rank_records(everyone, "nccl" if device.type == "cuda" else "gloo"))
        write_json(out_dir / "env.json", env)
    try:
        run_checks(ctx)
    finally:
        dist.destroy_process_group()


def run_checks(ctx: Any) -> None:
    """The launch's checks in order; the references run once per precision, before the first check
    needing them (``amp.training_check``)."""
    from gputopo.probe import amp, checks, speed_run
    from gputopo.probe.precision import split_check

    refs: dict[str, Any] = {}
    for check in ctx.spec["checks"]:
        ctx.progress(check, "start")
        base, precision = split_check(check)
        metrics: dict[str, Any] = {}
        if base in ("dp", "ddp"):
            # dp runs in rank 0 (one process drives every device, as DataParallel users' scripts do).
            metrics = amp.training_check(ctx, base, precision, refs)
        elif check == "p2p":
            if ctx.rank == 0:
                metrics = checks.p2p_check(ctx)
            checks.barrier(ctx)
        elif check == "speed":
            metrics = speed_run.speed_check(ctx)
        else:
            metrics = checks.allreduce_check(ctx)
        if base in ("ddp", "allreduce") and ctx.is_cuda:
            checks.barrier(ctx)  # every rank has logged its connections before rank 0 reads the logs
            if ctx.rank == 0:
                metrics["transports"] = checks.nccl_transports(ctx)
        if ctx.rank == 0:
            write_json(ctx.out_dir / f"check-{check}.json", metrics)
        ctx.progress(check, "done")


def main() -> None:
    """Entry point; torch's ``record`` puts an uncaught exception's traceback where the agent reads it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run)(sys.argv[1])
    # Everything is written and flushed: skip the interpreter's slow torch teardown, which the verdict
    # would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
