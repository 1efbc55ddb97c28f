"""What a script relies on: exit codes, warnings wherever a topology is read, unwrapped piped text,
progress lines in logs, stdin and UTF-16 input, one GPU-list rule, merged and kept-apart sets."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from rich.text import Text

from conftest import fixture_dir, invoke
from gputopo.cli import run_main
from gputopo.errors import UsageError
from gputopo.gpulist import parse_gpu_list
from gputopo.topology import samples
from gputopo.topology.parse_smi import parse_topo_text

SEED = "sample:seed-8gpu-nv4"


def fixtures() -> list[Path]:
    """Every captured ``nvidia-smi topo -m`` text that parses (the error fixtures are for other tests)."""
    root = fixture_dir()
    if root is None:
        return []
    out = []
    for path in sorted((root / "topo").glob("*.txt")):
        try:
            parse_topo_text(path.read_text(encoding="utf-8"))
        except Exception:
            continue
        out.append(path)
    return out


def piped(*args: str, stdin: str | bytes | None = None):
    """The CLI as a pipe sees it: stdout is not a terminal and COLUMNS is unset."""
    from typer.testing import CliRunner

    from gputopo.cli import app

    env = {"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": None}
    return CliRunner().invoke(app, list(args), env=env, input=stdin)


def matrix_of(doc: dict) -> tuple:
    return doc["matrix"]["labels"], doc["matrix"]["cells"], [(n["label"], n["name"]) for n in doc["nics"]]


# --- pipe-safe text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", fixtures(), ids=lambda p: p.name[:40])
def test_piped_topo_output_reads_back_to_the_same_matrix(path, tmp_path):
    """`gputopo topo --input FILE > s.txt; gputopo topo --input s.txt`: same matrix, same NIC names,
    however wide the machine (the 17-NIC box was folded at 160 columns before)."""
    shown = piped("topo", "--input", str(path))
    assert shown.exit_code == 0, shown.output
    saved = tmp_path / "s.txt"
    saved.write_text(shown.stdout)
    direct = json.loads(piped("topo", "--input", str(path), "--json").stdout)
    again = piped("topo", "--input", str(saved), "--json")
    assert again.exit_code == 0, again.stderr
    assert matrix_of(json.loads(again.stdout)) == matrix_of(direct)


def test_piped_text_is_never_folded_and_comment_lines_keep_their_hash():
    from gputopo.ui.output import Output

    out = Output()
    buf = io.StringIO()
    out.out = Console(file=buf, width=100_000, highlight=False, no_color=True)
    out.unwrapped = True
    comment = "# " + " ".join(f"field{i}" for i in range(80))
    out.show(Text(comment), Text("short"))
    assert buf.getvalue().splitlines() == [comment, "short"]


def test_plain_progress_lines_when_stderr_is_not_a_terminal():
    """A log gets one line when a set starts and one per finished check, not silence."""
    from gputopo.probe.plan.schedule import Job
    from gputopo.ui.probe_view import ProbeProgress

    job = Job(gpus=(0, 1), checks=("dp", "allreduce"))

    class _Plan:
        jobs = (job,)

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with ProbeProgress(console, _Plan()) as bars:  # type: ignore[arg-type]
        for row in (
            {"rank": 1, "check": "setup", "stage": "join"},
            {"rank": 0, "check": "setup", "stage": "join"},
            {"rank": 0, "check": "dp", "stage": "step", "done": 1, "total": 2},
            {"rank": 0, "check": "dp", "stage": "done"},
            {"rank": 0, "check": "allreduce", "stage": "size", "done": 1, "total": 4},
            {"rank": 0, "check": "allreduce", "stage": "done"},
        ):
            bars.update(job, row)
    lines = [line.split(" [")[0] for line in buf.getvalue().splitlines()]
    assert lines == ["set 0,1: starting ranks", "set 0,1: dp done", "set 0,1: allreduce done (set done)"]


# --- stdin and UTF-16 ------------------------------------------------------------------------------------


def test_input_dash_reads_stdin():
    text = samples.load("seed-8gpu-nv4")
    from gputopo.topology import snapshot

    direct = json.loads(piped("topo", "--input", SEED, "--json").stdout)
    shown = piped("topo", "--input", SEED).stdout
    from_stdin = piped("topo", "--input", "-", "--json", stdin=shown)
    assert from_stdin.exit_code == 0, from_stdin.output
    assert matrix_of(json.loads(from_stdin.stdout))[:2] == matrix_of(direct)[:2]
    snap = piped("topo", "--input", "-", "--json", stdin=snapshot.dumps(text))
    assert json.loads(snap.stdout)["source"] == "stdin"
    rec = piped("recommend", "--n", "2", "--input", "-", stdin=shown)
    assert rec.exit_code == 0 and rec.stdout.rstrip().endswith("CUDA_VISIBLE_DEVICES=0,1")


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-8-sig"])
def test_utf16_with_a_bom_is_decoded(codec, tmp_path):
    """PowerShell's `nvidia-smi topo -m > out.txt` writes UTF-16 with a byte-order mark."""
    shown = piped("topo", "--input", SEED).stdout
    data = shown.encode(codec)
    if codec == "utf-16-be":
        data = b"\xfe\xff" + data
    path = tmp_path / "ps.txt"
    path.write_bytes(data)
    direct = json.loads(piped("topo", "--input", SEED, "--json").stdout)
    for args, stdin in ((["--input", str(path)], None), (["--input", "-"], data)):
        got = piped("topo", *args, "--json", stdin=stdin)
        assert got.exit_code == 0, got.output
        assert matrix_of(json.loads(got.stdout))[:2] == matrix_of(direct)[:2]


# --- exit codes ------------------------------------------------------------------------------------------


def _no_driver(monkeypatch):
    from fake_nvml import FakeNvml

    monkeypatch.setenv("PATH", "/nonexistent")
    return FakeNvml.no_driver().installed()


def test_doctor_without_a_driver_shows_the_simulation_but_exits_3(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    with _no_driver(monkeypatch):
        code = run_main(["doctor", "--skip-probe"])
        captured = capsys.readouterr()
        assert code == 3
        assert "SIMULATED" in captured.out and "Which GPUs to use" in captured.out
        last = captured.err.strip().splitlines()
        assert last[-2].startswith("error: no NVIDIA driver") and "not checked" in last[-2]
        assert "--simulate" in last[-1]
        assert run_main(["doctor", "--skip-probe", "--json"]) == 3
        assert json.loads(capsys.readouterr().out)["simulated"] is True
        # Asked for, the simulation exits by its verdict.
        assert run_main(["doctor", "--skip-probe", "--simulate"]) == 0
        assert run_main(["doctor", "--skip-probe", "--input", "sample:quad-nv4-pairs-2socket"]) == 0
    assert len(list((tmp_path / "reports").glob("doctor-*.json"))) == 4


def test_doctor_simulate_on_a_machine_with_gpus_uses_the_sample(tmp_path):
    from fake_nvml import FakeNvml
    from gputopo.services.doctor import DoctorOptions, run_doctor

    with FakeNvml.pcie_box().installed():
        doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path, simulate=True))
    assert doc["simulated"] is True and doc["topology"]["source"] == "sample:quad-nv4-pairs-2socket"


# --- warnings wherever a topology is read ------------------------------------------------------------------


def _seed_fixture() -> Path:
    root = fixture_dir()
    if root is None:
        pytest.skip("shared fixtures not found")
    return next((root / "topo").glob("00_*.txt"))


def test_recommend_json_carries_the_topology_warnings():
    """The seed's own paste: topo prints three warnings; recommend's JSON and stderr carry the same."""
    path = str(_seed_fixture())
    topo = json.loads(invoke("topo", "--input", path, "--json").stdout)
    assert len(topo["warnings"]) == 3
    rec = invoke("recommend", "--n", "2", "--input", path, "--json")
    assert json.loads(rec.stdout)["warnings"][:3] == topo["warnings"]
    for w in topo["warnings"]:
        assert w in rec.stderr.replace("\n", " ")


def test_doctor_carries_the_warnings_into_every_report(tmp_path):
    from gputopo.services.doctor import DoctorOptions, run_doctor
    from gputopo.ui.doctor_markdown import to_markdown
    from gputopo.ui.doctor_view import render_doctor
    from gputopo.ui.html_report import render_html

    root = fixture_dir()
    if root is None:
        pytest.skip("shared fixtures not found")
    truncated = next((root / "topo").glob("50_*.txt"))
    doc = run_doctor(DoctorOptions(input=str(truncated), skip_probe=True, report_dir=tmp_path))
    assert doc["warnings"] and doc["warnings"] == doc["topology"]["warnings"]
    assert f"{len(doc['warnings'])} warning(s) about the input" in doc["headline"]
    md = to_markdown(doc)
    page = render_html(doc)
    console = Console(file=io.StringIO(), width=300, no_color=True)
    console.print(render_doctor(doc))
    view = console.file.getvalue()  # type: ignore[attr-defined]
    for w in doc["warnings"]:
        assert w in md and w.replace("'", "&#x27;") in page and w in view.replace("\n", "")
    result = invoke(
        "doctor", "--input", str(truncated), "--skip-probe", "--json", "--report-dir", str(tmp_path)
    )
    assert json.loads(result.stdout)["warnings"] == doc["warnings"]
    assert doc["warnings"][0] in result.stderr.replace("\n", " ")


# --- reports carry the topology ----------------------------------------------------------------------------


def test_reports_carry_the_link_matrix_gpu_table_and_nic_legend(tmp_path):
    from gputopo.services.doctor import DoctorOptions, run_doctor
    from gputopo.ui.doctor_markdown import to_markdown
    from gputopo.ui.doctor_view import render_doctor
    from gputopo.ui.html_report import render_html

    doc = run_doctor(DoctorOptions(input="sample:hgx-h100-nvswitch", skip_probe=True, report_dir=tmp_path))
    topo = samples.load("hgx-h100-nvswitch")
    md = to_markdown(doc)
    block = md.split("## Topology\n\n```text\n")[1].split("```")[0]
    # The Markdown's matrix is `gputopo topo` text: it reads back to the same matrix and NIC names.
    back = parse_topo_text(block)
    assert back.matrix == topo.matrix and [n.name for n in back.nics] == [n.name for n in topo.nics]
    assert topo.gpus[0].pci_bus_id in block and "CPU affinity" in block and "NIC Legend:" in block
    page = render_html(doc)
    pre = page.split('<pre class="topo">')[1].split("</pre>")[0]
    assert "NV18" in pre and "color: #008000" in pre  # NVLink cells green, as in the terminal
    assert topo.gpus[0].pci_bus_id in pre and "NIC0: " in pre
    console = Console(file=io.StringIO(), width=300, no_color=True)
    console.print(render_doctor(doc))
    view = console.file.getvalue()  # type: ignore[attr-defined]
    assert topo.gpus[7].pci_bus_id in view and "NIC Legend:" in view and " NV18 " in view


# --- one GPU-list rule ---


def test_gpu_list_rule():
    assert parse_gpu_list("5,6") == (5, 6)
    assert parse_gpu_list(" 6 , 5 ") == (6, 5)
    assert parse_gpu_list("GPU5,gpu6") == (5, 6)
    assert parse_gpu_list("0-3") == (0, 1, 2, 3)
    assert parse_gpu_list("GPU0-GPU2,7") == (0, 1, 2, 7)
    for bad, why in (
        ("", "empty"),
        ("5,,6", "empty item"),
        ("a", "'a' is not a GPU index"),
        ("-1", "'-1'"),
        ("3-1", "runs backwards"),
        ("5;6", "'5;6'"),
        ("5 6", "'5 6'"),
        ("5,5", "GPU5 is listed twice"),
        ("0-3,2", "GPU2 is listed twice"),
        ("0-99999", "beyond any machine"),
    ):
        with pytest.raises(UsageError, match=why) as info:
            parse_gpu_list(bad, "--exclude")
        assert info.value.message.startswith("--exclude")


@pytest.mark.parametrize(
    "args",
    [
        ["recommend", "--n", "2", "--input", SEED, "--exclude", "{}"],
        ["probe", "--device", "cpu", "--gpus", "{}"],
        ["kill-stale", "--gpus", "{}"],
    ],
    ids=["recommend", "probe", "kill-stale"],
)
def test_every_command_applies_the_same_gpu_list_rule(args, capsys):
    for text, ok in (("GPU1-GPU1", True), ("1,1", False), ("x", False)):
        code = run_main(
            [a.format(text) for a in args] + (["--mode", "bogus"] if ok and "probe" in args else [])
        )
        err = capsys.readouterr().err
        if ok:
            assert "is not a GPU index" not in err and "listed twice" not in err, err
        else:
            assert code == 2 and ("listed twice" in err or "'x' is not a GPU index" in err), err


# --- recommend: merged rows, kept-apart pairs ---


def test_top_says_when_equivalent_sets_were_merged():
    """4-GPU sample, --top 5: only three distinct pairs exist; the output says why, row by row."""
    result = invoke(
        "recommend", "--n", "2", "--input", "sample:quad-nv4-pairs-2socket", "--top", "5", "--json"
    )
    doc = json.loads(result.stdout)
    assert len(doc["candidates"]) < 5
    assert sum(c["equivalent_sets"] for c in doc["candidates"]) == 6  # every pair of 4 GPUs, once
    assert doc["merged_note"].startswith("--top 5 shows ")
    human = invoke(
        "recommend", "--n", "2", "--input", "sample:quad-nv4-pairs-2socket", "--top", "5", columns=300
    )
    assert "rows merge equivalent sets" in human.stdout


def test_kept_apart_lists_each_pair_once_with_every_reason(tmp_path):
    failing = [
        {"name": n, "verdict": "fail", "kind": k}
        for n, k in (("p2p", "corrupt"), ("dp", "nan"), ("ddp", "nan"))
    ]
    report = {"schema": "gputopo/probe/v1", "device": "cuda", "sets": [{"gpus": [0, 1], "checks": failing}]}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(report))
    doc = json.loads(
        invoke("recommend", "--n", "2", "--input", SEED, "--from-report", str(path), "--json").stdout
    )
    assert [k["gpus"] for k in doc["kept_apart"]] == [[0, 1]]
    why = doc["kept_apart"][0]["why"]
    assert "p2p check failed (corrupt)" in why and "dp check failed (nan)" in why and "ddp check" in why
    human = invoke("recommend", "--n", "2", "--input", SEED, "--from-report", str(path), columns=400)
    assert human.stdout.count("kept apart: GPU0 + GPU1") == 1


def test_nccl_topology_xml_reads_from_stdin_and_as_utf16(tmp_path):
    root = fixture_dir()
    if root is None:
        pytest.skip("shared fixtures not found")
    path = next((root / "nccl-topo").glob("*.xml"))
    direct = json.loads(piped("topo", "--input", str(path), "--json").stdout)
    from_stdin = piped("topo", "--input", "-", "--json", stdin=path.read_bytes())
    assert from_stdin.exit_code == 0, from_stdin.output
    assert matrix_of(json.loads(from_stdin.stdout)) == matrix_of(direct)
    wide = tmp_path / "dump.xml"
    wide.write_bytes(path.read_text(encoding="utf-8").encode("utf-16"))
    assert matrix_of(json.loads(piped("topo", "--input", str(wide), "--json").stdout)) == matrix_of(direct)


def test_probe_with_input_carries_its_warnings(tmp_path):
    """probe --input reads a topology for its estimate: its warnings reach stderr, the JSON and the report."""
    pytest.importorskip("torch")
    path = str(_seed_fixture())
    topo = json.loads(invoke("topo", "--input", path, "--json").stdout)
    result = invoke(
        "probe", "--device", "cpu", "--gpus", "0,1", "--mode", "allreduce", "--model", "tiny",
        "--input", path, "--report-dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["warnings"] == topo["warnings"]
    assert topo["warnings"][0] in result.stderr.replace("\n", " ")
    assert topo["warnings"][0] in Path(doc["report"]["markdown"]).read_text()


def test_bus_ids_are_printed_as_written_never_as_emoji(capsys):
    """rich turns ``:ab:`` into an emoji by default; a bus id like ``0000:ab:00.0`` must survive."""
    from gputopo.ui.output import Output

    out = Output()
    out.warn("GPU at 0000:ab:00.0 runs below its link")
    out.show("GPU0  00000000:ab:00.0")
    captured = capsys.readouterr()
    assert "0000:ab:00.0" in captured.err
    assert "00000000:ab:00.0" in captured.out
