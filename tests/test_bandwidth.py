"""The bandwidth model: link codes to GB/s as NCCL counts them, stated assumptions, and the best ring."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.errors import UsageError
from gputopo.model import Gpu, Matrix, NvlinkPeer, PcieLink, Topology
from gputopo.topology import samples
from gputopo.topology.bandwidth import (
    CPU_PATH_FACTOR,
    DEFAULT_NVLINK_GBPS,
    Assumptions,
    best_ring,
    build_model,
    gpu_family,
    pcie_gbps,
    ring_busbw_gbps,
)


def machine(
    rows: str,
    name: str | None = None,
    gen: int | None = None,
    numa: list[str] | None = None,
    **extra,
) -> Topology:
    """A Topology from a matrix of ``topo -m`` codes (``?`` = a cell the input did not show)."""
    cells = [[None if c == "?" else c for c in line.split()] for line in rows.strip().splitlines()]
    gpus = tuple(
        Gpu(
            index=i,
            name=name,
            numa_affinity=numa[i] if numa else None,
            pcie=PcieLink(gen_max=gen, width_max=16) if gen else None,
        )
        for i in range(len(cells))
    )
    labels = tuple(g.label for g in gpus)
    return Topology("test", gpus, (), Matrix(labels, tuple(tuple(r) for r in cells)), **extra)


def pair(code: str, name: str | None = None, gen: int | None = None, **extra) -> Topology:
    return machine(f"X {code}\n{code} X", name=name, gen=gen, **extra)


# --- figures ---------------------------------------------------------------------------------------------


def test_pcie_figures_are_nccls():
    """x16 is 12 / 24 / 48 GB/s for Gen3 / 4 / 5 (NCCL: width * speed / 80); x8 is half."""
    assert [pcie_gbps(g) for g in (3, 4, 5)] == [12.0, 24.0, 48.0]
    assert pcie_gbps(3, 8) == 6.0
    with pytest.raises(ValueError):
        pcie_gbps(9)


@pytest.mark.parametrize(
    ("name", "architecture", "per_link_gbps"),
    [
        ("NVIDIA H100 80GB HBM3", "Hopper", 20.6),
        ("NVIDIA H100 NVL", "Hopper", 20.6),
        ("NVIDIA H200", "Hopper", 20.6),
        ("NVIDIA H20", "Hopper", 20.6),
        ("NVIDIA H800", "Hopper", 20.6),
        ("NVIDIA GH200 480GB", "Hopper", 20.6),
        ("NVIDIA A100-SXM4-80GB", "Ampere", 20.0),
        ("NVIDIA A800-SXM4-80GB", "Ampere", 20.0),
        ("NVIDIA A30", "Ampere", 20.0),
        ("NVIDIA RTX A6000", "Ampere", 12.0),
        ("NVIDIA GeForce RTX 3090", "Ampere", 12.0),
        ("NVIDIA A40", "Ampere", 12.0),
        ("Tesla V100-SXM2-32GB", "Volta", 20.0),
        ("Tesla P100-SXM2-16GB", "Pascal", 18.0),
        ("NVIDIA B200", "Blackwell", 40.1),
        ("NVIDIA GB200", "Blackwell", 40.1),
        ("NVIDIA RTX 6000 Ada Generation", "Ada Lovelace", 20.0),
        ("Quadro RTX 8000", "Turing", 20.0),
    ],
)
def test_gpu_family_from_name(name, architecture, per_link_gbps):
    family = gpu_family(name)
    assert family is not None and family.architecture == architecture
    assert family.nvlink_gbps_per_link == per_link_gbps


@pytest.mark.parametrize("name", [None, "", "Some Future GPU 9000", "NVIDIA A1000X"])
def test_unknown_gpu_names_have_no_family(name):
    assert gpu_family(name) is None


def test_nvlink_pairs_by_generation():
    """NV# = n links x the generation's per-link figure."""
    assert build_model(pair("NV4", "NVIDIA RTX A6000")).gbps(0, 1) == 48.0
    assert build_model(pair("NV18", "NVIDIA H100 80GB HBM3")).gbps(0, 1) == pytest.approx(370.8)
    assert build_model(pair("NV12", "NVIDIA A100-SXM4-80GB")).gbps(0, 1) == 240.0


def test_unknown_generation_is_assumed_and_said():
    """Text input has no GPU names: NCCL's default per-link figure, and a note that says so."""
    model = build_model(pair("NV4"))
    assert model.gbps(0, 1) == 4 * DEFAULT_NVLINK_GBPS
    assert [str(n) for n in model.notes()] == [
        "assumed: NVLink 20 GB/s per link (GPU model unknown: NCCL's default)"
    ]


def test_given_nvlink_figure_wins_and_is_called_given():
    model = build_model(pair("NV4", "NVIDIA H100 80GB HBM3"), Assumptions(nvlink_gbps_per_link=25))
    assert model.gbps(0, 1) == 100.0
    assert [n.kind for n in model.notes()] == ["given"]


def test_known_figures_need_no_notes():
    """A live H100 NVSwitch box: every figure is read, nothing is assumed."""
    topo = samples.load("hgx-h100-nvswitch")
    model = build_model(topo)
    assert model.notes() == ()


@pytest.mark.parametrize("gen", [3, 4, 5])
def test_pcie_paths_get_slower_with_distance(gen):
    """PIX > PXB > PHB = NODE > SYS for the same GPUs: the order an expert ranks them in."""
    figures = {
        code: build_model(pair(code, gen=gen)).gbps(0, 1) for code in ("PIX", "PXB", "PHB", "NODE", "SYS")
    }
    link = pcie_gbps(gen)
    assert figures["PIX"] == link
    assert figures["PXB"] == pytest.approx(0.9 * link)
    assert figures["PHB"] == figures["NODE"] == pytest.approx(link * CPU_PATH_FACTOR)
    assert figures["SYS"] == pytest.approx(min(link, 10.0) * CPU_PATH_FACTOR)
    assert figures["PIX"] > figures["PXB"] > figures["NODE"] > figures["SYS"]


def test_unknown_pcie_gen_is_assumed_gen3_and_said():
    model = build_model(pair("PIX"))
    assert model.gbps(0, 1) == 12.0
    assert [str(n) for n in model.notes()] == [
        "assumed: PCIe Gen3 x16 = 12 GB/s (PCIe generation unknown: NCCL's PCI_BW)"
    ]


def test_given_pcie_gen_and_socket_link():
    model = build_model(pair("SYS", gen=3), Assumptions(pcie_gen=5, socket_gbps=32))
    assert model.gbps(0, 1) == pytest.approx(32 * CPU_PATH_FACTOR)
    assert {n.kind for n in model.notes()} == {"given"}


def test_sys_mentions_the_assumed_socket_link():
    notes = [str(n) for n in build_model(pair("SYS", gen=4)).notes()]
    assert notes == [
        "assumed: CPU socket link 10 GB/s (CPU unknown: NCCL's Skylake UPI figure; set --socket-gbps)"
    ]


@pytest.mark.parametrize(
    "bad",
    [dict(nvlink_gbps_per_link=0), dict(pcie_gen=7), dict(socket_gbps=-1)],
)
def test_nonsense_assumptions_are_usage_errors(bad):
    with pytest.raises(UsageError):
        Assumptions(**bad)


def test_live_nvlinks_down_lower_the_pair():
    topo = pair("NV4", "NVIDIA A100-SXM4-80GB", nvlinks=(NvlinkPeer(0, 1, links_up=2, links_down=2),))
    edge = build_model(topo).edge(0, 1)
    assert edge.gbps == 40.0
    assert "2 of 4 down" in edge.why


def test_pcie_pair_without_p2p_is_staged_through_host_memory():
    topo = pair("PIX", gen=4, p2p={"read": (("X", "CNS"), ("CNS", "X"))})
    edge = build_model(topo).edge(0, 1)
    assert edge.gbps == pytest.approx(24 * CPU_PATH_FACTOR)
    assert "CNS" in edge.why


def test_a_cell_the_input_lost_is_unknown_not_guessed():
    topo = machine("X NV4 ?\nNV4 X ?\n? ? X")
    model = build_model(topo)
    assert model.gbps(0, 2) is None and model.gbps(0, 1) == 80.0


def test_one_triangle_is_enough():
    """A cropped paste may keep only the upper triangle: the link is symmetric."""
    topo = machine("X NV4\n? X")
    assert build_model(topo).gbps(0, 1) == 80.0


# --- the best ring ---------------------------------------------------------------------------------------


def brute_ring(members: list[int], w) -> float | None:
    """Max over all ring orders of the slowest edge (edges of weight 0 are unusable)."""
    best = None
    first, rest = members[0], members[1:]
    for perm in itertools.permutations(rest):
        order = (first, *perm)
        value = min(w(order[i], order[(i + 1) % len(order)]) for i in range(len(order)))
        if value > 0 and (best is None or value > best):
            best = value
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=3, max_value=7).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(
                st.sampled_from([0, 8, 10, 20, 40, 48, 240]),
                min_size=n * (n - 1) // 2,
                max_size=n * (n - 1) // 2,
            ),
        )
    )
)
def test_best_ring_is_the_true_bottleneck_optimum(case):
    """Against every ring order, on random weighted graphs (0 = no usable link)."""
    n, values = case
    weight = {}
    for (a, b), v in zip(itertools.combinations(range(n), 2), values, strict=True):
        weight[(a, b)] = weight[(b, a)] = v
    ring = best_ring(list(range(n)), lambda a, b: weight[(a, b)])
    expected = brute_ring(list(range(n)), lambda a, b: weight[(a, b)])
    if expected is None:
        assert ring is None
        return
    assert ring is not None and ring.busbw_gbps == expected
    assert sorted(ring.order) == list(range(n))
    edges = [(ring.order[i], ring.order[(i + 1) % n]) for i in range(n)]
    assert min(weight[e] for e in edges) == expected == weight[ring.bottleneck]


def test_best_ring_small_cases():
    assert best_ring([3], lambda a, b: 1.0) is None
    two = best_ring([2, 5], lambda a, b: 48.0)
    assert two is not None and two.busbw_gbps == 48.0 and two.bottleneck == (2, 5)
    assert best_ring([0, 1], lambda a, b: 0) is None
    # A path 0-1-2-3 has no ring at all, whatever the weights.
    path = {frozenset(p) for p in ((0, 1), (1, 2), (2, 3))}
    assert best_ring([0, 1, 2, 3], lambda a, b: 10.0 if frozenset((a, b)) in path else 0) is None


def test_sixteen_gpu_all_to_all_ring_is_immediate():
    """16 interchangeable GPUs collapse to one class: no 2^16 search."""
    ring = best_ring(list(range(16)), lambda a, b: 120.0)
    assert ring is not None and ring.busbw_gbps == 120.0 and sorted(ring.order) == list(range(16))


# --- the probe's entry point -----------------------------------------------------------------------------


def test_ring_busbw_for_the_probe():
    topo = samples.load("seed-8gpu-nv4")  # RTX A6000, Gen4
    assert ring_busbw_gbps(topo, [6, 7]) == 48.0
    assert ring_busbw_gbps(topo, [0, 1, 2, 3]) == pytest.approx(24 * CPU_PATH_FACTOR)
    assert ring_busbw_gbps(topo, [0, 1, 2, 3, 4, 5, 6, 7]) == pytest.approx(10 * CPU_PATH_FACTOR)
    assert ring_busbw_gbps(topo, [5]) is None
    assert ring_busbw_gbps(topo, [6, 7], Assumptions(nvlink_gbps_per_link=25)) == 100.0


def test_ring_busbw_is_none_when_a_link_is_unknown():
    topo = machine("X NV4 ?\nNV4 X NV4\n? NV4 X")
    assert ring_busbw_gbps(topo, [0, 1]) == 80.0
    assert ring_busbw_gbps(topo, [0, 1, 2]) is None


@pytest.mark.parametrize("gpus", [[0, 9], [1, 1]])
def test_ring_busbw_rejects_bad_sets(gpus):
    with pytest.raises(UsageError):
        ring_busbw_gbps(samples.load("seed-8gpu-nv4"), gpus)


def test_ring_of_an_nvswitch_box_matches_the_design_figures():
    """docs/design.md: 8x A100 ~230 GB/s and 8x H100 ~370 GB/s measured; the model is their ceiling."""
    h100 = ring_busbw_gbps(samples.load("hgx-h100-nvswitch"), range(8))
    assert h100 is not None and math.isclose(h100, 18 * 20.6)
