"""The P2P data check inside the ranks: a random pattern copied GPU i -> j -> i must come back exact
(the IOMMU/ACS catcher), timed in both directions; CPU ranks run the same code through a stand-in engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import combinations
from typing import Any

import torch

from gputopo.probe.ranks.context import RankContext

P2P_BYTES = 64 << 20


P2P_WARMUP_COPIES = 5


P2P_TIMED_COPIES = 20  # p2pBandwidthLatencyTest and nvbandwidth time tens of copies; one is ~1 ms on NVLink


P2P_LATENCY_BYTES = 4


P2P_LATENCY_COPIES = 100


# Cycles of the spin kernel queued before the timed copies, so the GPU starts them only once the host has
# queued them all and the events time the copies, not Python (p2pBandwidthLatencyTest's delay kernel).
SPIN_CYCLES = 50_000_000


PATH_P2P = "p2p"


PATH_STAGED = "staged"


# What the latency matrix measures: torch's copy, not a raw peer copy. torch runs a cross-device copy
# after a two-way barrier between the two devices' current streams (aten/src/ATen/native/cuda/Copy.cu,
# copy_device_to_device), so a 4-byte copy_ costs more than p2pBandwidthLatencyTest's cudaMemcpyPeerAsync.
LATENCY_METHOD = "torch Tensor.copy_ latency (includes torch's two-way stream barrier), not a raw peer copy"


def pair_pattern(nbytes: int, seed: int, src: int, dst: int, round_: int = 0) -> torch.Tensor:
    """The random bytes copied from GPU ``src`` to ``dst``: different for every pair, direction and round
    (0: the quiet copies there and back; 1: the concurrent bidirectional round), so a copy that lands in
    the wrong buffer, or not at all, cannot match by accident."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + src * 1_009 + dst + 1 + round_ * 7_919_000_003)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def sentinel_of(pattern: torch.Tensor) -> torch.Tensor:
    """The pattern's complement: every byte differs from the byte the copy should write there."""
    return torch.bitwise_not(pattern)


class CopyEngine:
    """How the p2p check makes, waits for and times copies between devices.

    This base works on any device with host timing and no synchronisation (CPU tensors), which is how the
    tests drive the data check; ``CudaEngine`` is the GPU one. Subclasses may override ``copy`` only.
    """

    timing = "host clock (perf_counter)"

    def device(self, index: int) -> torch.device:
        """The torch device of local device ``index``."""
        return torch.device("cpu")

    def can_access_peer(self, src: int, dst: int) -> bool:
        """Whether ``src`` can write ``dst``'s memory directly (CUDA's cudaDeviceCanAccessPeer)."""
        return True

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy, queued (on GPUs it may still be running when this returns)."""
        dst.copy_(src)

    def sync(self, *indices: int) -> None:
        """Wait until everything queued on these devices is done."""

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        """Seconds for ``copies`` rounds, each making every (dst, src) copy once, after ``warmup`` rounds."""
        for _ in range(warmup):
            for dst, src in directions:
                self.copy(dst, src)
        started = time.perf_counter()
        for _ in range(copies):
            for dst, src in directions:
                self.copy(dst, src)
        return time.perf_counter() - started


class CudaEngine(CopyEngine):
    """Copies with ``Tensor.copy_`` and times them with CUDA events, as p2pBandwidthLatencyTest does.

    torch runs a cross-device copy on the source device's current stream, after a two-way barrier with the
    destination device's current stream (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device). Each
    direction therefore gets a stream of its own on both devices, or the two directions of a
    bidirectional measurement would wait for each other through those barriers.
    """

    timing = "CUDA events"

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def can_access_peer(self, src: int, dst: int) -> bool:
        # cudaDeviceCanAccessPeer. Without peer access a device-to-device copy still succeeds: the CUDA
        # Programming Guide ("Peer-to-Peer Memory Copy") says only with peer access enabled does the copy
        # no longer go through the host, so a passing copy alone proves no peer-to-peer path.
        return bool(torch.cuda.can_device_access_peer(src, dst))

    def sync(self, *indices: int) -> None:
        for index in indices:
            torch.cuda.synchronize(index)

    def _round(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], streams: list[tuple[Any, Any]]
    ) -> None:
        for (dst, src), (on_src, on_dst) in zip(directions, streams, strict=True):
            before = torch.cuda.current_device()
            previous = [torch.cuda.current_stream(src.device), torch.cuda.current_stream(dst.device)]
            torch.cuda.set_stream(on_dst)
            torch.cuda.set_stream(on_src)
            try:
                self.copy(dst, src)
            finally:
                for stream in previous:
                    torch.cuda.set_stream(stream)
                torch.cuda.set_device(before)

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        streams = [(torch.cuda.Stream(src.device), torch.cuda.Stream(dst.device)) for dst, src in directions]
        devices = sorted({t.device.index for pair in directions for t in pair})
        for _ in range(warmup):
            self._round(directions, streams)
        self.sync(*devices)
        timer = streams[0][0]
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(timer):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(SPIN_CYCLES)
            start.record(timer)
        for on_src, on_dst in streams:
            on_src.wait_event(start)
            on_dst.wait_event(start)
        for _ in range(copies):
            self._round(directions, streams)
        for on_src, _ in streams[1:]:
            done = torch.cuda.Event()
            done.record(on_src)
            timer.wait_event(done)
        stop.record(timer)
        stop.synchronize()
        self.sync(*devices)
        return start.elapsed_time(stop) / 1e3  # milliseconds


def checked_copy(
    engine: CopyEngine, dst: torch.Tensor, src: torch.Tensor, expected: torch.Tensor, devices: tuple[int, ...]
) -> int:
    """Copy ``src`` into ``dst`` and count the bytes of ``dst`` that differ from ``expected`` (host).

    ``dst`` first gets ``expected``'s complement from the host and the devices are synchronised, so a
    write that never lands (an IOMMU fault drops it) leaves a byte that cannot compare equal, whatever
    the allocator left in that memory before. The comparison reads ``dst`` back with a plain
    device-to-host copy, not through the path under test.
    """
    dst.copy_(sentinel_of(expected))
    engine.sync(*devices)
    engine.copy(dst, src)
    engine.sync(*devices)
    return int((dst.cpu() != expected).sum())


def checked_rounds(
    engine: CopyEngine,
    directions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    warmup: int,
    copies: int,
    devices: tuple[int, ...],
) -> tuple[float, list[int]]:
    """Time concurrent rounds of copies, then count the wrong bytes each destination ended with.

    ``directions`` are (dst, src, pattern): each ``src`` first gets its ``pattern`` and each ``dst`` the
    pattern's complement (from the host, devices synchronised), so the bytes the timed copies leave
    behind, with every direction in flight together, are checked as the quiet copies are: a write that
    never landed, or landed in the other direction's buffer, cannot compare equal. Returns the timed
    seconds and the wrong bytes per direction.
    """
    for dst, src, pattern in directions:
        src.copy_(pattern)
        dst.copy_(sentinel_of(pattern))
    engine.sync(*devices)
    seconds = engine.time_copies([(dst, src) for dst, src, _ in directions], warmup, copies)
    engine.sync(*devices)
    return seconds, [int((dst.cpu() != pattern).sum()) for dst, _, pattern in directions]


class _Corrupting(CopyEngine):
    """``--inject corrupt``: a copy into a chosen destination lands with one byte changed."""

    def __init__(self, inner: CopyEngine, hit: Callable[[torch.Tensor], bool]) -> None:
        self.inner = inner
        self.hit = hit
        self.timing = inner.timing

    def device(self, index: int) -> torch.device:
        return self.inner.device(index)

    def can_access_peer(self, src: int, dst: int) -> bool:
        return self.inner.can_access_peer(src, dst)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.inner.copy(dst, src)
        if self.hit(dst):
            dst.view(-1)[0] ^= 0x5A

    def sync(self, *indices: int) -> None:
        self.inner.sync(*indices)

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        seconds = self.inner.time_copies(directions, warmup, copies)
        for dst, _ in directions:  # the timed copies into the target land changed too
            if self.hit(dst):
                dst.view(-1)[0] ^= 0x5A
        return seconds


def p2p_matrix(
    engine: CopyEngine,
    devices: Sequence[int],
    labels: Sequence[int],
    *,
    nbytes: int = P2P_BYTES,
    seed: int = 0,
    warmup: int = P2P_WARMUP_COPIES,
    copies: int = P2P_TIMED_COPIES,
    latency_copies: int = P2P_LATENCY_COPIES,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Every ordered pair of ``devices`` from this one process: data-checked copies there and back,
    bandwidth one way and both ways (the bidirectional round data-checked too), and small-copy latency
    (torch ``copy_`` latency, see ``LATENCY_METHOD``).

    ``labels[k]`` is the GPU index reported for ``devices[k]``. A pair without peer access is still
    copied and checked (torch then stages the copy through host memory) but marked ``staged``: its
    numbers say nothing about a peer-to-peer path.
    """
    pairs: dict[tuple[int, int], dict[str, Any]] = {}
    unordered = list(combinations(range(len(devices)), 2))
    for n, (a, b) in enumerate(unordered):
        buffers = {}
        for i, j in ((a, b), (b, a)):
            src_dev, dst_dev = devices[i], devices[j]
            pattern = pair_pattern(nbytes, seed, labels[i], labels[j])
            src = pattern.to(engine.device(src_dev))
            there = torch.empty(nbytes, dtype=torch.uint8, device=engine.device(dst_dev))
            back = torch.empty(nbytes, dtype=torch.uint8, device=engine.device(src_dev))
            both = (src_dev, dst_dev)
            wrong_there = checked_copy(engine, there, src, pattern, both)
            wrong_back = checked_copy(engine, back, there, pattern, both)
            seconds = engine.time_copies([(there, src)], warmup, copies)
            small_seconds = engine.time_copies(
                [(there[:P2P_LATENCY_BYTES], src[:P2P_LATENCY_BYTES])], warmup, latency_copies
            )
            can = engine.can_access_peer(src_dev, dst_dev)
            pairs[(i, j)] = {
                "src": labels[i],
                "dst": labels[j],
                "can_access_peer": can,
                "path": PATH_P2P if can else PATH_STAGED,
                "wrong_bytes_there": wrong_there,
                "wrong_bytes_roundtrip": wrong_back,
                "unidir_gbps": nbytes * copies / seconds / 1e9 if seconds > 0 else None,
                "latency_us": small_seconds / latency_copies * 1e6,
            }
            buffers[(i, j)] = (there, src)
        # The last round, both directions at once: new patterns, sentinel-filled destinations, checked.
        rounds = [
            (*buffers[(i, j)], pair_pattern(nbytes, seed, labels[i], labels[j], round_=1))
            for i, j in ((a, b), (b, a))
        ]
        seconds, wrong = checked_rounds(engine, rounds, warmup, copies, (devices[a], devices[b]))
        both_ways = 2 * nbytes * copies / seconds / 1e9 if seconds > 0 else None
        pairs[(a, b)]["bidir_gbps"] = pairs[(b, a)]["bidir_gbps"] = both_ways
        pairs[(a, b)]["wrong_bytes_bidir"], pairs[(b, a)]["wrong_bytes_bidir"] = wrong
        del buffers
        if progress is not None:
            progress(n + 1, len(unordered))
    order = [pairs[(i, j)] for i in range(len(devices)) for j in range(len(devices)) if i != j]
    return {
        "gpus": list(labels),
        "bytes": nbytes,
        "warmup_copies": warmup,
        "timed_copies": copies,
        "latency_bytes": P2P_LATENCY_BYTES,
        "latency_copies": latency_copies,
        "timing": engine.timing,
        "latency_method": LATENCY_METHOD,
        "check": (
            "sentinel-filled destination, every byte compared on the host, there and back, and after "
            "the last concurrent bidirectional round"
        ),
        "pairs": order,
    }


def p2p_check(
    ctx: RankContext,
    devices: Sequence[int] | None = None,
    engine: CopyEngine | None = None,
    nbytes: int = P2P_BYTES,
) -> dict[str, Any]:
    """The p2p matrix over the set's devices, driven from this one process (rank 0, which sees them all).

    ``devices`` are local device indices (default: one per rank); the reported labels are the set's GPU
    indices. ``--inject corrupt`` changes a byte of every copy into the injected rank's device.
    """
    devices = list(devices) if devices is not None else list(range(ctx.world))
    labels = [int(g) for g in ctx.spec["gpus"]][: len(devices)]
    engine = engine or CudaEngine()
    if ctx.fault("corrupt", "p2p"):
        target = engine.device(devices[min(ctx.inject_rank, len(devices) - 1)])
        engine = _Corrupting(engine, lambda t: t.device == target and t.numel() > P2P_LATENCY_BYTES)
    return p2p_matrix(
        engine,
        devices,
        labels,
        nbytes=nbytes,
        seed=int(ctx.spec.get("seed", 0)),
        progress=lambda done, total: ctx.progress("p2p", "pair", done, total),
    )
