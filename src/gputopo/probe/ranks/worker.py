"""The program each pool rank runs: ``python -m gputopo.probe.ranks.worker SPEC.json`` (started by the
agent, ``ranks.agent``).

It joins the world group torch's elastic agent set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous in the environment), one rank per GPU of the pool, then walks the schedule: in each step it
runs the job whose set holds its GPU, inside that set's process subgroup, and meets every other rank at
a barrier. A job's checks write what they measured, one ``check-<name>.json`` each, from the set's rank
0. Checks that drive every device from one process (p2p, dp) run in the set's rank 0, which sees all the
pool's devices, while the set's other ranks wait on the CPU (a gloo group per set); ddp and the
all-reduce sweep run in every rank of the set.

Before any check, every rank records the ``NCCL_*`` and ``CUDA_*`` variables it got, pins its numerics
(``numerics.pin_numerics``) and, on GPUs, points NCCL's INIT log at a file of its own; rank 0 gathers the
records into ``env.json`` and, after each NCCL check, reads which transport every connection of the set's
ranks used. The logs hold every communicator of the rank over the pool's life (the world group and
earlier sets' groups too), DataParallel's single-process one included (it shows as
``P2P/direct pointer``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from gputopo.probe.ranks.compat import new_group_in_order
from gputopo.probe.shared import COLLECTIVE_TIMEOUT_GRACE_S

# Where each rank writes its cProfile statistics (CPU time), for the benchmark's profile; unset: none.
PROFILE_ENV = "GPUTOPO_RANK_PROFILE_DIR"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` so a reader never sees half a file: a temporary name, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def environment(device: Any, world: int, gpus: list[int]) -> dict[str, Any]:
    """Versions and devices as rank 0 sees them: torch, CUDA, NCCL, cuDNN, GPU names and bus ids."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:  # its version without importing it: a rank training the micro model never loads torchvision
        torchvision_version: str | None = version("torchvision")
    except PackageNotFoundError:
        torchvision_version = None
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version,
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
    from gputopo.probe.judge.environment import recorded_variables

    return recorded_variables(environ)


def prepare_rank_environment(environ: Any, device: str, out_dir: Path, rank: int) -> dict[str, str]:
    """Set what this rank needs before CUDA or NCCL start; return what was set (recorded apart).

    cuBLAS is deterministic only with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, see the note under
    ``torch.use_deterministic_algorithms``). NCCL names its transports only in its INIT debug log, so
    where the user set no ``NCCL_DEBUG`` the probe asks for INFO on the INIT subsystem (and says so: it
    is in ``set_by_probe``); a user's level (and subsystems) are kept as they are, even WARN, at the cost
    of the transport table. Each rank logs to a file of its own in ``out_dir`` (``NCCL_DEBUG_FILE``,
    unless the user named one), which the verdict reads back for NCCL's WARN lines, the root cause a
    crash's stderr would otherwise lack. NCCL reads these variables when its first communicator starts,
    which is after this.
    """
    added: dict[str, str] = {}
    if "CUBLAS_WORKSPACE_CONFIG" not in environ:
        added["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if device == "cuda":
        if "NCCL_DEBUG" not in environ:
            added["NCCL_DEBUG"] = "INFO"
            if "NCCL_DEBUG_SUBSYS" not in environ:
                added["NCCL_DEBUG_SUBSYS"] = "INIT"
        if "NCCL_DEBUG_FILE" not in environ:
            added["NCCL_DEBUG_FILE"] = str(out_dir / f"nccl-rank{rank}.log")
    for name, value in added.items():
        environ[name] = value
    return added


def rank_records(records: list[Any], backend: str) -> dict[str, Any]:
    """Per-rank variables and numerics as the report shows them, with the caveats they put on the verdict."""
    from gputopo.probe.judge.environment import environment_caveats

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


def check_identity(spec: dict[str, Any], local_rank: int) -> None:
    """Fail this rank (and so the launch, with the message in its verdict) unless CUDA device
    ``local_rank`` is the GPU NVML named for it: same PCI bus id."""
    import torch

    from gputopo.probe.plan.identity import check_rank_device

    expected = spec.get("bus_ids") or []
    if local_rank >= len(expected):
        return
    props = torch.cuda.get_device_properties(local_rank)
    got = _bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    check_rank_device(local_rank, spec["gpus"][local_rank], expected[local_rank], got)


def run(spec_path: str) -> None:
    """Join the pool, run the schedule step by step, write the results; an exception ends the rank."""
    import torch
    import torch.distributed as dist

    from gputopo.probe.ranks.numerics import pin_numerics

    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    variables = recorded_rank_environment(os.environ)
    added = prepare_rank_environment(os.environ, spec["device"], out_dir, rank)
    numerics = pin_numerics()
    if spec["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        check_identity(spec, local_rank)
    else:
        device = torch.device("cpu")
    log = open(out_dir / f"progress-rank{rank}.jsonl", "a")  # noqa: SIM115 - lives as long as the rank
    pool_row(log, rank, "join")  # torch is imported: the rank joins the world group now
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=collective_timeout(spec),
        device_id=device if device.type == "cuda" else None,
    )
    pool_row(log, rank, "ready")
    if "cross" in spec:  # a multi-node launch: the inter-node tests (gputopo.probe.ranks.crossnode)
        from gputopo.probe.ranks import crossnode

        try:
            crossnode.run(spec, rank, world, local_rank, device, log)
        finally:
            dist.destroy_process_group()
        return
    # Every rank's variables and numerics reach rank 0, which writes them with the versions.
    mine = {"rank": rank, "variables": variables, "set_by_probe": added, "numerics": numerics}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        env = environment(device, world, spec["gpus"])
        env.update(rank_records(everyone, "nccl" if device.type == "cuda" else "gloo"))
        write_json(out_dir / "env.json", env)
    try:
        run_schedule(spec, rank, device, log)
    finally:
        dist.destroy_process_group()


def pool_row(log: Any, rank: int, stage: str, step: int = 0) -> None:
    """A progress row about the pool rather than a job: joined, ready, entering a step."""
    row = {"t": time.time(), "pool_rank": rank, "rank": rank, "task": None, "check": "pool", "stage": stage}
    # The rank's own CPU seconds so far: the launch record splits them by step (where the CPU goes).
    row.update({"done": step, "total": 0, "cpu_s": round(time.process_time(), 3)})
    log.write(json.dumps(row) + "\n")
    log.flush()


def collective_timeout(spec: dict[str, Any]) -> timedelta:
    """Every group's timeout: the run's ``--timeout`` and a grace, so the parent, not a rank's watchdog,
    calls a hang (and reports it as one, not as a crash)."""
    return timedelta(seconds=float(spec["timeout_s"]) + COLLECTIVE_TIMEOUT_GRACE_S)


def set_groups(
    ranks: list[int], spec: dict[str, Any], device_type: str, new_group: Any = None
) -> tuple[Any, Any]:
    """The set's process group and the CPU group its idle ranks wait in; every rank calls this.

    Both get the run's timeout: ``new_group`` without one falls back to the backend's default
    (torch/distributed/distributed_c10d.py, ``_new_group_with_tag``: ``_get_default_timeout``, 10 min for
    NCCL), not ``init_process_group``'s, and NCCL's watchdog would then kill a rank before ``--timeout``.
    A set's order is its ranks' order (--gpus 6,5: GPU 6 is rank 0), so neither group sorts them
    (``compat.new_group_in_order``, the default ``new_group``). The waiting group is gloo on GPUs:
    ``ProcessGroupNCCL`` implements a barrier as a one-element all-reduce on the device (``barrier``'s
    docstring), whose kernel would spin on the very GPUs rank 0 is timing; gloo waits on the CPU. On CPU
    ranks the set's group is gloo already.
    """
    make = new_group or new_group_in_order
    timeout = collective_timeout(spec)
    group = make(ranks, timeout=timeout)
    if device_type != "cuda":
        return group, group
    return group, make(ranks, timeout=timeout, backend="gloo")


def last_steps(schedule: list[list[dict[str, Any]]]) -> dict[tuple[int, ...], int]:
    """The last step each set (its ranks) takes part in: its groups are destroyed after it."""
    return {tuple(job["ranks"]): k for k, step in enumerate(schedule) for job in step}


def run_schedule(spec: dict[str, Any], rank: int, device: Any, log: Any) -> None:
    """Every step in order: create the step's new groups, run this rank's job, meet the others.

    ``new_group`` must be entered by every rank of the world, for every group, in the same order, even
    by ranks outside the group (torch.distributed.new_group's docstring; ``split_group`` exists in this
    torch but supports only NCCL), so the groups of a step are created by all ranks at the step's start.
    The barrier at the end keeps timed checks alone in their step. A set's groups are destroyed after the
    step-end barrier of its last step, by every rank at the same point (``destroy_process_group`` of a
    group its rank is not in returns at once), so NCCL's communicators and their buffers do not pile up
    over a long schedule.
    """
    import torch.distributed as dist

    from gputopo.probe.ranks.context import RankContext

    groups: dict[tuple[int, ...], tuple[Any, Any]] = {}
    last = last_steps(spec["schedule"])
    common = {k: v for k, v in spec.items() if k != "schedule"}
    for k, step in enumerate(spec["schedule"]):
        pool_row(log, rank, "step", k)
        for job in step:
            key = tuple(job["ranks"])
            if key not in groups:
                groups[key] = set_groups(list(key), spec, device.type)
                if rank in key and dist.get_group_rank(groups[key][0], rank) != key.index(rank):
                    raise RuntimeError(f"group {key}: rank {rank} is not rank {key.index(rank)} in it")
        for job in step:
            if rank in job["ranks"]:
                key = tuple(job["ranks"])
                ctx = RankContext(
                    job["ranks"].index(rank),
                    len(job["ranks"]),
                    device.index or 0,
                    device,
                    {**common, **job},
                    Path(job["out_dir"]),
                    _progress_file=log,
                    task=job["id"],
                    pool_rank=rank,
                    log_dir=Path(spec["out_dir"]),
                    wait_group=groups[key][1],
                )
                run_checks(ctx, groups[key][0], list(key))
                ctx.progress("task", "done")
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
        for key in [key for key in groups if last[key] == k]:
            for group in dict.fromkeys(groups.pop(key)):
                dist.destroy_process_group(group)
    pool_row(log, rank, "end", len(spec["schedule"]))


def run_checks(ctx: Any, group: Any = None, devices: list[int] | None = None) -> None:
    """One job's checks in order; the references run once per precision, before the first check needing
    them (``precision.training_check``).

    ``ctx.rank`` and ``ctx.world`` count within the job's set; collectives go to ``group`` (the set's
    subgroup); ``devices`` are the set's local CUDA devices (pool rank r drives device r).
    """
    from gputopo.probe.judge.precision import split_check
    from gputopo.probe.ranks import allreduce, numerics, p2p
    from gputopo.probe.ranks import speed as speed_run
    from gputopo.probe.ranks.context import barrier, wait_for_others
    from gputopo.probe.ranks.precision import training_check

    refs: dict[str, Any] = {}
    for check in ctx.spec["checks"]:
        ctx.progress(check, "start")
        base, precision = split_check(check)
        metrics: dict[str, Any] = {}
        if base in ("dp", "ddp"):
            # dp runs in rank 0 (one process drives every device, as DataParallel users' scripts do).
            metrics = training_check(ctx, base, precision, refs, group, devices)
        elif check == "p2p":
            if ctx.rank == 0:
                metrics = p2p.p2p_check(ctx, devices)
            wait_for_others(ctx, group)
        elif check == "speed":
            metrics = speed_run.speed_check(ctx, group, devices)
        elif check == "gpu":
            from gputopo.probe.ranks.pergpu import gpu_check

            metrics = gpu_check(ctx, group)
        else:
            metrics = allreduce.allreduce_check(ctx, group)
        if base in ("ddp", "allreduce") and ctx.is_cuda:
            barrier(ctx, group)  # every rank has logged its connections before rank 0 reads the logs
            if ctx.rank == 0:
                metrics["transports"] = numerics.nccl_transports(ctx)
        if ctx.rank == 0:
            write_json(ctx.out_dir / f"check-{check}.json", metrics)
        ctx.progress(check, "done")


def main() -> None:
    """Entry point; torch's ``record`` puts an uncaught exception's traceback where the agent reads it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    profile_dir = os.environ.get(PROFILE_ENV)
    if profile_dir:  # benchmarks/bench_doctor.py --profile: one cProfile file per pool rank
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU time: a rank waiting at a barrier costs nothing
        prof.enable()
        try:
            record(run)(sys.argv[1])
        finally:
            prof.disable()
            prof.dump_stats(Path(profile_dir) / f"rank{os.environ.get('RANK', 0)}.prof")
    else:
        record(run)(sys.argv[1])
    # Everything is written and flushed: skip the interpreter's slow torch teardown, which the verdict
    # would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
