"""The other half of the node (issue 30): network ports, GPUDirect RDMA, and the PCIe path between GPUs,
read from captured-shape sysfs/procfs trees built here (tests/sysfs_tree.py) and checked against the real
``lspci`` reading the same tree."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import sysfs_tree as st
from gputopo.errors import UsageError
from gputopo.health.network import PortReading, PortSample, judge_ports
from gputopo.services import fabric
from gputopo.system.pci_path import read_path, read_paths
from gputopo.system.ports import gdr_inputs, read_ports
from gputopo.system.sysfs import FsView, view
from gputopo.topology.pcie_path import (
    ACS_ABSENT,
    ACS_CLEAN,
    ACS_NOT_CHECKED,
    ACS_REDIRECT,
    acs_bits_text,
    iommu_mode,
    parse_acs,
)

GPUS = {i: f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(8)}
RP2, RP3 = st.switch_bridges(2)[0], st.switch_bridges(3)[0]


def fs_of(tree: st.Tree) -> FsView:
    return FsView(tree.sys, tree.proc)


# --- the view --------------------------------------------------------------------------------------------


def test_the_view_follows_the_environment_and_an_empty_variable_keeps_the_default() -> None:
    assert view({}) == FsView(Path("/sys"), Path("/proc"))
    assert view({"GPUTOPO_SYSFS_ROOT": "", "GPUTOPO_PROCFS_ROOT": "/x/proc"}) == FsView(
        Path("/sys"), Path("/x/proc")
    )
    assert view({"GPUTOPO_SYSFS_ROOT": "/t/sys"}).rerooted


# --- ACS in config space, against the real lspci ---------------------------------------------------------

lspci = shutil.which("lspci")
needs_lspci = pytest.mark.skipif(lspci is None, reason="lspci (pciutils) is not installed")


def lspci_acsctl(tree: st.Tree) -> dict[str, str]:
    """``bdf -> ACSCtl bits`` as the real lspci reads the tree."""
    out = subprocess.run(
        [lspci or "lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={tree.sys / 'bus' / 'pci'}", "-D", "-vvv"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    found: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) ", line)
        if m:
            current = m.group(1)
        elif "ACSCtl:" in line and current:
            found[current] = line.split("ACSCtl:", 1)[1].strip()
    return found


@needs_lspci
def test_acs_bits_match_what_lspci_prints_from_the_same_tree(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, acs={RP2: st.REDIRECT, RP3: st.SV | st.CR})
    seen = lspci_acsctl(tree)
    paths = read_paths(GPUS.values(), fs_of(tree))
    ours = {br.bdf: br.acs.lspci for p in paths.values() if not isinstance(p, str) for br in p.bridges}
    ours = {k: v for k, v in ours.items() if v is not None}
    # Every bridge with ACS: root ports and downstream ports (the switch upstream ports have none).
    assert len(ours) == 4 + 8 and ours == {k: seen[k] for k in ours}
    assert seen[RP2] == "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"
    assert seen[RP3].startswith("SrcValid+ TransBlk- ReqRedir- CmpltRedir+")


@needs_lspci
@pytest.mark.parametrize("length", [64, 256])
def test_a_short_config_read_is_not_checked_and_lspci_shows_no_acs_either(
    tmp_path: Path, length: int
) -> None:
    tree = st.eight_gpu_node(tmp_path, acs={RP2: st.REDIRECT}, config_length=length)
    assert lspci_acsctl(tree) == {}
    reading = parse_acs((tree.sys / "bus/pci/devices" / RP2 / "config").read_bytes())
    assert reading.state == ACS_NOT_CHECKED and f"only {length} bytes" in (reading.why or "")


def test_the_acs_capability_is_found_behind_another_and_its_absence_is_not_a_redirect() -> None:
    blob = st.config_blob(0x10B5, 1, True, st.RR)
    assert parse_acs(blob).state == ACS_REDIRECT and parse_acs(blob).offset == st.ACS_OFFSET
    assert parse_acs(st.config_blob(0x10B5, 1, True, st.SV)).state == ACS_CLEAN
    assert parse_acs(st.config_blob(0x10B5, 1, True, None)).state == ACS_ABSENT
    assert parse_acs(None).state == ACS_NOT_CHECKED
    # A looping capability list ends instead of spinning.
    loop = bytearray(st.config_blob(0x10B5, 1, True, None))
    loop[0x100:0x104] = (0x0001 | (0x100 << 20)).to_bytes(4, "little")
    assert parse_acs(bytes(loop)).state == ACS_ABSENT
    assert acs_bits_text(0x7F).count("+") == 7


# --- the path of each pair --------------------------------------------------------------------------------


def test_a_gpus_chain_is_its_bridges_root_port_first(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path)
    p = read_path("0000:58:00.0", fs_of(tree))  # GPU4: switch 2
    assert not isinstance(p, str)
    rp, usp, dsp_bus = st.switch_bridges(2)
    assert [b.bdf for b in p.bridges] == [rp, usp, f"0000:{dsp_bus}:00.0"] and p.host == "pci0000:80"
    assert p.numa_node == 1
    assert "not found" in str(read_path("0000:99:00.0", fs_of(tree)))


def test_redirect_at_the_root_ports_above_gpus_5_and_6_hits_5_6_but_not_4_5_or_6_7(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, acs={RP2: st.REDIRECT, RP3: st.REDIRECT})
    pairs = {p.label: p for p in fabric.read_pairs(GPUS, fs_of(tree))}
    assert pairs["GPU5-GPU6"].status == ACS_REDIRECT
    assert [b.bdf for b in pairs["GPU5-GPU6"].redirect] == [RP2, RP3]
    assert pairs["GPU4-GPU5"].status == ACS_CLEAN and pairs["GPU6-GPU7"].status == ACS_CLEAN
    assert pairs["GPU0-GPU1"].status == ACS_CLEAN and pairs["GPU0-GPU2"].status == ACS_CLEAN


def test_redirect_on_a_downstream_port_hits_the_pair_below_one_switch(tmp_path: Path) -> None:
    dsp5 = f"0000:{st.switch_bridges(2)[2]}:01.0"
    tree = st.eight_gpu_node(tmp_path, acs={dsp5: st.RR})
    result = fabric.finish(fabric.start(fs_of(tree)), GPUS)
    pairs = {p.label: p for p in result.pairs}
    assert pairs["GPU4-GPU5"].status == ACS_REDIRECT and pairs["GPU6-GPU7"].status == ACS_CLEAN
    (finding,) = [f for f in result.findings if f.category == "pcie"]
    assert finding.where == f"PCIe bridge {dsp5}" and "GPU4-GPU5" in finding.what
    assert "ReqRedir+ CmpltRedir-" in finding.what
    assert f"setpci -s {dsp5} ECAP_ACS+0x6.w=0000" in finding.remedy and "troubleshooting" in finding.remedy


def test_a_non_root_read_is_not_checked_never_a_pass(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, acs={RP2: st.REDIRECT}, config_length=64)
    result = fabric.finish(fabric.start(fs_of(tree)), GPUS)
    assert not [f for f in result.findings if f.category == "pcie"]
    (what, why), *_ = result.not_checked
    assert "PCIe ACS" in what and "only 64 bytes" in why and "root" in why
    assert all(p.status == ACS_NOT_CHECKED for p in result.pairs)


# --- IOMMU -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "mode"),
    [
        ("BOOT_IMAGE=/vmlinuz ro intel_iommu=on", "translated"),
        ("ro amd_iommu=on", "translated"),
        ("ro intel_iommu=on iommu=pt", "passthrough"),
        ("ro intel_iommu=on,sm_on iommu.passthrough=1", "passthrough"),
        ("ro intel_iommu=off", "off"),
        ("ro quiet", "default"),
        ("ro -- intel_iommu=on", "default"),  # init's words, not the kernel's
    ],
)
def test_the_iommu_mode_from_the_kernel_command_line(cmdline: str, mode: str) -> None:
    assert iommu_mode(cmdline) == mode
    assert iommu_mode(None) is None


# --- ports ------------------------------------------------------------------------------------------------


def test_ports_read_with_their_counters_numa_node_model_and_rail(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, port_overrides={3: {"link_layer": "Ethernet", "netdev": "ens3np0"}})
    st.Tree(tmp_path).netdev("ens3np0", tmp_path / "sys/bus/pci/devices" / st.nic_bdf(3))
    sample = read_ports(fs_of(tree))
    names = [p.name for p in sample.ports]
    assert names == [f"mlx5_{i}:1" for i in range(8)]  # the RoCE netdev is judged as its RDMA port
    p3 = sample.ports[3]
    assert p3.rate_gbps == 400 and p3.link_layer == "Ethernet" and p3.netdev == "ens3np0"
    assert p3.counters["symbol_error"] == 0 and p3.counters["hw_rnr_nak_retry_err"] == 0
    assert p3.model == "15b3:1021" and p3.numa_node == 0 and p3.pci_bus_id == st.nic_bdf(3)


def judged(tree: st.Tree, change=None, wait_s: float = 0.0):  # type: ignore[no-untyped-def]
    started = fabric.start(fs_of(tree))
    if change:
        change(tree)
    if wait_s:
        time.sleep(wait_s)
    result = fabric.finish(started, GPUS)
    return [f for f in result.findings if f.category == "network"], result


def test_a_clean_node_has_no_findings_and_nothing_unchecked(tmp_path: Path) -> None:
    findings, result = judged(st.eight_gpu_node(tmp_path))
    assert result.findings == () and result.not_checked == ()
    assert result.gdr == "nvidia_peermem" and result.facts["rdma_ports"] == 8
    assert result.facts["rates_gbps"] == [400.0] * 8 and result.iommu == "default"


def test_a_port_down_while_its_peers_are_active_names_the_gpus_behind_it(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, port_overrides={5: {"state": "1: DOWN", "phys_state": "2: Polling"}})
    findings, _ = judged(tree)
    (f,) = findings
    assert f.where == "mlx5_5:1" and f.severity == "problem" and f.category == "network"
    assert "1: DOWN, 2: Polling" in f.what and "GPU4, GPU5" in f.what and "mlxlink -d mlx5_5 -p 1" in f.remedy


def test_a_port_down_with_no_gpu_nearby_is_only_a_note(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(
        tmp_path, ngpus=4, port_overrides={6: {"state": "1: DOWN", "phys_state": "3: Disabled"}}
    )
    started = fabric.start(fs_of(tree))
    result = fabric.finish(started, {i: GPUS[i] for i in range(4)})
    (f,) = [f for f in result.findings if f.category == "network"]
    assert f.severity == "note" and "management or storage port" in f.what


def test_a_port_at_half_rate_among_400s_is_a_problem(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, port_overrides={2: {"rate": "200 Gb/sec (4X HDR)"}})
    (f,) = judged(tree)[0]
    assert f.where == "mlx5_2:1" and "200 Gb/s" in f.what and "400 Gb/s" in f.what and "GPU2, GPU3" in f.what


def test_link_downed_rising_between_the_two_readings_is_a_problem(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path)
    (f,) = judged(tree, lambda t: t.counter("mlx5_1", 1, "link_downed", 1))[0]
    assert f.where == "mlx5_1:1" and "link_downed rose by 1" in f.what and f.action == "drain"


def test_symbol_errors_above_10_per_second_are_a_problem_and_a_few_are_not(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path)
    # 5 errors in a sub-second window count over 1 s: 5/s, below NVSentinel's 10/s.
    assert judged(tree, lambda t: t.counter("mlx5_0", 1, "symbol_error", 5))[0] == []
    (f,) = judged(tree, lambda t: t.counter("mlx5_0", 1, "symbol_error", 500))[0]
    assert "symbol_error rose by 495" in f.what and "above 10/s" in f.what


def test_a_counter_reset_between_readings_is_not_a_rise() -> None:
    def port(v: int) -> PortReading:
        return PortReading(
            "ib", "mlx5_0:1", "mlx5_0", "1", "4: ACTIVE", "5: LinkUp", 400, counters={"link_downed": v}
        )

    assert judge_ports(PortSample((port(7),), 0.0), PortSample((port(0),), 2.0)) == []


def test_no_gpudirect_is_a_note_naming_the_cost_and_dmabuf_counts_as_a_path(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, proc={"modules": ("nvidia", "mlx5_ib")})
    _, result = judged(tree)
    (f,) = [f for f in result.findings if f.where == "GPUDirect RDMA"]
    assert f.severity == "note" and "staged through host memory" in f.what and result.gdr == "none"
    tree.proc_files(
        modules=("nvidia",),
        driver_version="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15",
    )
    assert gdr_inputs(fs_of(tree))["open_module"] is True
    assert judged(tree)[1].gdr == "dmabuf"


def test_an_iommu_in_translation_mode_is_a_note_and_pt_is_not(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, proc={"cmdline": "ro intel_iommu=on"})
    (f,) = judged(tree)[1].findings
    assert f.severity == "note" and "iommu=pt" in f.remedy
    tree.proc_files(cmdline="ro intel_iommu=on iommu=pt")
    assert judged(tree)[1].findings == ()


# --- on the fake driver: gputopo check reads the tree ------------------------------------------------------

fake_driver = pytest.importorskip("fake_driver")
needs_cc = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")

# Eight healthy H100s with tests/fake_driver's PCIe paths (GPU pairs 0-1, 2-3, 4-5, 6-7 on a switch each).
HEALTHY_EIGHT = [
    "driver 550.54.15",
    "cuda 12040",
    *(f"gpu {i} {fake_driver.bus(i)} {fake_driver.uuid(i)} {i} NVIDIA H100 PCIe" for i in range(8)),
    *(f"pcie {i} 5 5 16 16" for i in range(8)),
    *(f"mem {i} 81559 0 512" for i in range(8)),
    *(f"cpus {i} {'ffffffff' if i < 4 else 'ffffffff00000000'}" for i in range(8)),
    *(f"nodes {i} {'1' if i < 4 else '2'}" for i in range(8)),
    *(f"mig {i} 0 0" for i in range(8)),
    *fake_driver.EIGHT_GPU_PATHS,
]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def machine(tmp_path: Path) -> Path:
    path = tmp_path / "machine.txt"
    path.write_text("\n".join(HEALTHY_EIGHT) + "\n")
    return path


def check(driver: Path, tmp_path: Path, tree: st.Tree, *args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    out = fake_driver.run(
        driver, machine(tmp_path), "check", "--json", "--sample-s", "0", *args, extra_env=tree.env, timeout=60
    )
    return out.returncode, json.loads(out.stdout)


def ours(not_checked: list[dict[str, str]]) -> list[dict[str, str]]:
    """The not-checked entries of this issue's reads (the fake machine leaves some NVML fields unset)."""
    return [n for n in not_checked if "PCIe ACS" in n["what"] or "port" in n["what"]]


@needs_cc
def test_check_on_a_clean_tree_is_healthy_with_nothing_unchecked(driver: Path, tmp_path: Path) -> None:
    code, doc = check(driver, tmp_path, st.eight_gpu_node(tmp_path / "t"))
    assert code == 0 and doc["findings"] == [] and ours(doc["not_checked"]) == []


@needs_cc
def test_check_names_a_bad_port_and_the_acs_bridge_above_gpus_5_and_6(driver: Path, tmp_path: Path) -> None:
    tree = st.eight_gpu_node(
        tmp_path / "t",
        acs={RP2: st.REDIRECT, RP3: st.REDIRECT},
        port_overrides={2: {"rate": "200 Gb/sec (4X HDR)"}},
        proc={"cmdline": "ro intel_iommu=on", "modules": ("nvidia",)},
    )
    code, doc = check(driver, tmp_path, tree)
    assert code == 1
    by_where = {f["where"]: f for f in doc["findings"]}
    assert by_where["mlx5_2:1"]["category"] == "network" and "GPU2, GPU3" in by_where["mlx5_2:1"]["what"]
    assert "GPU5-GPU6" in by_where[f"PCIe bridge {RP2}"]["what"]
    assert by_where["GPUDirect RDMA"]["severity"] == "note"
    assert by_where["kernel command line"]["severity"] == "note"


@needs_cc
def test_check_on_a_non_root_read_says_not_checked(driver: Path, tmp_path: Path) -> None:
    code, doc = check(driver, tmp_path, st.eight_gpu_node(tmp_path / "t", nics=0, config_length=64))
    assert code == 0 and doc["findings"] == []
    assert [n["what"].startswith("PCIe ACS") for n in ours(doc["not_checked"])] == [True]


def recommend(driver: Path, tmp_path: Path, tree: st.Tree, *args: str) -> dict:  # type: ignore[type-arg]
    out = fake_driver.run(
        driver, machine(tmp_path), "recommend", "--json", *args, extra_env=tree.env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_cc
def test_recommend_avoids_gpus_5_and_6_behind_acs_redirect(driver: Path, tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path / "t", acs={RP2: st.REDIRECT, RP3: st.REDIRECT})
    doc = recommend(driver, tmp_path, tree, "--n", "4", "--top", "2")
    first, second = doc["candidates"]
    assert first["gpus"] == [0, 1, 2, 3] and second["gpus"] == [4, 5, 6, 7]
    assert any("GPU5-GPU6" in r and RP2 in r for r in second["reasons"])
    assert "ACS-redirecting bridge" in second["reasons"][-1]


@needs_cc
def test_recommend_ranks_an_equally_wired_clean_set_first(driver: Path, tmp_path: Path) -> None:
    """The same redirect on socket 0's root ports turns the PCI-order winner {0,1,2,3} into #2."""
    rp0, rp1 = st.switch_bridges(0)[0], st.switch_bridges(1)[0]
    clean = recommend(driver, tmp_path, st.eight_gpu_node(tmp_path / "clean"), "--n", "4", "--top", "2")
    assert clean["best"]["gpus"] == [0, 1, 2, 3]
    tree = st.eight_gpu_node(tmp_path / "t", acs={rp0: st.REDIRECT, rp1: st.REDIRECT})
    doc = recommend(driver, tmp_path, tree, "--n", "4", "--top", "2")
    assert [c["gpus"] for c in doc["candidates"]] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert "as fast as #1 on paper, but 4 of its pairs cross" in doc["candidates"][1]["reasons"][-1]


@needs_cc
def test_topo_shows_the_ports_and_each_pairs_acs(driver: Path, tmp_path: Path) -> None:
    tree = st.eight_gpu_node(
        tmp_path / "t", acs={RP2: st.REDIRECT, RP3: st.REDIRECT}, port_overrides={5: {"state": "1: DOWN"}}
    )
    out = fake_driver.run(driver, machine(tmp_path), "topo", extra_env=tree.env, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Network ports:" in text and re.search(r"mlx5_5:1\s+ib\s+1: DOWN", text)
    assert re.search(r"mlx5_0:1 .* GPU0, GPU1", text)
    assert re.search(r"^GPU5 +ACS +ACS +ACS +ACS +ok +X +ACS +ACS$", text, re.M)
    assert re.search(r"^GPU6 +ACS +ACS +ACS +ACS +ACS +ACS +X +ok$", text, re.M)
    assert f"bridge {RP2} redirects P2P of GPU4-GPU6, GPU4-GPU7, GPU5-GPU6" in text
    assert "GPUDirect RDMA: nvidia_peermem (8 RDMA ports)" in text


def test_a_probe_finding_wrong_data_on_a_redirected_pair_names_the_bridge() -> None:
    from gputopo.probe.judge.findings import probe_findings

    probe = {
        "sets": [
            {
                "gpus": [5, 6],
                "checks": [{"name": "dp", "verdict": "fail", "kind": "nan", "detail": "loss NaN"}],
            },
            {
                "gpus": [6, 7],
                "checks": [{"name": "dp", "verdict": "fail", "kind": "nan", "detail": "loss NaN"}],
            },
        ]
    }
    redirected = ((5, 6, (RP2, RP3)),)
    on_56, on_67 = probe_findings(probe, redirected)
    assert f"the likely cause: ACS redirects P2P between GPU5-GPU6 at bridge {RP2}, {RP3}" in on_56.what
    assert "likely cause" not in on_67.what


# --- baselines, run records and drift carry the network facts ------------------------------------------


@needs_cc
def test_the_baseline_records_gdr_nic_count_and_rates_and_shows_their_drift(
    driver: Path, tmp_path: Path
) -> None:
    saved = tmp_path / "golden.json"
    code, _ = check(driver, tmp_path, st.eight_gpu_node(tmp_path / "good"), "--save-baseline", str(saved))
    network = json.loads(saved.read_text())["network"]
    assert network["gdr"] == "nvidia_peermem" and network["rdma_ports"] == 8
    assert network["rates_gbps"] == [400.0] * 8 and network["ports"]["mlx5_3:1"] == 400.0
    sick = st.eight_gpu_node(
        tmp_path / "sick", port_overrides={3: {"rate": "200 Gb/sec (4X HDR)"}}, proc={"modules": ("nvidia",)}
    )
    code, doc = check(driver, tmp_path, sick, "--baseline", str(saved))
    assert code == 1
    whats = [f["what"] for f in doc["findings"]]
    assert "RDMA port mlx5_3:1 runs at 200 Gb/s, the baseline has 400 Gb/s" in whats
    assert "GPUDirect RDMA is none here, the baseline has nvidia_peermem" in whats


def test_run_facts_and_drift_carry_the_gpudirect_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gputopo.health.drift import compare
    from gputopo.system.run_facts import config_facts

    for key, value in st.eight_gpu_node(tmp_path / "a").env.items():
        monkeypatch.setenv(key, value)
    on = config_facts(None, [], {})
    assert on["gdr"] == "nvidia_peermem" and on["rdma_ports"] == 8 and on["nic_rates_gbps"] == ["400"] * 8
    off = {**on, "gdr": "none"}
    (drift,) = compare({"node0": on, "node1": off})
    assert (
        drift.text() == "GPUDirect RDMA: nvidia_peermem on node0; none on node1" and drift.severity == "note"
    )


def test_the_network_and_path_rules_are_rows_of_the_one_table_and_its_reference() -> None:
    from gputopo.health.network import RULES
    from gputopo.health.rules import RULES as ALL

    page = (Path(__file__).resolve().parents[1] / "docs" / "health-rules.md").read_text()
    reference = page.split("<!-- rules:begin -->", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert RULES and all(ALL[r.name] is r for r in RULES)
    for rule in RULES:
        assert rule.dcgm == "none" and "not NIC ports" in rule.why, rule.name
        row = next((line for line in reference.splitlines() if line.startswith(f"| `{rule.name}` |")), None)
        assert row is not None, rule.name
        assert f"| {rule.category} |" in row and f"| {rule.severity}, {rule.action}" in row
        assert f"| n/a: {rule.why} |" in row


def _symbol_ports(before: int, after: int) -> tuple[PortSample, PortSample]:
    def port(v: int) -> PortReading:
        return PortReading(
            "ib", "mlx5_0:1", "mlx5_0", "1", "4: ACTIVE", "5: LinkUp", 400, counters={"symbol_error": v}
        )

    return PortSample((port(before),), 0.0), PortSample((port(after),), 2.0)


def test_thresholds_set_the_network_limits_and_turn_a_rule_off_or_down() -> None:
    from gputopo.health.rules import parse_thresholds

    first, second = _symbol_ports(0, 100)  # 50/s over 2 s
    (f,) = judge_ports(first, second)
    assert f.rule == "port_symbol_errors" and "above 10/s" in f.what and f.severity == "problem"
    assert judge_ports(first, second, thresholds=parse_thresholds('{"port_symbol_errors": 60}', "t")) == []
    (g,) = judge_ports(first, second, thresholds=parse_thresholds('{"port_symbol_errors": 20}', "t"))
    assert "above 20/s" in g.what
    off = parse_thresholds('{"port_symbol_errors": {"enabled": false}}', "t")
    assert judge_ports(first, second, thresholds=off) == []
    note = parse_thresholds('{"port_symbol_errors": {"severity": "note", "action": "monitor"}}', "t")
    (h,) = judge_ports(first, second, thresholds=note)
    assert (h.severity, h.action) == ("note", "monitor") and h.what == f.what
    # A limit on an "any rise" counter: a rise up to it is no finding.
    a, b = (
        PortSample((PortReading("ib", "p", "d", "1", "4: ACTIVE", counters={"link_downed": v}),), t)
        for v, t in ((0, 0.0), (2, 2.0))
    )
    assert [x.rule for x in judge_ports(a, b)] == ["port_link_downed"]
    assert judge_ports(a, b, thresholds=parse_thresholds('{"port_link_downed": 2}', "t")) == []
    # A yes/no rule has no limit to set.
    with pytest.raises(UsageError, match="no limit"):
        parse_thresholds('{"acs_redirect": 1}', "t")


def test_thresholds_set_the_since_last_check_limit() -> None:
    from gputopo.health.network import since_last_run
    from gputopo.health.rules import parse_thresholds

    _, now = _symbol_ports(0, 300)
    saved = {"mlx5_0:1": {"symbol_error": 0}}
    (f,) = since_last_run(saved, 0.0, now, 600.0)  # 1800/hour over 10 min
    assert f.rule == "port_symbol_errors_since_last" and "above 120/hour" in f.what
    raised = parse_thresholds('{"port_symbol_errors_since_last": 2000}', "t")
    assert since_last_run(saved, 0.0, now, 600.0, thresholds=raised) == []


@needs_cc
def test_doctor_carries_the_network_and_path_findings(driver: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")  # doctor's tests run where its probe extras are installed
    tree = st.eight_gpu_node(
        tmp_path / "t", acs={RP2: st.REDIRECT, RP3: st.REDIRECT}, port_overrides={5: {"state": "1: DOWN"}}
    )
    out = fake_driver.run(
        driver, machine(tmp_path), "doctor", "--skip-probe", "--json", extra_env=tree.env, timeout=280
    )
    doc = json.loads(out.stdout)
    wheres = {f["where"]: f for f in doc["findings"]}
    assert out.returncode == 1 and wheres["mlx5_5:1"]["category"] == "network"
    assert "GPU5-GPU6" in wheres[f"PCIe bridge {RP2}"]["what"]
    assert [r["best"]["gpus"] for r in doc["recommendations"] if r["n"] == 4] == [[0, 1, 2, 3]]


@needs_cc
def test_doctor_ranks_sets_by_the_path_table_its_health_check_read(driver: Path, tmp_path: Path) -> None:
    """doctor reads the PCIe path table once, in its health check, and ranks its sets by that reading: the
    redirect on socket 0's root ports turns the PCI-order winner {0,1,2,3} into #2, as recommend does."""
    pytest.importorskip("torch")  # doctor's tests run where its probe extras are installed
    rp0, rp1 = st.switch_bridges(0)[0], st.switch_bridges(1)[0]
    tree = st.eight_gpu_node(tmp_path / "t", acs={rp0: st.REDIRECT, rp1: st.REDIRECT})
    out = fake_driver.run(
        driver, machine(tmp_path), "doctor", "--skip-probe", "--json", extra_env=tree.env, timeout=280
    )
    doc = json.loads(out.stdout)
    assert doc["health"]["checked"] is True, doc["health"]
    assert [r["best"]["gpus"] for r in doc["recommendations"] if r["n"] == 4] == [[4, 5, 6, 7]]


def test_ethernet_interfaces_down_among_peers_or_flapping(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, nics=0)
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    # Two 100 GbE ports on GPU0's and GPU2's switches (the GPUs' own functions stand in as their devices).
    tree.netdev("ens1", devices / st.gpu_bdf(0))
    tree.netdev("ens2", devices / st.gpu_bdf(2), operstate="down", speed=-1)
    tree.netdev("lo", None)  # no device link: not a port
    started = fabric.start(fs_of(tree))
    tree.netdev("ens1", devices / st.gpu_bdf(0), carrier=9)
    result = fabric.finish(started, GPUS)
    by_where = {f.where: f for f in result.findings}
    assert set(by_where) == {"ens1", "ens2"}
    assert "carrier_changes rose by 8" in by_where["ens1"].what
    assert (
        "network interface ens2: down (down) while 1 other port(s) of its kind are up"
        in by_where["ens2"].what
    )
    assert "GPU2, GPU3" in by_where["ens2"].what


@needs_cc
def test_check_with_a_state_file_judges_the_ports_since_the_last_run(driver: Path, tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path / "t")
    state = tmp_path / "state.json"
    code, doc = check(driver, tmp_path, tree, "--state", str(state))
    assert code == 0 and doc["findings"] == []
    saved = json.loads(state.read_text())
    assert saved["counters"]["ports"]["mlx5_4:1"]["symbol_error"] == 0
    # Ten minutes later: 300 symbol errors (0.5/s: nothing in a 0-second window, 1800/hour over the ten
    # minutes, above the 120/hour NVSentinel calls fatal), and a link_downed since.
    saved["counters"]["ports_at"] -= 600
    state.write_text(json.dumps(saved))
    tree.counter("mlx5_4", 1, "symbol_error", 300)
    tree.counter("mlx5_4", 1, "link_downed", 1)
    code, doc = check(driver, tmp_path, tree, "--state", str(state))
    assert code == 1
    (symbols,) = [f for f in doc["findings"] if f["rule"] == "port_symbol_errors_since_last"]
    assert re.search(
        r"symbol_error rose by 300 in 10 min \(1[78]\d\d/hour, above 120/hour\)", symbols["what"]
    )
    assert symbols["what"].endswith("[since the last check, 10 min ago]") and "GPU4, GPU5" in symbols["what"]
    (downed,) = [f for f in doc["findings"] if f["rule"] == "port_link_downed"]
    assert "since the last check" in downed["what"]
    # The next run compares with what this one saw: nothing new.
    code, doc = check(driver, tmp_path, tree, "--state", str(state))
    assert code == 0 and doc["findings"] == []


def test_every_rule_a_network_or_path_finding_names_is_in_the_table() -> None:
    from gputopo.health import network
    from gputopo.topology import pcie_path

    names = {r.name for r in network.RULES}
    used = set()
    for module in (network, pcie_path):
        used |= set(re.findall(r'rule="([a-z_]+)"', Path(module.__file__).read_text()))
        used |= set(re.findall(r'"(port_[a-z_]+)"', Path(module.__file__).read_text())) - {"port_rcv_errors"}
    assert used and used <= names, used - names


def test_probe_says_the_bridge_is_the_likely_cause_of_corrupt_p2p() -> None:
    from gputopo.services.probe import path_causes, wrong_data

    doc = {
        "sets": [
            {
                "gpus": [5, 6],
                "checks": [{"name": "p2p", "verdict": "fail", "kind": "corrupt", "detail": "bytes"}],
            },
            {"gpus": [4, 5], "checks": [{"name": "p2p", "verdict": "pass", "kind": None, "detail": ""}]},
        ]
    }
    assert wrong_data(doc)
    (line,) = path_causes(doc, ((5, 6, (RP2,)),))
    assert line.startswith("GPUs 5,6: p2p check failed (corrupt)") and f"at bridge {RP2}" in line
    assert path_causes(doc, ()) == []


def test_without_any_gpu_in_sysfs_no_port_is_called_a_management_port(tmp_path: Path) -> None:
    tree = st.eight_gpu_node(tmp_path, ngpus=0, port_overrides={6: {"state": "1: DOWN"}})
    result = fabric.finish(fabric.start(fs_of(tree)), GPUS)  # NVML's GPUs, none of them in this sysfs
    (f,) = [f for f in result.findings if f.category == "network"]
    assert f.severity == "problem" and "management" not in f.what
