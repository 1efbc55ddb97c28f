"""The machine seam: live topology from (fake) NVML, the nvidia-smi fallback, processes, minor numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pynvml
import pytest

from fake_nvml import NVSWITCH, FakeLink, FakeNvml
from gputopo.errors import EXIT_UNAVAILABLE, ParseError, UnavailableError
from gputopo.model import P2P_CAPABILITIES, Gpu, Matrix, NvlinkPeer, PcieLink, Topology
from gputopo.system import inventory, nvml, smi
from gputopo.system.inventory import (
    GpuProcess,
    format_id_ranges,
    gpu_processes,
    minor_numbers,
    nvml_sees_pid_namespace,
    read_live,
)

SEED_MATRIX = [
    ["X", "NV4", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"],
    ["NV4", "X", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"],
    ["NODE", "NODE", "X", "NV4", "SYS", "SYS", "SYS", "SYS"],
    ["NODE", "NODE", "NV4", "X", "SYS", "SYS", "SYS", "SYS"],
    ["SYS", "SYS", "SYS", "SYS", "X", "NV4", "NODE", "NODE"],
    ["SYS", "SYS", "SYS", "SYS", "NV4", "X", "NODE", "NODE"],
    ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "NV4"],
    ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "NV4", "X"],
]

PCIE_MATRIX = [
    ["X", "PIX", "PXB", "PHB", "NODE", "SYS", "SYS", "SYS"],
    ["PIX", "X", "PXB", "PHB", "NODE", "SYS", "SYS", "SYS"],
    ["PXB", "PXB", "X", "PHB", "NODE", "SYS", "SYS", "SYS"],
    ["PHB", "PHB", "PHB", "X", "NODE", "SYS", "SYS", "SYS"],
    ["NODE", "NODE", "NODE", "NODE", "X", "SYS", "SYS", "SYS"],
    ["SYS", "SYS", "SYS", "SYS", "SYS", "X", "PIX", "NODE"],
    ["SYS", "SYS", "SYS", "SYS", "SYS", "PIX", "X", "NODE"],
    ["SYS", "SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X"],
]

# A small `nvidia-smi topo -m` as a 2-GPU workstation prints it (written for this test).
SMI_TEXT = textwrap.dedent(
    """\
    \tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
    GPU0\t X \tPHB\t0-15\t0\t\tN/A
    GPU1\tPHB\t X \t0-15\t0\t\tN/A

    Legend:

      X    = Self
      SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
      PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
      PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
      PIX  = Connection traversing at most a single PCIe bridge
      NV#  = Connection traversing a bonded set of # NVLinks
    """
)


def cells(topo) -> list[list[str | None]]:
    return [list(row) for row in topo.matrix.cells]


@pytest.fixture
def no_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with no nvidia-smi on it (an empty folder)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty


def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """Put an executable ``nvidia-smi`` shell script with ``body`` first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return script


def smi_printing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    out = tmp_path / "topo.txt"
    out.write_text(text)
    return fake_smi(tmp_path, monkeypatch, f'[ "$1 $2" = "topo -m" ] || exit 64\ncat "{out}"\n')


# --- live topology from NVML -------------------------------------------------------------------------


def test_seed_box_with_nv4_pairs_reads_like_nvidia_smi() -> None:
    fake = FakeNvml.nvlink_box()
    with fake.installed():
        topo = read_live()
    assert topo.source == "nvml" and topo.live
    assert topo.matrix.labels == tuple(f"GPU{i}" for i in range(8))
    assert cells(topo) == SEED_MATRIX
    assert topo.nics == () and topo.warnings == ()
    assert topo.driver_version == "550.54.15" and topo.cuda_driver_version == "12.4"
    assert fake.init_count == 1 and fake.open_sessions == 0


def test_seed_box_nvlink_peers_count_links_per_pair() -> None:
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    assert topo.nvlinks == tuple(NvlinkPeer(a, a ^ 1, 4, 0) for a in range(8))


def test_seed_box_gpu_fields() -> None:
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    g0, g5 = topo.gpu(0), topo.gpu(5)
    assert g0.name == "NVIDIA RTX A6000"
    assert g0.pci_bus_id == "00000000:1A:00.0"
    assert g0.uuid == "GPU-a6000000-0000-0000-0000-000000000000"
    assert (g0.cpu_affinity, g0.numa_affinity) == ("0-31", "0")
    assert (g5.cpu_affinity, g5.numa_affinity) == ("32-63", "1")
    assert g5.minor_number == 5
    assert g0.memory_total_mib == 49140 and g0.memory_used_mib == 0
    assert g0.pcie == PcieLink(4, 4, 16, 16)
    assert g0.gpu_numa_id is None  # not a Grace Hopper: NVML says NotSupported
    assert g0.compute_pids == () and g0.utilization_pct == 0 and g0.error is None


def test_seed_box_p2p_matrices() -> None:
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    assert set(topo.p2p) == set(P2P_CAPABILITIES)
    for cap in P2P_CAPABILITIES:
        assert [topo.p2p[cap][i][i] for i in range(8)] == ["X"] * 8
    assert topo.p2p["read"][0][1] == "OK" and topo.p2p["nvlink"][0][1] == "OK"
    assert topo.p2p["read"][0][2] == "OK" and topo.p2p["nvlink"][0][2] == "NS"
    assert topo.p2p["write"][3][4] == "CNS" and topo.p2p["atomics"][3][4] == "NS"


def test_p2p_status_codes_map_to_nvidia_smi_letters() -> None:
    overrides = {
        (0, 2, "read"): pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED,
        (0, 2, "write"): pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED,
        (0, 3, "read"): pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY,
        (0, 3, "write"): pynvml.NVML_P2P_STATUS_UNKNOWN,
        (0, 4, "read"): 99,  # a status newer than gputopo: unknown, not guessed
    }
    with FakeNvml.nvlink_box(p2p_overrides=overrides).installed():
        topo = read_live()
    p2p = topo.p2p
    assert (p2p["read"][0][2], p2p["write"][0][2]) == ("GNS", "TNS")
    assert (p2p["read"][0][3], p2p["write"][0][3]) == ("DR", "U")
    assert p2p["read"][0][4] is None
    assert p2p["read"][2][0] == "OK"  # each direction is its own query


def test_nvswitch_box_is_nv18_all_to_all() -> None:
    with FakeNvml.nvswitch_box().installed():
        topo = read_live()
    assert cells(topo) == [["X" if a == b else "NV18" for b in range(4)] for a in range(4)]
    assert topo.nvlinks == tuple(NvlinkPeer(a, b, 18, 0, 18, 0) for a in range(4) for b in range(4) if a != b)
    g2 = topo.gpu(2)
    assert (g2.cpu_affinity, g2.numa_affinity) == ("48-95,144-191", "1")
    assert g2.pcie == PcieLink(5, 5, 16, 16) and g2.memory_total_mib == 81559
    assert all(topo.p2p["nvlink"][a][b] == "OK" for a in range(4) for b in range(4) if a != b)
    assert topo.warnings == ()


def test_nvswitch_link_down_lowers_that_gpus_pairs_and_warns() -> None:
    fake = FakeNvml.nvswitch_box()
    fake.gpus[1].links = (FakeLink(NVSWITCH, up=False),) + tuple(FakeLink(NVSWITCH) for _ in range(17))
    with fake.installed():
        topo = read_live()
    assert topo.matrix.code("GPU0", "GPU1") == "NV17"
    assert topo.matrix.code("GPU1", "GPU3") == "NV17"
    assert topo.matrix.code("GPU0", "GPU3") == "NV18"
    assert NvlinkPeer(1, 0, 17, 1, 17, 1) in topo.nvlinks and NvlinkPeer(0, 1, 18, 0, 18, 0) in topo.nvlinks
    assert topo.warnings == ("GPU1: 1 of 18 NVLinks are down",)


def test_switch_links_without_remote_type_are_not_guessed() -> None:
    # A driver without nvmlDeviceGetNvLinkRemoteDeviceType: the far end is a bus id that is no GPU's.
    with FakeNvml.nvswitch_box(remote_type_supported=False).installed():
        topo = read_live()
    assert topo.matrix.code("GPU0", "GPU1") == "NODE"
    assert topo.matrix.code("GPU0", "GPU2") == "SYS"
    assert topo.nvlinks == ()
    assert "GPU0: 18 NVLinks lead to a device NVML does not name; not counted" in topo.warnings


def test_direct_links_without_remote_type_still_match_gpus_by_bus_id() -> None:
    with FakeNvml.nvlink_box(remote_type_supported=False).installed():
        topo = read_live()
    assert cells(topo) == SEED_MATRIX


def test_pcie_box_path_codes() -> None:
    with FakeNvml.pcie_box().installed():
        topo = read_live()
    assert cells(topo) == PCIE_MATRIX
    assert topo.nvlinks == ()  # known: no NVLink at all (not unknown)
    assert topo.warnings == ()


def test_pcie_box_link_width_below_max_while_busy() -> None:
    with FakeNvml.pcie_box().installed():
        topo = read_live()
    busy, idle = topo.gpu(2), topo.gpu(0)
    assert busy.pcie == PcieLink(gen_current=4, gen_max=4, width_current=8, width_max=16)
    assert busy.pcie.degraded and busy.utilization_pct == 97 and busy.memory_used_mib == 30211
    assert idle.pcie == PcieLink(gen_current=1, gen_max=4, width_current=16, width_max=16)
    assert idle.utilization_pct == 0


def test_pcie_box_affinity_and_p2p() -> None:
    with FakeNvml.pcie_box().installed():
        topo = read_live()
    assert topo.gpu(0).cpu_affinity == "0-15,32-47" and topo.gpu(0).numa_affinity == "0"
    assert topo.gpu(7).cpu_affinity == "16-31,48-63" and topo.gpu(7).numa_affinity == "1"
    assert topo.p2p["read"][0][1] == "OK"
    assert topo.p2p["read"][0][5] == "CNS"
    assert topo.p2p["nvlink"][0][1] == "NS"


def test_unsupported_fields_are_none_and_the_rest_is_read() -> None:
    fake = FakeNvml.pcie_box()
    fake.gpus[3].unsupported |= {
        "nvmlDeviceGetCurrPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth",
        "nvmlDeviceGetMemoryAffinity",
        "nvmlDeviceGetCpuAffinity",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetTopologyCommonAncestor",
        "nvmlDeviceGetP2PStatus",
    }
    with fake.installed():
        topo = read_live()
    g3 = topo.gpu(3)
    assert g3.error is None and g3.name == "NVIDIA L40S" and g3.pci_bus_id == "00000000:4B:00.0"
    assert g3.pcie == PcieLink(gen_current=None, gen_max=4, width_current=None, width_max=16)
    assert g3.cpu_affinity is None and g3.numa_affinity is None
    assert g3.utilization_pct is None and g3.minor_number is None
    assert g3.memory_total_mib is None and g3.memory_used_mib is None and g3.compute_pids is None
    assert [topo.matrix.code("GPU3", f"GPU{b}") for b in range(8)] == [None, None, None, "X"] + [None] * 4
    assert topo.p2p["read"][3][0] is None and topo.p2p["read"][0][3] is None
    others = [r[:3] + r[4:] for i, r in enumerate(PCIE_MATRIX) if i != 3]
    assert [r[:3] + r[4:] for i, r in enumerate(cells(topo)) if i != 3] == others
    assert topo.warnings == ()  # not supported is normal, not a problem


def test_no_pcie_field_at_all_gives_pcie_none() -> None:
    fake = FakeNvml.pcie_box()
    fake.gpus[0].unsupported |= {
        f"nvmlDevice{w}PcieLink{x}" for w in ("GetCurr", "GetMax") for x in ("Generation", "Width")
    }
    with fake.installed():
        topo = read_live()
    assert topo.gpu(0).pcie is None and topo.gpu(1).pcie is not None


def test_grace_hopper_style_gpu_numa_id_is_read() -> None:
    fake = FakeNvml.nvswitch_box()
    for i, gpu in enumerate(fake.gpus):
        gpu.gpu_numa_id = 4 + 8 * i
    with fake.installed():
        topo = read_live()
    assert [g.gpu_numa_id for g in topo.gpus] == ["4", "12", "20", "28"]


def test_lost_gpu_is_marked_and_the_others_are_intact() -> None:
    fake = FakeNvml.lost_gpu_box()
    with fake.installed():
        topo = read_live()
    lost = topo.gpu(5)
    assert lost.error == "GPU is lost"
    assert (lost.name, lost.pci_bus_id, lost.pcie, lost.cpu_affinity) == (None, None, None, None)
    got = cells(topo)
    for a in range(8):
        for b in range(8):
            if a == b:
                assert got[a][b] == "X"
            elif 5 in (a, b) or {a, b} == {4, 5}:
                assert got[a][b] is None
            elif {a, b} != {4, 5}:
                assert got[a][b] == SEED_MATRIX[a][b], (a, b)
    assert topo.p2p["read"][4][5] is None and topo.p2p["read"][5][4] is None
    assert topo.p2p["read"][6][7] == "OK"
    assert topo.gpu(4).error is None and topo.gpu(4).name == "NVIDIA RTX A6000"
    assert not any(5 in (p.gpu, p.peer) for p in topo.nvlinks)
    assert topo.warnings == (
        "GPU5 did not answer NVML (GPU is lost); its details and links are unknown",
        "GPU4: 4 of 4 NVLinks are down",
    )
    assert fake.open_sessions == 0


def test_gpu_that_fails_at_its_handle_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml.pcie_box()
    real = fake.nvmlDeviceGetHandleByIndex

    def handle(index: int):
        if index == 6:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_RESET_REQUIRED)
        return real(index)

    monkeypatch.setattr(fake, "nvmlDeviceGetHandleByIndex", handle)
    with fake.installed():
        topo = read_live()
    assert topo.gpu(6).error == "GPU requires restart"
    assert topo.matrix.code("GPU5", "GPU6") is None and topo.matrix.code("GPU5", "GPU7") == "NODE"


def test_pair_query_failure_is_a_warning_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml.pcie_box()
    real = fake.nvmlDeviceGetTopologyCommonAncestor

    def ancestor(h1, h2):
        if {h1.index, h2.index} == {0, 1}:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return real(h1, h2)

    monkeypatch.setattr(fake, "nvmlDeviceGetTopologyCommonAncestor", ancestor)
    with fake.installed():
        topo = read_live()
    assert topo.matrix.code("GPU0", "GPU1") is None and topo.matrix.code("GPU0", "GPU2") == "PXB"
    assert topo.gpu(0).error is None
    assert topo.warnings == ("GPU0-GPU1: TopologyCommonAncestor is n/a: NVML said Unknown Error",)


def test_no_gpus_is_unavailable(no_smi: Path) -> None:
    with FakeNvml([]).installed(), pytest.raises(UnavailableError, match="NVML sees no GPUs"):
        read_live()


# --- no NVML: nvidia-smi fallback and the final error ---------------------------------------------


def test_no_driver_and_no_nvidia_smi_is_exit_3(no_smi: Path) -> None:
    with FakeNvml.no_driver().installed(), pytest.raises(UnavailableError) as info:
        read_live()
    assert info.value.exit_code == EXIT_UNAVAILABLE == 3
    assert info.value.message == "no NVIDIA driver or NVML found on this machine"
    assert "--input sample:seed-8gpu-nv4" in info.value.hint and "--input FILE" in info.value.hint


def test_driver_not_loaded_counts_as_no_driver(no_smi: Path) -> None:
    fake = FakeNvml.no_driver(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with fake.installed(), pytest.raises(UnavailableError, match="^no NVIDIA driver or NVML found"):
        read_live()


def test_broken_nvml_says_what_nvml_and_nvidia_smi_said(no_smi: Path) -> None:
    fake = FakeNvml.no_driver(init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    with fake.installed(), pytest.raises(UnavailableError) as info:
        read_live()
    assert "NVML could not start: RM has detected an NVML/RM version mismatch" in info.value.message
    assert "nvidia-smi is not on PATH" in info.value.message
    assert info.value.exit_code == 3


def test_real_pynvml_without_a_driver_is_unavailable(no_smi: Path) -> None:
    try:
        with nvml.session():
            pytest.skip("this machine has a working NVML")
    except nvml.NvmlUnavailable:
        pass
    with pytest.raises(UnavailableError, match="no NVIDIA driver or NVML found on this machine"):
        read_live()


def test_nvidia_smi_fallback_reads_its_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gputopo.topology.parse_smi")
    smi_printing(tmp_path, monkeypatch, SMI_TEXT)
    with FakeNvml.no_driver().installed():
        topo = read_live()
    assert topo.source == "nvidia-smi"
    assert topo.matrix.code("GPU0", "GPU1") == "PHB"
    assert topo.gpu(1).cpu_affinity == "0-15"
    assert topo.warnings[0].startswith(
        "NVML could not start: NVML Shared Library Not Found; read `nvidia-smi"
    )


def stub_parser(monkeypatch: pytest.MonkeyPatch, parse) -> None:
    """Stand in for ``gputopo.topology.parse_smi`` so the fallback's wiring is tested on its own."""
    module = types.ModuleType("gputopo.topology.parse_smi")
    module.parse_topo_text = parse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gputopo.topology.parse_smi", module)


def test_fallback_hands_nvidia_smi_text_to_the_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def parse(text: str, source: str) -> Topology:
        seen.append((text, source))
        labels = ("GPU0", "GPU1")
        return Topology(
            source=source,
            gpus=(Gpu(0), Gpu(1)),
            nics=(),
            matrix=Matrix(labels, (("X", "PHB"), ("PHB", "X"))),
            warnings=("legend missing",),
        )

    stub_parser(monkeypatch, parse)
    smi_printing(tmp_path, monkeypatch, SMI_TEXT)
    with FakeNvml.no_driver().installed():
        topo = read_live()
    assert seen == [(SMI_TEXT, "nvidia-smi")]
    assert topo.source == "nvidia-smi" and topo.matrix.code("GPU0", "GPU1") == "PHB"
    assert len(topo.warnings) == 2 and topo.warnings[1] == "legend missing"
    assert "no PCIe, NVLink, P2P or process details" in topo.warnings[0]


def test_unreadable_nvidia_smi_output_is_unavailable_not_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parse(text: str, source: str) -> Topology:
        raise ParseError("no GPU header line", line_no=1)

    stub_parser(monkeypatch, parse)
    smi_printing(tmp_path, monkeypatch, "No devices were found\n")
    with FakeNvml.no_driver().installed(), pytest.raises(UnavailableError) as info:
        read_live()
    assert info.value.exit_code == 3
    assert info.value.message == (
        "cannot read the output of `nvidia-smi topo -m` on this machine: line 1: no GPU header line"
    )


def test_nvidia_smi_that_fails_is_no_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(
        tmp_path,
        monkeypatch,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n',
    )
    with pytest.raises(smi.SmiUnavailable, match=r"failed \(exit 9\): NVIDIA-SMI has failed because"):
        smi.topo_matrix_text()
    with FakeNvml.no_driver().installed(), pytest.raises(UnavailableError, match="^no NVIDIA driver"):
        read_live()


def test_nvidia_smi_text_passes_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi_printing(tmp_path, monkeypatch, SMI_TEXT)
    assert smi.topo_matrix_text() == SMI_TEXT


def test_nvidia_smi_printing_nothing_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "exit 0\n")
    with pytest.raises(smi.SmiUnavailable, match="printed nothing"):
        smi.topo_matrix_text()


def test_nvidia_smi_that_hangs_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(tmp_path, monkeypatch, "exec sleep 30\n")
    with pytest.raises(smi.SmiUnavailable, match="did not finish within 0.3 s"):
        smi.topo_matrix_text(timeout_s=0.3)


def test_missing_nvidia_smi(no_smi: Path) -> None:
    with pytest.raises(smi.SmiUnavailable, match="not on PATH") as info:
        smi.topo_matrix_text()
    assert info.value.exit_code == 3


# --- processes, minor numbers, PID namespace ------------------------------------------------------


def test_gpu_processes_lists_compute_and_graphics_once_per_gpu() -> None:
    fake = FakeNvml.pcie_box(
        processes={0: [(222, None), (111, 500)], 2: [(111, 700)]},
        graphics_processes={0: [(111, 500)], 3: [(333, 20)]},
    )
    with fake.installed():
        procs = gpu_processes()
        topo = read_live()
    assert procs == [
        GpuProcess(111, 0, 500),
        GpuProcess(222, 0, None),
        GpuProcess(111, 2, 700),
        GpuProcess(333, 3, 20),
    ]
    assert topo.gpu(0).compute_pids == (111, 222)
    assert topo.gpu(3).compute_pids == ()  # graphics only
    assert fake.open_sessions == 0


def test_gpu_processes_on_a_driver_older_than_the_v3_query() -> None:
    fake = FakeNvml.nvlink_box(process_api_v3=False, processes={1: [(4242, 1024)]})
    with fake.installed():
        assert gpu_processes() == [GpuProcess(4242, 1, 1024)]
        assert read_live().gpu(1).compute_pids == (4242,)


def test_gpu_processes_skips_a_lost_gpu() -> None:
    fake = FakeNvml.lost_gpu_box(processes={5: [(1, 10)], 6: [(2, 20)]})
    with fake.installed():
        assert gpu_processes() == [GpuProcess(2, 6, 20)]


def test_minor_numbers_follow_nvml_not_the_index() -> None:
    fake = FakeNvml.lost_gpu_box()
    for i, gpu in enumerate(fake.gpus):
        gpu.minor = 7 - i
    with fake.installed():
        assert minor_numbers() == {0: 7, 1: 6, 2: 5, 3: 4, 4: 3, 6: 1, 7: 0}


def test_without_nvml_processes_and_minors_are_unknown() -> None:
    with FakeNvml.no_driver().installed():
        assert gpu_processes() is None
        assert minor_numbers() is None
        assert nvml_sees_pid_namespace() is None


@pytest.fixture
def device_holder(tmp_path: Path):
    """A real child process holding a fake GPU device file open (``tmp_path/nvidia0``)."""
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print('ok', flush=True); time.sleep(60)",
            dev,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ok"
    yield child, str(tmp_path / "nvidia*")
    child.kill()
    child.wait()
    child.stdout.close()


def test_pid_namespace_is_seen_when_a_reported_pid_holds_a_device(device_holder) -> None:
    child, pattern = device_holder
    with FakeNvml.pcie_box(processes={0: [(child.pid, 100)]}).installed():
        assert nvml_sees_pid_namespace(device_pattern=pattern) is True


def test_pid_namespace_is_not_seen_when_reported_pids_are_absent_or_unrelated(device_holder) -> None:
    child, pattern = device_holder
    beyond_pid_max = 2**22 + 1  # Linux pid_max is at most 2**22: no such process anywhere
    with FakeNvml.pcie_box(processes={0: [(beyond_pid_max, 100)], 1: [(os.getpid(), 5)]}).installed():
        assert nvml_sees_pid_namespace(device_pattern=pattern) is False
    with FakeNvml.pcie_box(processes={0: [(beyond_pid_max, 100), (child.pid, 5)]}).installed():
        assert nvml_sees_pid_namespace(device_pattern=pattern) is True


def test_pid_namespace_unknown_without_processes_or_with_unreadable_fds(
    device_holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    child, pattern = device_holder
    with FakeNvml.pcie_box().installed():
        assert nvml_sees_pid_namespace(device_pattern=pattern) is None
    real_listdir = os.listdir

    def listdir(path):
        if str(path) == f"/proc/{child.pid}/fd":
            raise PermissionError(13, "Permission denied")
        return real_listdir(path)

    monkeypatch.setattr(inventory.os, "listdir", listdir)
    with FakeNvml.pcie_box(processes={0: [(child.pid, 100)]}).installed():
        assert nvml_sees_pid_namespace(device_pattern=pattern) is None


# --- the seam itself and pure helpers -------------------------------------------------------------


def test_nvml_is_shut_down_when_reading_fails(no_smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml.pcie_box()

    def count():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlDeviceGetCount", count)
    with fake.installed(), pytest.raises(UnavailableError, match="cannot count the GPUs: Unknown Error"):
        read_live()
    assert fake.init_count == 1 and fake.open_sessions == 0


def test_use_backend_restores_the_previous_backend() -> None:
    outer, inner = FakeNvml.pcie_box(), FakeNvml.nvswitch_box()
    with outer.installed():
        with inner.installed():
            assert len(read_live().gpus) == 4
        assert len(read_live().gpus) == 8
    assert not nvml.backend_overridden()


def test_importing_the_seam_does_not_import_pynvml() -> None:
    code = "import sys, gputopo.system.inventory; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"00000000:1B:00.0", "00000000:1B:00.0"),
        (b"0000:1b:00.0\x00\x00", "00000000:1B:00.0"),
        ("00000001:c5:00.0", "00000001:C5:00.0"),
        ("3b:00.0", "00000000:3B:00.0"),
        (b"", None),
        (None, None),
    ],
)
def test_normalize_bus_id(raw, expected) -> None:
    assert nvml.normalize_bus_id(raw) == expected


def test_bitmask_ids_and_ranges() -> None:
    assert nvml.bitmask_ids([0b1011, 0, 1 << 63]) == (0, 1, 3, 191)
    assert nvml.bitmask_ids([0, 0]) == ()
    assert format_id_ranges([64, 0, 1, 2, 65, 5]) == "0-2,5,64-65"
    assert format_id_ranges([7]) == "7"
    assert format_id_ranges([]) == ""


@pytest.mark.parametrize(("version", "text"), [(12040, "12.4"), (11080, "11.8"), (13000, "13.0"), (0, None)])
def test_cuda_version_text(version, text) -> None:
    assert nvml.cuda_version_text(version) == text


# --- a real GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_read_live_on_real_nvml() -> None:
    try:
        with nvml.session() as s:
            count = s.device_count()
    except nvml.NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc.message}")
    topo = read_live()
    assert topo.source == "nvml" and topo.live and len(topo.gpus) == count
    n = len(topo.gpus)
    assert [topo.matrix.cells[i][i] for i in range(n)] == ["X"] * n
    for g in topo.gpus:
        if g.error is None:
            assert g.name and g.pci_bus_id and len(g.pci_bus_id.split(":")[0]) == 8
            assert g.uuid and g.uuid.startswith(("GPU-", "MIG-"))
            assert g.memory_total_mib and g.memory_total_mib > 0
    assert topo.driver_version
    assert minor_numbers() is not None and gpu_processes() is not None


def test_bindings_without_the_mismatch_error_class_read_past_a_field_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nvidia-ml-py 12.535.x has no NVMLLibraryMismatchError: the first NVML error of any kind used to
    # crash the whole read with AttributeError.
    monkeypatch.delattr(pynvml, "NVMLLibraryMismatchError", raising=False)
    fake = FakeNvml.pcie_box()
    real = fake.nvmlDeviceGetNumaNodeId

    def numa(handle):
        if handle.index == 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return real(handle)

    monkeypatch.setattr(fake, "nvmlDeviceGetNumaNodeId", numa)
    with fake.installed():
        topo = read_live()
    assert topo.gpu(2).error is None and topo.gpu(2).gpu_numa_id is None
    assert topo.gpu(2).name is not None
