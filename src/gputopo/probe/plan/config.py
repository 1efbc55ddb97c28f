"""The probe's options, checked and frozen before any GPU is touched.

``build_config`` is pure: it takes the command-line values and a ``DeviceInventory`` (what exists) and
returns a ``ProbeConfig`` or raises ``UsageError``. ``pool.devices.detect_devices`` is the one place
that asks the machine and torch what exists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gputopo.errors import UnavailableError, UsageError
from gputopo.probe.judge.precision import DEFAULT_PRECISION, PRECISIONS, expand_checks
from gputopo.probe.plan.identity import GpuIdentity, check_requested
from gputopo.probe.plan.options import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_MODEL,
    DEFAULT_REPORT_DIR,
    DEFAULT_SEED,
    DEFAULT_STEP_FACTOR,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT_S,
    Fault,
    Mode,
)

MODELS = ("resnet18", "resnet50", "tiny", "micro")

# DCGM's diagnostic flags a GPU more than about 10% below its peers (its ``gflops_tolerance_pcnt``).
DEFAULT_TOLERANCE = 0.10
# CPU stand-ins share a small machine with everything else on it: repeated runs of the same stand-in
# measured up to 15-20% apart on 2 busy cores, so a stand-in is slow only 25% below its peers unless
# --tolerance says otherwise (the slow drill halves the speed, far beyond either).
CPU_TOLERANCE = 0.25

# CPU ranks stand in for GPUs; more than 8 would only oversubscribe a small machine further.
CPU_STAND_INS = 8

# nccl-tests sweeps up to at least 256 MiB on GPUs; gloo on a few CPU cores needs far smaller sizes.
_MIB = 1 << 20
GPU_SWEEP_BYTES = tuple(_MIB << k for k in range(0, 9))  # 1 MiB .. 256 MiB
CPU_SWEEP_BYTES = (64 << 10, 256 << 10, _MIB, 4 * _MIB)


@dataclass(frozen=True)
class DeviceInventory:
    """What can be probed: the device kind, the indices that may be used, and how ranks should see them.

    On ``cuda`` the indices are NVML's (nvidia-smi's), already narrowed to the GPUs a preset
    ``CUDA_VISIBLE_DEVICES`` allows and that can be probed at all (``identity.allowed_gpus``);
    ``visible_ids[i]`` is the UUID that makes ``gpus[i]`` visible to a rank through
    ``CUDA_VISIBLE_DEVICES``, ``identities`` every GPU NVML listed, and ``why_not`` why each GPU outside
    ``gpus`` is. For ``cpu`` the indices are stand-ins and the rest is empty.
    """

    device: str
    gpus: tuple[int, ...]
    visible_ids: tuple[str, ...] = ()
    note: str | None = None
    identities: tuple[GpuIdentity, ...] = ()
    why_not: dict[int, str] = field(default_factory=dict, hash=False)

    def bus_id(self, index: int) -> str | None:
        """The PCI bus id NVML gave GPU ``index`` (``None`` on CPU or when unknown)."""
        return next((g.bus_id for g in self.identities if g.index == index), None)

    def cpu_affinity(self, index: int) -> str | None:
        """The CPUs NVML names near GPU ``index`` (``None`` on CPU or when unknown)."""
        return next((g.cpu_affinity for g in self.identities if g.index == index), None)


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """Everything one probe run needs, fixed before it starts.

    ``sets`` hold GPU indices (nvidia-smi order on CUDA, stand-ins on CPU). ``batch_size`` is per GPU,
    so the global batch of a set is ``batch_size * len(set)`` and splits evenly into the chunks that DP
    replicas and DDP ranks see. ``timeout_s`` bounds each launch (one per set).
    """

    device: str
    sets: tuple[tuple[int, ...], ...]
    checks: tuple[str, ...]
    model: str = DEFAULT_MODEL
    batch_size: int = DEFAULT_BATCH_SIZE
    steps: int = DEFAULT_STEPS
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED
    timeout_s: float = DEFAULT_TIMEOUT_S
    each_pair: bool = False
    inject: Fault | None = None
    inject_rank: int | None = None
    inject_gpus: tuple[int, ...] = ()
    report_dir: Path = Path(DEFAULT_REPORT_DIR)
    topology_input: str | None = None
    inventory: DeviceInventory = field(default_factory=lambda: DeviceInventory("cpu", ()))
    # nccl-tests' -b / -e / -f / -n; None keeps the device's default sweep and iteration count.
    min_bytes: int | None = None
    max_bytes: int | None = None
    step_factor: int = DEFAULT_STEP_FACTOR
    iters: int | None = None
    # --precision: the dp and ddp checks run once per precision (``checks`` holds ``dp@fp16`` and so on);
    # the per-GPU check's matmul runs in the first one.
    precisions: tuple[str, ...] = (DEFAULT_PRECISION,)
    # --tolerance: how far (a fraction) below its peers' median a GPU may measure before it is slow;
    # ``None``: DEFAULT_TOLERANCE on GPUs, CPU_TOLERANCE on CPU stand-ins (``per_gpu_tolerance``).
    tolerance: float | None = None

    @property
    def per_gpu_tolerance(self) -> float:
        """The per-GPU check's tolerance: ``--tolerance``, or the device's default."""
        if self.tolerance is not None:
            return self.tolerance
        return CPU_TOLERANCE if self.device == "cpu" else DEFAULT_TOLERANCE

    @property
    def backend(self) -> str:
        """The torch.distributed backend: NCCL between GPUs, gloo between CPU ranks."""
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def sweep_bytes(self) -> tuple[int, ...]:
        """All-reduce sizes for this device."""
        default = GPU_SWEEP_BYTES if self.device == "cuda" else CPU_SWEEP_BYTES
        if self.min_bytes is None and self.max_bytes is None:
            return default
        # A bound given alone moves the other only as far as needed to keep the sweep non-empty.
        low = self.min_bytes if self.min_bytes is not None else min(default[0], self.max_bytes or default[0])
        high = self.max_bytes if self.max_bytes is not None else max(default[-1], low)
        return sweep_sizes(low, high, self.step_factor)

    def visible_devices(self, gpus: tuple[int, ...]) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for the ranks probing ``gpus`` (``None`` on CPU)."""
        inv = self.inventory
        if inv.device != "cuda" or not inv.visible_ids:
            return None
        by_index = dict(zip(inv.gpus, inv.visible_ids, strict=True))
        return ",".join(by_index[g] for g in gpus)


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"5,6"`` -> ``(5, 6)`` by the one GPU-list rule (``gputopo.gpulist``); ``UsageError`` otherwise."""
    from gputopo.gpulist import parse_gpu_list as parse

    return parse(text, "--gpus")


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgG]?)\s*")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(option: str, text: str) -> int:
    """A size as nccl-tests reads ``-b``/``-e``: bytes, or K, M, G (binary, either case), e.g. ``8``,
    ``1K``, ``256M``; ``UsageError`` otherwise."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise UsageError(
            f"{option} {text!r}: expected a size such as 8, 1K, 256M or 1G",
            "sizes are bytes; K, M, G are 1024-based",
        )
    return int(float(m[1]) * _SIZE_UNITS[m[2].lower()])


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: int) -> tuple[int, ...]:
    """nccl-tests' sweep: from ``min_bytes``, times ``step_factor``, while not above ``max_bytes``;
    each size rounded down to whole float32 elements (nccl-tests aligns to the data type too)."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        aligned = size - size % 4
        if aligned not in sizes:
            sizes.append(aligned)
        if step_factor < 2:
            break
        size *= step_factor
    return tuple(sizes)


def check_sweep(min_bytes: int | None, max_bytes: int | None, step_factor: int, iters: int | None) -> None:
    """``UsageError`` for a sweep nccl-tests would refuse or that measures nothing."""
    if min_bytes is not None and min_bytes < 4:
        raise UsageError(f"--min-bytes {min_bytes}: below one float32 element (4 bytes)", "e.g. -b 8")
    if min_bytes is not None and max_bytes is not None and max_bytes < min_bytes:
        raise UsageError(f"--max-bytes {max_bytes} is below --min-bytes {min_bytes}", "e.g. -b 8 -e 256M")
    if step_factor < 2:
        raise UsageError(f"--step-factor {step_factor}: must be at least 2", "e.g. -f 2")
    if iters is not None and iters < 1:
        raise UsageError(f"--iters {iters}: must be at least 1", "e.g. -n 20")


def check_sets_in_topology(
    sets: tuple[tuple[int, ...], ...], topology_gpus: tuple[int, ...], source: str
) -> None:
    """Every GPU of every set must exist in the ``--input`` topology (exit 2 otherwise, as in recommend)."""
    known = set(topology_gpus)
    unknown = sorted({g for s in sets for g in s if g not in known})
    if unknown:
        raise UsageError(
            f"--gpus: no GPU{','.join(map(str, unknown))} on {source}",
            f"GPUs there: {describe_indices(tuple(sorted(known)))}",
        )


def describe_indices(gpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3)`` -> ``"0-3"``; ``(0, 2)`` -> ``"0,2"``; for messages."""
    if not gpus:
        return "none"
    if list(gpus) == list(range(gpus[0], gpus[0] + len(gpus))) and len(gpus) > 2:
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(str(g) for g in gpus)


def build_config(
    inventory: DeviceInventory,
    gpus: Sequence[tuple[int, ...] | str] | None = None,
    *,
    each_pair: bool = False,
    mode: Mode = Mode.ALL,
    model: str = DEFAULT_MODEL,
    batch_size: int = DEFAULT_BATCH_SIZE,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    seed: int = DEFAULT_SEED,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    inject: Fault | None = None,
    inject_rank: int | None = None,
    report_dir: Path = Path(DEFAULT_REPORT_DIR),
    topology_input: str | None = None,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
    step_factor: int = DEFAULT_STEP_FACTOR,
    iters: int | None = None,
    inject_gpus: str | None = None,
    precisions: tuple[str, ...] | list[str] | None = None,
    tolerance: float | None = None,
    across_nodes: bool = False,
) -> ProbeConfig:
    """Check the options against what exists and freeze them.

    ``gpus``: the sets asked for, each parsed once already (``(5, 6)``) or as ``--gpus`` text (``"5,6"``,
    parsed here). Without ``--gpus`` the set is every GPU (CUDA) or must be given (CPU stand-ins). With
    ``each_pair`` the listed GPUs (or all) are split into every pair by ``plan``. ``across_nodes``: the
    run is one node's part of a multi-node probe, where ``--inject slow`` delays the node named by
    ``--inject-node`` in the inter-node tests, not a GPU in the per-GPU check.
    """
    sets = tuple(s if isinstance(s, tuple) else parse_gpu_list(s) for s in gpus or ())
    if not sets:
        if inventory.device == "cpu":
            raise UsageError("--device cpu needs --gpus: which stand-in ranks to run", "e.g. --gpus 0,1")
        if not inventory.gpus:
            why = "; ".join(f"GPU{g} {w}" for g, w in sorted(inventory.why_not.items()))
            raise UnavailableError(
                "no GPU here can be probed" + (f": {why}" if why else ""),
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
            )
        sets = (inventory.gpus,)
    if inventory.device == "cuda" and inventory.identities:
        # NVML indices: a GPU outside the allowed ones is refused with the reason and the allowed list.
        from gputopo.probe.plan.identity import Allowed

        check_requested(sets, Allowed(inventory.gpus, inventory.why_not, None))
    existing = set(inventory.gpus)
    for s in sets:
        unknown = [g for g in s if g not in existing]
        if unknown:
            kind = "CPU stand-ins" if inventory.device == "cpu" else "GPUs"
            raise UsageError(
                f"--gpus: no GPU {','.join(map(str, unknown))}; the {kind} that exist are "
                f"{describe_indices(inventory.gpus)}",
                "pick indices from that list (nvidia-smi numbering)",
            )
    if each_pair:
        union = tuple(sorted({g for s in sets for g in s})) if gpus else inventory.gpus
        if len(union) < 2:
            raise UsageError(
                "--each-pair needs at least two GPUs", "list more GPUs with --gpus, or drop --each-pair"
            )
        sets = (union,)
    if model not in MODELS:
        raise UsageError(f"--model {model!r}: unknown model", f"choose one of {', '.join(MODELS)}")
    for name, value in (("--steps", steps), ("--batch-size", batch_size)):
        if value < 1:
            raise UsageError(f"{name} {value}: must be at least 1", f"e.g. {name} 5")
    if inject is Fault.NAN and steps < 2:
        raise UsageError(
            "--inject nan needs --steps 2 or more", "the NaN shows in the step after it is planted"
        )
    precisions = tuple(dict.fromkeys(precisions or (DEFAULT_PRECISION,)))
    unknown_precision = [p for p in precisions if p not in PRECISIONS]
    if unknown_precision:
        raise UsageError(
            f"--precision {unknown_precision[0]!r}: unknown precision", f"choose from {', '.join(PRECISIONS)}"
        )
    if inject is Fault.OVERFLOW and steps < 3:
        raise UsageError(
            "--inject overflow needs --steps 3 or more",
            "the scaler must skip two steps from the middle one on to show an overflow",
        )
    if not lr > 0:
        raise UsageError(f"--lr {lr}: must be positive", "e.g. --lr 0.05")
    if not timeout_s > 0:
        raise UsageError(f"--timeout {timeout_s}: must be positive", "e.g. --timeout 120")
    check_sweep(min_bytes, max_bytes, step_factor, iters)
    check_per_gpu(mode, None if across_nodes else inject, tolerance)
    smallest = 2 if each_pair else min(len(s) for s in sets)
    if inject_rank is not None:
        if inject is None:
            raise UsageError("--inject-rank needs --inject", "e.g. --inject nan --inject-rank 1")
        if not 0 <= inject_rank < smallest:
            raise UsageError(
                f"--inject-rank {inject_rank}: the smallest set has ranks 0-{smallest - 1}",
                "ranks count within a set, from 0",
            )
    elif inject is not None and inject_gpus is None:
        # The last rank by default, so the fault is not in rank 0, which gathers and reports.
        inject_rank = smallest - 1
    named = _inject_gpus(inject_gpus, inject, inject_rank, sets, each_pair) if inject_gpus else ()
    return ProbeConfig(
        device=inventory.device,
        sets=sets,
        checks=expand_checks(mode.checks, precisions),
        model=model,
        batch_size=batch_size,
        steps=steps,
        lr=lr,
        seed=seed,
        timeout_s=float(timeout_s),
        each_pair=each_pair,
        inject=inject,
        inject_rank=inject_rank,
        inject_gpus=named,
        report_dir=report_dir,
        topology_input=topology_input,
        inventory=inventory,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        step_factor=step_factor,
        iters=iters,
        precisions=precisions,
        tolerance=None if tolerance is None else float(tolerance),
    )


def check_per_gpu(mode: Mode, inject: Fault | None, tolerance: float | None) -> None:
    """``UsageError`` for a ``--tolerance`` outside (0, 1) or a per-GPU drill without the per-GPU check."""
    from gputopo.probe.plan.options import PER_GPU_FAULTS

    if tolerance is not None and not 0 < tolerance < 1:
        raise UsageError(
            f"--tolerance {tolerance * 100:g}: must be between 0 and 100 (percent)", "e.g. --tolerance 10"
        )
    if inject in PER_GPU_FAULTS and "gpu" not in mode.checks:
        raise UsageError(
            f"--inject {inject.value} goes into the per-GPU check, which --mode {mode.value} does not run "
            "(across nodes, --inject slow delays one node)",
            f"e.g. --mode gpu --inject {inject.value} --inject-gpus 1",
        )


def _inject_gpus(
    text: str,
    inject: Fault | None,
    inject_rank: int | None,
    sets: tuple[tuple[int, ...], ...],
    each_pair: bool,
) -> tuple[int, ...]:
    """Check ``--inject-gpus`` against the sets: the fault goes into every set holding all of them."""
    if inject is None:
        raise UsageError("--inject-gpus needs --inject", "e.g. --inject corrupt --inject-gpus 5,6")
    if inject_rank is not None:
        raise UsageError("--inject-gpus and --inject-rank both say where the fault goes", "give one of them")
    try:
        named = parse_gpu_list(text)
    except UsageError:
        raise UsageError(
            f"--inject-gpus {text!r}: expected comma-separated GPU indices", "e.g. --inject-gpus 5,6"
        ) from None
    holders = [s for s in sets if set(named) <= set(s)]
    if not holders or (each_pair and len(named) > 2):
        raise UsageError(
            f"--inject-gpus {text}: no probed set holds all of these GPUs",
            "name GPUs of one set (with --each-pair, one or two GPUs)",
        )
    return named
