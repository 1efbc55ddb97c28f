"""Health wired into every command (issue 21 items 4 and 5): the one finding shape in text, JSON, Markdown
and HTML; PCIe links counted at their current width and maximum generation wherever a bandwidth is
estimated; recommend and run leaving sick GPUs out with the reason (``--allow-unhealthy``); topo's health
marks; doctor's health check first. The commands run as a user runs them, over the real nvidia-ml-py and
the fake driver (tests/fakedriver), on the sick HGX node of the issue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_driver
from gputopo.errors import UsageError
from gputopo.findings import NOTE, Finding
from gputopo.model import Gpu, Matrix, PcieLink, Topology
from gputopo.probe.shared import TopologyView
from gputopo.recommend import Constraints, exclusions, recommend
from gputopo.topology.bandwidth import build_model, ring_busbw_gbps
from gputopo.ui.doctor_markdown import to_markdown
from gputopo.ui.findings_view import COLUMNS, cells, findings_html, findings_markdown

# --- bandwidth: current width, maximum generation ---


def pcie_box(links: list[PcieLink]) -> Topology:
    """GPUs behind one PCIe switch each pair (PIX), with the given links."""
    n = len(links)
    gpus = tuple(Gpu(index=i, name="NVIDIA L40S", pcie=p) for i, p in enumerate(links))
    cells_ = tuple(tuple("X" if i == j else "PIX" for j in range(n)) for i in range(n))
    return Topology("test", gpus, (), Matrix(tuple(g.label for g in gpus), cells_))


def test_a_gpu_trained_at_x8_loses_to_its_x16_siblings() -> None:
    x16 = PcieLink(gen_current=4, gen_max=4, width_current=16, width_max=16)
    x8 = PcieLink(gen_current=4, gen_max=4, width_current=8, width_max=16)
    topo = pcie_box([x16, x16, x8])
    assert ring_busbw_gbps(topo, [0, 1]) == 24.0  # Gen4 x16
    assert ring_busbw_gbps(topo, [0, 2]) == 12.0  # Gen4 x8: half
    edge = build_model(topo).edge(0, 2)
    assert "Gen4 x8" in edge.why and "GPU2 trained at x8 of x16" in edge.why
    best = recommend(topo, Constraints(n=2)).best
    assert best.gpus == (0, 1)
    # The probe's expected busbw uses the same model.
    assert TopologyView(topo).expected_busbw_gbps((0, 2)) == (12.0, None)


def test_an_idle_gpu_at_a_lower_generation_counts_at_its_maximum() -> None:
    idle = PcieLink(gen_current=1, gen_max=4, width_current=16, width_max=16)
    busy = PcieLink(gen_current=4, gen_max=4, width_current=16, width_max=16)
    topo = pcie_box([idle, busy])
    assert ring_busbw_gbps(topo, [0, 1]) == 24.0


def test_a_link_without_a_current_width_counts_at_its_maximum() -> None:
    topo = pcie_box([PcieLink(gen_max=5, width_max=16), PcieLink(gen_max=5, width_max=16)])
    assert ring_busbw_gbps(topo, [0, 1]) == 48.0


# --- recommend's exclusions ---


def four_nvlink() -> Topology:
    gpus = tuple(Gpu(index=i, name="NVIDIA H100 80GB HBM3") for i in range(4))
    rows = tuple(tuple("X" if i == j else "NV18" for j in range(4)) for i in range(4))
    return Topology("test", gpus, (), Matrix(tuple(g.label for g in gpus), rows))


def test_unhealthy_gpus_are_left_out_with_the_reason_unless_allowed() -> None:
    topo = four_nvlink()
    sick = ((1, "a row remapping is pending on GPU1"), (2, "1 uncorrectable ECC errors on GPU2"))
    why = {e.gpu: e.why for e in exclusions(topo, Constraints(n=2, unhealthy=sick))}
    assert why == {
        1: "health: a row remapping is pending on GPU1",
        2: "health: 1 uncorrectable ECC errors on GPU2",
    }
    rec = recommend(topo, Constraints(n=2, unhealthy=sick))
    assert rec.best.gpus == (0, 3)
    allowed = recommend(topo, Constraints(n=4, unhealthy=sick, allow_unhealthy=True))
    assert allowed.best.gpus == (0, 1, 2, 3) and allowed.excluded == ()
    assert any("--allow-unhealthy" in w and "GPU1" in w for w in allowed.warnings)
    with pytest.raises(UsageError) as err:
        recommend(topo, Constraints(n=3, unhealthy=sick))
    assert "GPU1 health: a row remapping" in err.value.message
    assert "--allow-unhealthy" in (err.value.hint or "")


# --- one finding shape ---


def test_every_view_shows_the_same_columns_of_a_finding() -> None:
    f = Finding(
        "GPU3",
        "GPU3: NVLink CRC errors rose by 400 in 2.0 s",
        "reseat | reset",
        gpu=3,
        category="nvlink",
        action="reset",
    ).to_json()
    note = Finding("NCCL_IB_HCA", "prefix match", "write =mlx5_1", NOTE, category="config", action="config")
    assert set(f) == {"where", "gpu", "category", "what", "remedy", "severity", "action", "rule"}
    assert cells(f) == ["GPU3", "GPU3", "nvlink", f["what"], "reseat | reset", "problem", "reset"]
    md = findings_markdown([note.to_json(), f])
    assert md[0] == "| " + " | ".join(COLUMNS) + " |"
    assert md[2].startswith("| GPU3 | GPU3 | nvlink |")  # problems first
    assert "reseat \\| reset" in md[2]
    assert md[3] == "| NCCL_IB_HCA | - | config | prefix match | write =mlx5_1 | note | config |"
    page = findings_html([f])
    assert "".join(f"<th>{c}</th>" for c in COLUMNS) in page
    assert "<td>GPU3</td><td>GPU3</td><td>nvlink</td>" in page and '<td class="fail">problem</td>' in page


def test_a_report_without_a_health_section_still_renders() -> None:
    from gputopo.services.doctor import DoctorOptions, run_doctor
    from gputopo.ui.doctor_view import render_doctor
    from gputopo.ui.html_report import render_html

    doc = run_doctor(DoctorOptions(simulate=True, skip_probe=True))
    assert doc["health"]["checked"] is False
    assert doc["health"]["reason"] == "health: not checked (simulated)"
    assert "## Health\n\nhealth: not checked (simulated)" in to_markdown(doc)
    old = {k: v for k, v in doc.items() if k != "health"}  # a report from before health
    assert "## Health" not in to_markdown(old)
    render_doctor(old)
    pytest.importorskip("matplotlib")
    assert "<h2>Health</h2>" not in render_html(old) and "<h2>Health</h2>" in render_html(doc)


# --- the sick HGX node of the issue, through the fake driver ---

SWITCH = 2


def h100(i: int, extra: tuple[str, ...] = ()) -> list[str]:
    """A sound H100 SXM on NVSwitches (every health value), then ``extra`` lines (later lines win)."""
    return [
        f"gpu {i} {fake_driver.bus(i)} {fake_driver.uuid(i)} {i} NVIDIA H100 80GB HBM3",
        f"pcie {i} 5 5 16 16",
        f"ecc {i} 1 1",
        f"eccerr {i} 0 0 0 0",
        f"remap {i} 0 0 0 0",
        f"clocks {i} 1",
        f"temp {i} 34",
        f"power {i} 71000 700000",
        f"replay {i} 0",
        f"persist {i} 1",
        f"field {i} 230 0",
        f"fabric {i} 3 0 7 0",
        *(f"link {i} {k} 1 - {SWITCH}" for k in range(4)),
        *(f"nverr {i} {k} 0 0 0 0" for k in range(4)),
        *extra,
    ]


SICK = {
    0: ("remap 0 12 3 0 1",),  # a row remapping failed
    1: ("eccerr 1 0 1 0 1",),  # one volatile uncorrectable ECC error
    2: ("clocks 2 8", "temp 2 92"),  # hardware slowdown (held in both samples; one sample cannot tell)
    3: ("rise 3 nvl_crc_flit 400 0",),  # NVLink CRC errors climbing between the samples
    4: ("pcie 4 5 5 8 16",),  # trained at x8 of x16 (idle: a note; the model counts it at x8)
}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


@pytest.fixture(scope="module")
def sick_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = ["driver 570.86.15", "cuda 12080"]
    for i in range(8):
        lines += h100(i, SICK.get(i, ()))
    path = tmp_path_factory.mktemp("sick") / "machine.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_doctor_on_the_sick_node_says_problems_health_first_and_exits_1(
    driver: Path, sick_node: Path, tmp_path: Path
) -> None:
    args = ("doctor", "--skip-probe", "--sample-s", "0.5", "--report-dir", str(tmp_path))
    human = fake_driver.run(driver, sick_node, *args)
    assert human.returncode == 1, human.stderr
    out = human.stdout
    assert out.index("health: ") < out.index("Topology of")  # the health section comes first
    assert "row remapping failed on GPU0" in out
    doc = json.loads(fake_driver.run(driver, sick_node, *args, "--json").stdout)
    assert doc["verdict"] == "problems"
    health = doc["health"]
    assert health["checked"] is True and health["verdict"] == "problems"
    sick = {u["gpu"]: u["why"] for u in health["unhealthy"]}
    assert sorted(sick) == [0, 1, 2, 3]
    assert "row remapping failed" in sick[0]
    assert "uncorrectable ECC" in sick[1]
    assert "hardware slowdown" in sick[2]
    assert "NVLink CRC flit errors rose by" in sick[3]
    x8 = [f for f in health["findings"] if f["gpu"] == 4]
    assert [(f["category"], f["severity"]) for f in x8] == [("pcie", "note")]
    assert "x8 of x16" in x8[0]["what"]
    assert {"findings", "not_checked"} <= set(health)
    # Every finding has the one shape; the health ones lead the report's list.
    assert doc["findings"][: len(health["findings"])] == health["findings"]
    assert all(set(f) == set(COLUMNS) - {"GPU"} | {"gpu", "rule"} for f in doc["findings"])
    # Probes (and sets) only on healthy GPUs; the rest named with the reason.
    left = {e["gpu"]: e["why"] for e in doc["left_out"]}
    assert sorted(left) == [0, 1, 2, 3] and all(w.startswith("health: ") for w in left.values())
    for r in doc["recommendations"]:
        assert r["best"] is None or not set(r["best"]["gpus"]) & {0, 1, 2, 3}
    assert "health problems on GPU0, GPU1, GPU2, GPU3" in doc["headline"]
    md = Path(doc["report"]["markdown"]).read_text()
    assert md.index("## Health") < md.index("## Which GPUs to use")
    assert "| GPU1 | GPU1 | memory | 1 uncorrectable ECC errors on GPU1" in md


def test_recommend_and_run_leave_the_sick_gpus_out_with_reasons(driver: Path, sick_node: Path) -> None:
    rec = fake_driver.run(driver, sick_node, "recommend", "--n", "2", "--json")
    assert rec.returncode == 0, rec.stderr
    doc = json.loads(rec.stdout)
    why = {e["gpu"]: e["why"] for e in doc["excluded"]}
    # One live sample: the states are judged (GPU3's rising CRC and GPU2's clocks event bit need two
    # samples: `check`, `doctor`).
    assert sorted(why) == [0, 1]
    assert why[0] == "health: a row remapping failed on GPU0 (3 rows remapped for uncorrectable errors)"
    assert why[1].startswith("health: 1 uncorrectable ECC errors on GPU1")
    assert doc["health"]["checked"] is True and "one live NVML sample" in doc["health"]["source"]
    assert not set(doc["best"]["gpus"]) & {0, 1}
    text = fake_driver.run(driver, sick_node, "recommend", "--n", "2")
    assert "excluded: GPU0: health: a row remapping failed on GPU0" in text.stdout
    allowed = json.loads(
        fake_driver.run(driver, sick_node, "recommend", "--n", "8", "--allow-unhealthy", "--json").stdout
    )
    assert allowed["excluded"] == [] and allowed["best"]["gpus"] == list(range(8))
    assert any("--allow-unhealthy" in w for w in allowed["warnings"])
    too_many = fake_driver.run(driver, sick_node, "recommend", "--n", "8")
    assert too_many.returncode == 2 and "--allow-unhealthy" in too_many.stderr
    run = fake_driver.run(driver, sick_node, "run", "--n", "2", "--dry-run", "--json", "--", "python", "t.py")
    assert run.returncode == 0, run.stderr
    launch = json.loads(run.stdout)
    assert sorted(e["gpu"] for e in launch["excluded"]) == [0, 1]
    assert not set(launch["launch"]["gpus"]) & {0, 1}
    run_text = fake_driver.run(driver, sick_node, "run", "--n", "2", "--dry-run", "--", "python", "t.py")
    assert "left out GPU1: health: 1 uncorrectable ECC errors" in run_text.stderr


def test_recommend_on_an_input_file_reads_no_health(driver: Path, sick_node: Path) -> None:
    doc = json.loads(
        fake_driver.run(
            driver, sick_node, "recommend", "--n", "2", "--input", "sample:seed-8gpu-nv4", "--json"
        ).stdout
    )
    assert doc["health"]["checked"] is False and doc["excluded"] == []


def test_topo_marks_each_gpu_and_lists_health_findings_under_the_tables(
    driver: Path, sick_node: Path
) -> None:
    result = fake_driver.run(driver, sick_node, "topo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GPU   health   name" in out
    for i in (0, 1):
        assert f"GPU{i}  PROBLEM  NVIDIA H100" in out
    for i in (3, 4, 5):
        assert f"GPU{i}  ok       NVIDIA H100" in out
    assert out.index("Legend:") < out.index("Health (one live NVML sample")
    assert "row remapping failed on GPU0" in out
    bare = fake_driver.run(driver, sick_node, "topo", "--no-health").stdout
    assert "health" not in bare.split("Legend:")[1].split("\n\n")[1] and "Health (" not in bare
    # --input is not this machine: no health read, no column.
    saved = fake_driver.run(driver, sick_node, "topo", "--input", "sample:seed-8gpu-nv4").stdout
    assert "PROBLEM" not in saved and "Health (" not in saved


def test_a_busy_link_below_max_is_named_once_by_health_when_health_ran(driver: Path, tmp_path: Path) -> None:
    # The eight-GPU machine: GPU7 busy at Gen3 of Gen5 (both health's pcie_gen_busy and the topology's
    # busy-link finding see it); GPU1 idle at x8 of x16. GPU3 lost, GPU4 refused, GPU6 hung.
    path = tmp_path / "machine.txt"
    path.write_text(fake_driver.eight_gpu_machine())
    args = ("doctor", "--skip-probe", "--json", "--sample-s", "0", "--nvml-timeout", "2")
    result = fake_driver.run(driver, path, *args, "--report-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    pcie7 = [f for f in doc["findings"] if f["gpu"] == 7 and f["category"] == "pcie"]
    assert [f["what"] for f in pcie7] == ["GPU7: PCIe link at Gen3 of Gen5 while busy"]
    assert pcie7[0] in doc["health"]["findings"]
    assert [f["severity"] for f in doc["findings"] if f["gpu"] == 1] == ["note"]  # x8 of x16, idle
    # A GPU the topology could not read keeps the topology's finding only (one per GPU), and one refused
    # for permission stays a note: health lists it as not checked.
    assert len([f for f in doc["findings"] if f["gpu"] == 3]) == 1
    assert [f["severity"] for f in doc["findings"] if f["gpu"] == 4] == ["note"]
    assert any(n["what"] == "GPU4: every health value" for n in doc["health"]["not_checked"])


def test_without_health_the_topology_keeps_its_busy_link_finding() -> None:
    from gputopo.services.doctor import HealthStep, machine_findings

    busy = Gpu(
        index=0,
        utilization_pct=90,
        pcie=PcieLink(gen_current=3, gen_max=5, width_current=16, width_max=16),
    )
    topo = Topology("test", (busy,), (), Matrix(("GPU0",), (("X",),)))
    kept = machine_findings(topo, {}, HealthStep(False, None, "health: not checked (simulated)"))
    assert [f.category for f in kept] == ["pcie"]
    ran = HealthStep(True, "healthy", "health: healthy")
    assert machine_findings(topo, {}, ran) == []
