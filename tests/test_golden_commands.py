"""Every command's output on a fixed corpus, kept as golden files (issue 41, item 7: "nothing a user sees
changes").

Each case runs one command line and records what a user sees: the exit code, stdout and stderr, as
``tests/golden/commands/<case>.txt``. Text is recorded with colour off and a fixed width
(``conftest.plain_env``); a JSON document on stdout is re-indented (key order kept) so a diff shows the
one key that changed. What differs from run to run is replaced by a placeholder before comparing
(``normalise``): the corpus folder, ISO and compact timestamps, durations, ages, PIDs, this host's name
and gputopo's version.

The corpus: the built-in samples (``--input sample:NAME``), the in-process fake NVML's boards
(tests/fake_nvml.py), the fake C driver under the real nvidia-ml-py (tests/fake_driver.py, a subprocess:
marked slow), Inspector logs (tests/inspector_logs.py), Flight Recorder dumps (tests/hang_dumps.py, a torch
child: marked slow), node facts (tests/test_racks.py), saved ``nvidia-smi topo -m`` outputs in
../shared/fixtures/topo or ``GPUTOPO_FIXTURES=DIR`` (not run where absent) and bad inputs. docs/development.md
("Golden outputs of every command") says how to use it.

A golden file changes only in a commit that changes behaviour and says so; a commit that moves code leaves
them equal. To rewrite them after such a change (and drop the files of cases that are gone)::

    GPUTOPO_WRITE_GOLDEN=1 pytest tests/test_golden_commands.py

then read ``git diff tests/golden/commands`` line by line before committing.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fake_driver
from conftest import fixture_dir, invoke

GOLDEN_DIR = Path(__file__).parent / "golden" / "commands"
REPO = Path(__file__).resolve().parents[1]
COLUMNS = 120
SEED = "sample:seed-8gpu-nv4"
SAMPLES = (
    "seed-8gpu-nv4",
    "quad-nv4-pairs-2socket",
    "dgx1-v100",
    "hgx-h100-nvswitch",
    "pcie-8gpu-2socket",
    "workstation-2gpu-nvlink",
    "dgx2-v100-16gpu",
)
BOXES = ("nvlink_box", "nvswitch_box", "pcie_box", "lost_gpu_box", "no_driver")
DRAIN_BOARD = "drain_p2p_gpu3"


# What the recorded text depends on besides gputopo: the renderers (typer, click, rich), the NVML bindings
# (which reads exist), and torch (the Flight Recorder dumps' frames). The golden files hold the versions
# they were written with (VERSIONS.json); where another version is installed (the oldest-versions run of
# .ci/run, a fresh venv that pulled newer ones) the cases are skipped and say which, never failed.
RENDERERS = ("typer", "click", "rich", "nvidia-ml-py")
VERSIONS_FILE = GOLDEN_DIR / "VERSIONS.json"


def installed_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in (*RENDERERS, "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def version_mismatch(names: tuple[str, ...]) -> str | None:
    """Why the golden files cannot be compared here (another version of one of ``names``), or ``None``."""
    if write_mode() or not VERSIONS_FILE.exists():
        return None
    recorded = json.loads(VERSIONS_FILE.read_text())
    here = installed_versions()
    differ = [
        f"{n} {recorded.get(n)} recorded, {here.get(n)} here" for n in names if recorded.get(n) != here.get(n)
    ]
    return "golden files written with other versions: " + "; ".join(differ) if differ else None


def write_mode() -> bool:
    """``GPUTOPO_WRITE_GOLDEN=1`` (or conftest's ``GPUTOPO_UPDATE_GOLDEN=1``) rewrites the golden files."""
    return "1" in (os.environ.get("GPUTOPO_WRITE_GOLDEN"), os.environ.get("GPUTOPO_UPDATE_GOLDEN"))


# --- the cases ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One command line. ``{c}`` in an argument is the corpus folder. ``nvml``: a FakeNvml board
    installed around the in-process run; ``driver``: the fake C driver's machine (a subprocess);
    ``varies``: this case's own run-to-run differences (a race in the corpus, a measured time);
    ``needs``: a corpus part made on demand or maybe missing (``"fr:SCENARIO"``: Flight Recorder dumps
    of tests/helpers/fr_dumps.py's scenario, made by a torch child; ``"fixtures"``)."""

    name: str
    args: tuple[str, ...]
    nvml: str | None = None
    driver: str | None = None
    slow: bool = False
    needs: str | None = None
    env: tuple[tuple[str, str], ...] = field(default=())
    # Patterns of what this case's output says differently from run to run: group 1 becomes <VARIES>.
    varies: tuple[str, ...] = ()
    # Reads this host's own /dev/nvidia* (doctor's survey of GPU holders has no re-rooting): not run on a
    # host that has them, where the holders it lists are that host's.
    host_dev: bool = False
    # Command lines run first, on the same board (their output is not recorded): a state to read back.
    before: tuple[tuple[str, ...], ...] = ()
    # Globs ({c} the corpus) of files the command writes whose content a user sees: recorded after stdout.
    files: tuple[str, ...] = ()


def _both(name: str, *args: str, **kw) -> list[Case]:  # type: ignore[no-untyped-def]
    """The text case and its ``--json`` twin."""
    return [Case(name, args, **kw), Case(name + "--json", (*args, "--json"), **kw)]


def _cases() -> list[Case]:
    out: list[Case] = []
    # topo: every sample, every fake board, the saved outputs, bad input.
    out.append(Case("topo-list-samples", ("topo", "--list-samples")))
    for s in SAMPLES:
        out += _both(f"topo-{s}", "topo", "--input", f"sample:{s}")
    for box in BOXES:
        out += _both(f"topo-live-{box}", "topo", nvml=box)
    out.append(Case("topo-saved-json", ("topo", "--input", "{c}/topo/seed-8gpu-nv4.json")))
    out.append(Case("topo-stdin-missing-file", ("topo", "--input", "{c}/no-such-file.txt")))
    out.append(Case("topo-unknown-sample", ("topo", "--input", "sample:no-such-machine")))
    out.append(Case("topo-not-json", ("topo", "--input", "{c}/bad/not-json.json")))
    out.append(Case("topo-empty-file", ("topo", "--input", "{c}/bad/empty.txt")))
    out.append(Case("topo-truncated-snapshot", ("topo", "--input", "{c}/bad/truncated-topo.json")))
    # Saved `nvidia-smi topo -m` outputs of real machines (GPUTOPO_FIXTURES or ../shared/fixtures).
    for fixture in shared_topo_fixtures():
        saved = f"{{f}}/topo/{fixture}.txt"
        out += _both(f"{FIXTURE_PREFIX}{fixture.lower()}", "topo", "--input", saved, needs="fixtures")

    # recommend
    for s in ("seed-8gpu-nv4", "dgx1-v100", "pcie-8gpu-2socket", "hgx-h100-nvswitch"):
        out += _both(f"recommend-{s}-n2", "recommend", "-n", "2", "--input", f"sample:{s}")
    out += _both("recommend-seed-n2-sets4", "recommend", "-n", "2", "--sets", "4", "--input", SEED)
    out += _both("recommend-seed-n4-exclude", "recommend", "-n", "4", "--exclude", "0,1", "--input", SEED)
    out += _both(
        "recommend-seed-launch", "recommend", "-n", "4", "--input", SEED, "--launch", "train.py --lr 1"
    )
    out.append(
        Case("recommend-seed-uuid-unknown", ("recommend", "-n", "2", "--input", SEED, "--format", "uuid"))
    )
    out += _both("recommend-live-uuid", "recommend", "-n", "2", "--format", "uuid", nvml="nvswitch_box")
    for box in ("nvlink_box", "pcie_box", "lost_gpu_box"):
        out += _both(f"recommend-live-{box}", "recommend", "-n", "2", nvml=box)
    out.append(Case("recommend-too-many", ("recommend", "-n", "9", "--input", SEED)))
    out.append(Case("recommend-zero", ("recommend", "-n", "0", "--input", SEED)))
    out.append(Case("recommend-bad-exclude", ("recommend", "-n", "2", "--exclude", "x", "--input", SEED)))
    out.append(Case("recommend-no-driver", ("recommend", "-n", "2"), nvml="no_driver"))

    # run: only what prints without launching
    for json_flag in ((), ("--json",)):
        tail = "--json" if json_flag else ""
        dry = ("--input", SEED, "--dry-run", *json_flag)
        out.append(Case(f"run-seed-dry{tail}", ("run", "-n", "2", *dry, "--", "python", "train.py")))
        out.append(
            Case(f"run-seed-dry-torchrun{tail}", ("run", "-n", "4", "--torchrun", *dry, "--", "train.py"))
        )
    out.append(
        Case("run-live-dry", ("run", "-n", "2", "--dry-run", "--", "python", "x.py"), nvml="nvlink_box")
    )
    out.append(Case("run-no-command", ("run", "-n", "2", "--input", SEED, "--dry-run")))
    out.append(Case("run-too-many", ("run", "-n", "9", "--input", SEED, "--dry-run", "--", "true")))

    # probe: the plan only
    cpu = ("--device", "cpu", "--input", SEED, "--dry-run")
    out += _both("probe-plan-pair", "probe", "-g", "0,1", *cpu)
    out += _both("probe-plan-each-pair", "probe", "--each-pair", "-g", "0,1,2,3", *cpu)
    out += _both("probe-plan-allreduce", "probe", "-g", "0,1,2,3", "-m", "allreduce", *cpu)
    out.append(Case("probe-plan-all-modes", ("probe", "-g", "4,5", "-m", "all", *cpu)))
    out.append(Case("probe-plan-inject", ("probe", "-g", "0,1", "--inject", "nan", *cpu)))
    out.append(Case("probe-bad-gpus", ("probe", "-g", "0,99", *cpu)))
    out.append(Case("probe-bad-mode", ("probe", "-g", "0,1", "-m", "nope", *cpu)))

    # check: in process on the fake boards, and on the fake C driver
    fast = ("--sample-s", "0", "--kernel-log", "/dev/null")
    out.append(Case("check-list-rules", ("check", "--list-rules")))
    for box in ("nvlink_box", "nvswitch_box", "pcie_box", "lost_gpu_box", "no_driver"):
        out += _both(f"check-live-{box}", "check", *fast, nvml=box)
    for fmt in ("nagios", "prometheus", "npd"):
        out.append(Case(f"check-pcie-box-{fmt}", ("check", *fast, "--format", fmt), nvml="pcie_box"))
    out.append(
        Case(
            "check-bad-thresholds", ("check", *fast, "--thresholds", "{c}/bad/not-json.json"), nvml="pcie_box"
        )
    )
    # The check state's life cycle (--state: load, remember, save) and a baseline saved then compared:
    # the second run reads what the first wrote; the files are recorded too.
    state = (*fast, "--state", "{c}/state/pcie.json")
    out.append(
        Case(
            "check-state-second-run",
            ("check", *state),
            nvml="pcie_box",
            before=(("check", *state),),
            files=("{c}/state/pcie.json",),
        )
    )
    save = (*fast, "--save-baseline", "{c}/baseline/nvswitch.json")
    out.append(
        Case(
            "check-save-baseline",
            ("check", *save),
            nvml="nvswitch_box",
            files=("{c}/baseline/nvswitch.json",),
        )
    )
    out += _both(
        "check-baseline-same-board",
        "check",
        *fast,
        "--baseline",
        "{c}/baseline/same.json",
        nvml="nvswitch_box",
        before=(("check", *fast, "--save-baseline", "{c}/baseline/same.json"),),
    )
    out.append(
        Case(
            "check-baseline-not-json",
            ("check", *fast, "--baseline", "{c}/bad/not-json.json"),
            nvml="pcie_box",
        )
    )
    out.append(
        Case("check-bad-since", ("check", "--since", "soon", "--kernel-log", "/dev/null"), nvml="pcie_box")
    )
    out.append(Case("check-bad-format", ("check", *fast, "--format", "yaml"), nvml="pcie_box"))
    for machine in ("healthy2", "eight"):
        # eight: GPU6 hangs, and the time its read was given is what the budget had left.
        out += _both(
            f"check-driver-{machine}",
            "check",
            "--sample-s",
            "0.2",
            "--kernel-log",
            "/dev/null",
            driver=machine,
            slow=True,
            varies=(r"within (\d+(?:\.\d+)?) s",),
        )
    out += _both("topo-driver-eight", "topo", driver="eight", slow=True)

    # doctor: without probes (the cheap part), and the report command on its report
    out.append(
        Case(
            "doctor-seed-skip-probe",
            ("doctor", "--input", SEED, "--skip-probe", "--report-dir", "{c}/reports/d1"),
            host_dev=True,
            files=("{c}/reports/d1/*.md",),
        )
    )
    out.append(
        Case(
            "doctor-seed-skip-probe--json",
            ("doctor", "--input", SEED, "--skip-probe", "--report-dir", "{c}/reports/d2", "--json"),
            host_dev=True,
        )
    )
    out.append(
        Case(
            "doctor-live-pcie-skip-probe",
            ("doctor", "--skip-probe", "--report-dir", "{c}/reports/d3", "--no-html"),
            nvml="pcie_box",
            host_dev=True,
        )
    )
    out += _both("report-doctor", "report", "{c}/doctor.json", host_dev=True)
    out.append(Case("report-not-a-report", ("report", "{c}/bad/not-json.json")))
    out.append(
        Case(
            "doctor-bad-input",
            ("doctor", "--input", "{c}/bad/empty.txt", "--skip-probe", "--report-dir", "{c}/reports/d4"),
        )
    )

    # slow: Inspector logs, and bad input
    out += _both("slow-inspector-late-rank", "slow", "{c}/slow/late")
    out += _both("slow-inspector-even", "slow", "{c}/slow/even")
    out.append(Case("slow-not-a-job", ("slow", "{c}/bad")))
    out.append(Case("slow-missing", ("slow", "{c}/no-such-folder")))

    # hang: Flight Recorder dumps from a torch child (slow), and the cases that need none
    for scenario in ("never", "op", "ok"):
        # How far each gloo rank got in completing its entries before the dump is a race.
        racy = (r'"completed": (-?\d+)', r"pg_status \(enqueued/started/completed\): ([^\n]*)")
        out += _both(
            f"hang-fr-{scenario}",
            "hang",
            f"{{c}}/fr/{scenario}",
            needs=f"fr:{scenario}",
            slow=True,
            varies=racy,
        )
    out += _both("hang-ras-json", "hang", "--ras-json", "{c}/ras.json")
    out.append(Case("hang-nothing", ("hang",)))
    out.append(Case("hang-empty-folder", ("hang", "{c}/empty")))
    out.append(Case("hang-bad-ras-json", ("hang", "--ras-json", "{c}/bad/not-json.json")))

    # nodes: two racks of facts, a block topology, bad facts
    out += _both("nodes-two-racks", "nodes", "{c}/facts")
    out += _both("nodes-pick-16", "nodes", "{c}/facts", "--nodes", "16", "--segment", "8")
    out.append(Case("nodes-slurm-topology", ("nodes", "{c}/facts", "--slurm-topology")))
    out.append(Case("nodes-cannot-fit", ("nodes", "{c}/facts", "--nodes", "40", "--segment", "8")))
    out += _both("nodes-audit", "nodes", "{c}/facts17", "--audit", "{c}/topology.conf")
    out.append(Case("nodes-facts-naming-no-node", ("nodes", "{c}/topo")))
    out.append(Case("nodes-not-json", ("nodes", "{c}/bad/not-json.json")))
    out.append(Case("nodes-none", ("nodes",)))

    # kill-stale: the dry-run listing on device files nobody holds
    # PATH without lsof: the holders are read from the clean procfs tree on every machine alike.
    no_lsof = (("PATH", "/nonexistent"),)
    out += _both(
        "kill-stale-nothing-held", "kill-stale", "--device-files", "{c}/devices/nvidia*", env=no_lsof
    )
    out.append(Case("kill-stale-no-files", ("kill-stale", "--device-files", "{c}/no-devices/nvidia*")))
    out.append(Case("kill-stale-bad-age", ("kill-stale", "--older-than", "soon")))

    # The drain-P2P rule, wherever it applies today (cli/probe.py, cli/options.py, doctor.py): GPU3's
    # driver asks to keep P2P work off it.
    drain = {"nvml": DRAIN_BOARD}
    out += _both("drain-recommend-n2", "recommend", "-n", "2", **drain)
    out.append(Case("drain-recommend-n4", ("recommend", "-n", "4"), **drain))
    out.append(Case("drain-run-n3-dry", ("run", "-n", "3", "--dry-run", "--", "python", "x.py"), **drain))
    out.append(
        Case("drain-run-n3-dry--json", ("run", "-n", "3", "--dry-run", "--json", "--", "x.py"), **drain)
    )
    out += _both("drain-probe-each-pair-plan", "probe", "--each-pair", "--dry-run", **drain)
    out.append(Case("drain-probe-named-set-plan", ("probe", "-g", "0,1,2,3", "--dry-run"), **drain))
    out += _both("drain-check", "check", *fast, **drain)
    out.append(Case("drain-topo", ("topo",), **drain))
    out.append(
        Case(
            "drain-doctor-skip-probe",
            ("doctor", "--skip-probe", "--report-dir", "{c}/reports/d5", "--no-html"),
            host_dev=True,
            **drain,
        )
    )

    # the program itself
    out.append(Case("help", ("--help",)))
    out.append(Case("unknown-command", ("frobnicate",)))
    return out


FIXTURE_PREFIX = "topo-fixture-"


def shared_fixtures() -> Path | None:
    """The shared fixtures folder: ``GPUTOPO_FIXTURES``, else ../shared/fixtures beside the repository
    (conftest's), else ``None`` (a fresh clone: those cases are not run, and their files not stale)."""
    named = os.environ.get("GPUTOPO_FIXTURES")
    return Path(named) if named else fixture_dir()


def shared_topo_fixtures() -> list[str]:
    folder = shared_fixtures()
    if folder is None or not (folder / "topo").is_dir():
        return []
    return sorted(p.stem for p in (folder / "topo").glob("*.txt"))


CASES = _cases()


# --- the corpus -----------------------------------------------------------------------------------------


def build_corpus(root: Path) -> None:
    """Write the inputs the cases read under ``root`` (everything but the slow parts)."""
    from inspector_logs import job_lines, write_job
    from test_hang_cli import RAS_JSON
    from test_racks import three_blocks_of_17, two_racks

    (root / "bad").mkdir()
    (root / "bad" / "not-json.json").write_text("this is not json {\n")
    (root / "bad" / "empty.txt").write_text("")
    (root / "empty").mkdir()
    (root / "devices").mkdir()
    (root / "dev").mkdir()
    for minor in range(2):  # device files no process holds
        (root / "devices" / f"nvidia{minor}").write_text("")
    (root / "topo").mkdir()
    for s in SAMPLES:
        result = invoke("topo", "--input", f"sample:{s}", "--json", columns=COLUMNS)
        assert result.exit_code == 0, result.output
        (root / "topo" / f"{s}.json").write_text(result.stdout)
    seed = (root / "topo" / "seed-8gpu-nv4.json").read_text()
    (root / "bad" / "truncated-topo.json").write_text(seed[: len(seed) // 2])
    write_job(root / "slow" / "late", job_lines(8, 60, late_rank=5, late_frac=0.3, hosts=2))
    write_job(root / "slow" / "even", job_lines(8, 60, hosts=2))
    (root / "ras.json").write_text(RAS_JSON)
    two_racks(root / "facts")
    three_blocks_of_17(root / "facts17")
    done = invoke("doctor", "--input", SEED, "--skip-probe", "--report-dir", str(root / "reports" / "src"))
    assert done.exit_code == 0, done.output
    (report,) = (root / "reports" / "src").glob("doctor-*.json")
    shutil.copy(report, root / "doctor.json")


@pytest.fixture(scope="module")
def corpus() -> Iterator[Path]:
    # mkdtemp's name has a fixed length, so a path wrapped by the renderer wraps the same on every run.
    root = Path(tempfile.mkdtemp(prefix="gtgold-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        build_corpus(root)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def driver_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def driver_machine(name: str) -> str:
    from test_health_reads import healthy

    if name == "healthy2":
        return "\n".join(["driver 570.86.15", "cuda 12080", *healthy(0), *healthy(1)]) + "\n"
    if name == "eight":
        return fake_driver.eight_gpu_machine()
    raise KeyError(name)


def board(name: str):  # type: ignore[no-untyped-def]
    """A FakeNvml board by name: one of FakeNvml's own (``BOXES``), or one built here (``DRAIN_BOARD``:
    the NVSwitch box with health answered and GPU3's driver asking to drain P2P, the rule issue 41 moves
    into one machine step)."""
    from fake_nvml import FakeNvml

    if name == DRAIN_BOARD:
        fake = FakeNvml.nvswitch_box(health=True)
        fake.gpus[3].health.fields[230] = 3  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: DRAIN_P2P
        return fake
    return getattr(FakeNvml, name)()


# --- running and normalising ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    exit_code: int
    stdout: str
    stderr: str
    files: tuple[tuple[str, str], ...] = ()  # (path, content) of the case's ``files``


def run_case(case: Case, corpus: Path, request: pytest.FixtureRequest) -> Seen:
    folder = shared_fixtures()
    args = [a.replace("{c}", str(corpus)).replace("{f}", str(folder)) for a in case.args]
    # The driver's device files (check's "is a GPU here" read) from an empty folder, not this host's /dev.
    env = {"GPUTOPO_DEV_ROOT": str(corpus / "dev"), **dict(case.env)}
    if case.driver is not None:
        lib = request.getfixturevalue("driver_dir")
        machine = corpus / f"machine-{case.driver}.txt"
        machine.write_text(driver_machine(case.driver))
        done = fake_driver.run(lib, machine, *args, timeout=120, extra_env={"COLUMNS": str(COLUMNS), **env})
        return Seen(done.returncode, done.stdout, done.stderr)
    with contextlib.ExitStack() as stack:
        if case.nvml is not None:
            stack.enter_context(board(case.nvml).installed())
        for line in case.before:
            first = invoke(*(a.replace("{c}", str(corpus)) for a in line), columns=COLUMNS, env=env)
            assert first.exception is None or isinstance(first.exception, SystemExit), first.output
        result = invoke(*args, columns=COLUMNS, env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback is never golden
    written = tuple(
        (path, Path(path).read_text())
        for pattern in case.files
        for path in sorted(glob.glob(pattern.replace("{c}", str(corpus))))
    )
    return Seen(result.exit_code, result.stdout, result.stderr, written)


def _version() -> str:
    from gputopo import __version__

    return __version__


# (pattern, placeholder), applied in order to the whole recorded text.
_RULES: list[tuple[re.Pattern[str], str]] = [
    # ISO 8601 (2026-12-06T06:07:51Z, with fraction or offset) and the compact form of report names.
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<TIME>"),
    (re.compile(r"\d{8}T\d{6}Z"), "<TIME>"),
    # Epoch seconds as JSON numbers under a time-like key ("at": 1796...).
    (
        re.compile(
            r'("(?:at|time|started|ended|[a-z_]*_at|[a-z_]*_unix(?:_s)?|[a-z_]*timestamp[a-z_]*)"): '
            r"\d{9,}(?:\.\d+)?"
        ),
        r"\1: <TIME>",
    ),
    # Durations a run takes: JSON keys and words.
    (
        re.compile(r'("(?:[a-z_]*_)?(?:duration|elapsed|took|wall|runtime)(?:_[a-z]+)?"): [0-9.e+-]+'),
        r"\1: <DUR>",
    ),
    # Prometheus gauges of the run's own time.
    (re.compile(r"^(gputopo_\w*(?:duration|timestamp)\w*(?:\{[^}]*\})?) \S+$", re.M), r"\1 <DUR>"),
    (re.compile(r"\b(?:in|took|after) \d+(?:\.\d+)? ?(?:ms|s)\b"), "<DUR>"),
    (re.compile(r"\b\d+(?:\.\d+)? ?s ago\b"), "<AGE> ago"),
]


def normalise(text: str, corpus: Path) -> str:
    """``text`` with what differs between runs replaced by placeholders."""
    text = text.replace(str(corpus), "<CORPUS>")
    # An installed package's frame (torch), wherever the environment is: CI's .venv is inside the clone.
    text = re.sub(
        r"\(/[^()\s]*/(?:site|dist)-packages/(?:[^()\s]*/)?([\w.-]+\.py):\d+\)", r"(<LIB>/\1:<LINE>)", text
    )
    text = text.replace(str(REPO), "<REPO>")
    # A stack frame outside the repository (torch, the standard library): its file's folder and line
    # change with the installed versions.
    text = re.sub(r"\((?!<REPO>)/[^()\s]*/([\w.-]+\.py):\d+\)", r"(<LIB>/\1:<LINE>)", text)
    folder = shared_fixtures()
    if folder is not None:
        text = text.replace(str(folder), "<FIXTURES>")
    text = text.replace(_version(), "<VERSION>")
    host = socket.gethostname()
    text = text.replace(json.dumps(host), '"<HOST>"')  # "node": "vm", whatever the name's length
    if len(host) > 3:  # a short name ("vm") as a bare word would hit ordinary words
        text = re.sub(rf"\b{re.escape(host)}\b", "<HOST>", text)
    text = re.sub(rf"\b{os.getpid()}\b", "<PID>", text)
    for pattern, placeholder in _RULES:
        text = pattern.sub(placeholder, text)
    return text


def _document(text: str) -> str:
    """``text`` with a JSON document re-indented (key order kept), and ending in a newline."""
    if text.lstrip().startswith(("{", "[")):
        with contextlib.suppress(ValueError):
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False) + "\n"
    return text if text.endswith("\n") or not text else text + "\n"


def record(case: Case, seen: Seen, corpus: Path) -> str:
    """The golden file's text: the command lines run before, the command line, the exit code, stdout
    (JSON re-indented), stderr, then each file the case names."""
    body = "".join(f"(before) $ gputopo {' '.join(line)}\n" for line in case.before)
    body += (
        f"$ gputopo {' '.join(case.args)}\n"
        f"exit {seen.exit_code}\n"
        f"--- stdout\n{_document(seen.stdout)}"
        f"--- stderr\n{seen.stderr}"
    )
    for path, content in seen.files:
        body += f"{'' if body.endswith(chr(10)) else chr(10)}--- file {path}\n{_document(content)}"
    for pattern in case.varies:
        body = re.sub(pattern, lambda m: m.group(0).replace(m.group(1), "<VARIES>"), body)
    return normalise(body, corpus)


def _params() -> list[object]:
    out = []
    for case in CASES:
        marks = [pytest.mark.slow] if case.slow else []
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_command_output_matches_its_golden_file(
    case: Case, corpus: Path, request: pytest.FixtureRequest
) -> None:
    if case.needs is not None and case.needs.startswith("fr:"):
        from hang_dumps import copy_dumps, real_dumps

        scenario = case.needs.partition(":")[2]
        target = corpus / "fr" / scenario
        if not target.exists():
            copy_dumps(real_dumps(scenario, corpus / "fr-made"), target)
        if not any(target.iterdir()):
            # fr_dumps.py gives its ranks 60 s: on a machine too loaded for that, no rank dumps.
            pytest.skip(f"the {scenario} scenario's ranks wrote no dump in time")
    why = version_mismatch(RENDERERS + (("torch",) if case.needs and case.needs.startswith("fr:") else ()))
    if why:
        pytest.skip(why)
    if case.host_dev and glob.glob("/dev/nvidia*"):
        pytest.skip("doctor lists the holders of this host's own /dev/nvidia* files")
    if case.needs == "fixtures" and shared_fixtures() is None:
        pytest.skip("../shared/fixtures is absent")
    text = record(case, run_case(case, corpus, request), corpus)
    path = GOLDEN_DIR / f"{case.name}.txt"
    if write_mode():
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        VERSIONS_FILE.write_text(json.dumps(installed_versions(), indent=2) + "\n")
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; write it with GPUTOPO_WRITE_GOLDEN=1")
    assert text == path.read_text(), (
        f"`gputopo {' '.join(case.args)}` differs from {path}: if the change is meant, rewrite with "
        "GPUTOPO_WRITE_GOLDEN=1 in a commit that says the behaviour changed"
    )


def test_every_golden_file_has_its_case() -> None:
    """A golden file without a case is a command line no one runs any more; write mode removes it."""
    names = {case.name for case in CASES}
    absent = shared_fixtures() is None  # those cases are not made here: their files are not stale
    stale = sorted(
        p.name
        for p in GOLDEN_DIR.glob("*.txt")
        if p.stem not in names and not (absent and p.stem.startswith(FIXTURE_PREFIX))
    )
    if write_mode():
        for name in stale:
            (GOLDEN_DIR / name).unlink()
        return
    assert stale == []


def test_case_names_are_unique_and_safe() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", n) for n in names), names


def test_normalise_replaces_what_changes_between_runs(tmp_path: Path) -> None:
    text = (
        f"report: {tmp_path}/doctor-20261206T060751Z.json at 2026-12-06T06:07:51.123+00:00\n"
        '"at": 1796536071.5, "duration_s": 12.5, "sample_s": 0.2\n'
        f"gputopo {_version()} took 3.2 s; checked 12s ago\n"
        f"at f ({REPO}/tests/x.py:12) g (/usr/lib/python3.11/site-packages/torch/a.py:3781)\n"
        f"h ({REPO}/.venv/lib/python3.11/site-packages/torch/distributed/b.py:83)\n"
    )
    assert normalise(text, tmp_path) == (
        "report: <CORPUS>/doctor-<TIME>.json at <TIME>\n"
        '"at": <TIME>, "duration_s": <DUR>, "sample_s": 0.2\n'
        "gputopo <VERSION> <DUR>; checked <AGE> ago\n"
        "at f (<REPO>/tests/x.py:12) g (<LIB>/a.py:<LINE>)\n"
        "h (<LIB>/b.py:<LINE>)\n"
    )


def test_the_golden_files_name_the_versions_they_were_written_with(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(json.loads(VERSIONS_FILE.read_text())) == {*RENDERERS, "torch"}
    monkeypatch.delenv("GPUTOPO_WRITE_GOLDEN", raising=False)
    monkeypatch.delenv("GPUTOPO_UPDATE_GOLDEN", raising=False)
    recorded = json.loads(VERSIONS_FILE.read_text())
    monkeypatch.setattr(sys.modules[__name__], "installed_versions", lambda: {**recorded, "rich": "0.0.1"})
    assert version_mismatch(RENDERERS) == (
        f"golden files written with other versions: rich {recorded['rich']} recorded, 0.0.1 here"
    )
    assert version_mismatch(("torch",)) is None
