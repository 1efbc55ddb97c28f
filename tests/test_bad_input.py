"""Every command, fed what users get wrong: one plain line and a hint, exit 2 (or 3), never a traceback.

Each row runs the real entry point (``gputopo.cli.run_main``, what the installed script calls), so typer's
own option errors are held to the same rule as gputopo's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gputopo.cli import run_main

# Words that mean Python leaked into a message meant for a person.
PYTHON_WORDS = re.compile(
    r"Traceback|internal error|NoneType|object has no attribute|'str' object|'dict' object|\bis None\b|"
    r"\b(?:Key|Type|Value|Attribute|Index|UnicodeDecode|FileNotFound|IsADirectory|Permission|OS)Error\b|"
    r"\[Errno|\bschema None\b|codec can't|valid (?:int|float)\b"
)

SEED = "sample:seed-8gpu-nv4"
DOCTOR_DOC = {"schema": "gputopo/doctor/v1"}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Bad files of every kind a user has at hand."""
    made = {
        "binary": bytes(range(256)) * 4,
        "empty": b"",
        "text": b"hello, this is not what you think\n",
        "not_json": b"{ not json",
        "list_json": b"[1, 2, 3]",
        "string_json": b'"just a string"',
        "other_schema": json.dumps({"schema": "other/v9"}).encode(),
        "no_schema": json.dumps({"gpus": []}).encode(),
        "topo_no_fields": json.dumps({"schema": "gputopo/topology/v1"}).encode(),
        "topo_wrong_types": json.dumps(
            {"schema": "gputopo/topology/v1", "gpus": "x", "matrix": {"labels": [], "cells": []}}
        ).encode(),
        "probe_str_sets": json.dumps({"schema": "gputopo/probe/v1", "sets": "x"}).encode(),
        "probe_bad_set": json.dumps({"schema": "gputopo/probe/v1", "sets": ["x"]}).encode(),
        "doctor_empty": json.dumps(DOCTOR_DOC).encode(),
        "doctor_str_topology": json.dumps({**DOCTOR_DOC, "topology": "x", "findings": []}).encode(),
        "doctor_str_findings": json.dumps({**DOCTOR_DOC, "topology": {}, "findings": "x"}).encode(),
        "blocker": b"",
    }
    out = {}
    for name, data in made.items():
        path = tmp_path / name
        path.write_bytes(data)
        out[name] = str(path)
    out["missing"] = str(tmp_path / "no-such-file")
    out["dir"] = str(tmp_path)
    out["under_file"] = str(tmp_path / "blocker" / "sub")
    out["no_nvidia_files"] = str(tmp_path / "nvidia*")
    out["missing_dir_html"] = str(tmp_path / "no-such-dir" / "x.html")
    return out


# (command line with {name} standing for a file above, exit code)
CASES = [
    # the root
    ("--bogus", 2),
    ("nosuchcommand", 2),
    # topo
    ("topo --input {missing}", 2),
    ("topo --input {dir}", 2),
    ("topo --input {binary}", 2),
    ("topo --input {empty}", 2),
    ("topo --input {text}", 2),
    ("topo --input {not_json}", 2),
    ("topo --input {list_json}", 2),
    ("topo --input {other_schema}", 2),
    ("topo --input {no_schema}", 2),
    ("topo --input {topo_no_fields}", 2),
    ("topo --input {topo_wrong_types}", 2),
    ("topo --input sample:nope", 2),
    ("topo --input", 2),
    ("topo --bogus", 2),
    ("topo extra", 2),
    # recommend
    (f"recommend --input {SEED}", 2),
    (f"recommend --n x --input {SEED}", 2),
    (f"recommend --n 0 --input {SEED}", 2),
    (f"recommend --n 9 --input {SEED}", 2),
    (f"recommend --n 2 --input {SEED} --exclude a", 2),
    (f"recommend --n 2 --input {SEED} --exclude 3,,4", 2),
    (f"recommend --n 2 --input {SEED} --exclude 99", 2),
    (f"recommend --n 2 --input {SEED} --top 0", 2),
    (f"recommend --n 2 --input {SEED} --sets 0", 2),
    (f"recommend --n 2 --input {SEED} --sets 5", 2),
    (f"recommend --n 2 --input {SEED} --format bogus", 2),
    (f"recommend --n 2 --input {SEED} --format uuid", 2),
    (f"recommend --n 2 --input {SEED} --pcie-gen 9", 2),
    (f"recommend --n 2 --input {SEED} --nvlink-gbps -1", 2),
    (f"recommend --n 2 --input {SEED} --max-used-mib -5", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{missing}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{dir}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{binary}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{not_json}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{string_json}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{no_schema}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{probe_str_sets}}", 2),
    (f"recommend --n 2 --input {SEED} --from-report {{probe_bad_set}}", 2),
    ("recommend --n 2 --input {binary}", 2),
    (f"recommend --n 2 --input {SEED} --nvlink-gbps fast", 2),
    # probe (options are checked before torch starts anything)
    ("probe --device cpu --gpus a", 2),
    ("probe --device cpu --gpus 0,0", 2),
    ("probe --device cpu --gpus 0,99", 2),
    ("probe --device cpu", 2),
    ("probe --device cpu --gpus 0,1 --model resnet99", 2),
    ("probe --device cpu --gpus 0,1 --mode bogus", 2),
    ("probe --device cpu --gpus 0,1 --steps 0", 2),
    ("probe --device cpu --gpus 0,1 --timeout 0", 2),
    ("probe --device cpu --gpus 0,1 --inject-rank 1", 2),
    ("probe --device cpu --gpus 0,1 --report-dir {under_file}", 2),
    ("probe --device gpu --gpus 0,1", 2),
    # probe across nodes (checked before torch or any rendezvous starts)
    ("probe --device cpu --gpus 0 --rdzv-endpoint localhost:29400", 2),
    ("probe --device cpu --gpus 0 --mode ddp --inject slow", 2),  # slow: the per-GPU check's drill
    ("probe --device cpu --gpus 0,1 --mode gpu --tolerance 150", 2),
    ("probe --device cpu --gpus 0 --nnodes 0", 2),
    ("probe --device cpu --gpus 0 --nnodes 2", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 2 --rdzv-endpoint h:1", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h:99999", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint :29400", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint [::1", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h --rdzv-timeout 0", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h --inject nan", 2),
    ("probe --device cpu -g 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h --inject hang --inject-node 2", 2),
    ("probe --device cpu -g 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h --inject slow --inject-rank 0", 2),
    ("probe --device cpu --gpus 0 --gpus 1 --nnodes 2 --node-rank 0 --rdzv-endpoint h", 2),
    ("probe --device cpu --gpus 0,1 --each-pair --nnodes 2 --node-rank 0 --rdzv-endpoint h", 2),
    ("probe --device cpu --gpus 0 --nnodes 2 --node-rank 0 --rdzv-endpoint h --dry-run", 2),
    # kill-stale
    ("kill-stale --grace -1", 2),
    ("kill-stale --older-than soon", 2),
    ("kill-stale --gpus x", 2),
    ("kill-stale --device-files /etc/passwd", 2),
    ("kill-stale --device-files {no_nvidia_files}", 2),
    # doctor
    ("doctor --model resnet99 --skip-probe", 2),
    ("doctor --steps 0 --simulate", 2),
    ("doctor --timeout 0 --simulate", 2),
    ("doctor --input {missing} --skip-probe", 2),
    ("doctor --input {binary} --skip-probe", 2),
    ("doctor --input sample:dgx2-v100-16gpu", 2),
    ("doctor --simulate --skip-probe --report-dir {under_file}", 2),
    ("doctor --simulate --inject slow", 2),
    ("doctor --simulate --nnodes 2 --node-rank 0 --rdzv-endpoint h --inject corrupt --inject-gpus 0,1", 2),
    ("doctor --simulate --nnodes 2 --node-rank 5 --rdzv-endpoint h", 2),
    # run (checked before anything is started)
    (f"run --n 2 --input {SEED} --exclude x -- true", 2),
    (f"run --n 2 --input {SEED} --json -- true", 2),
    (f"run --n 9 --input {SEED} --dry-run -- true", 2),
    (f"run --n 2 --input {SEED} --dry-run", 2),
    ("run --n 2 --input {binary} --dry-run -- true", 2),
    # report
    ("report", 2),
    ("report {missing}", 2),
    ("report {dir}", 2),
    ("report {binary}", 2),
    ("report {not_json}", 2),
    ("report {list_json}", 2),
    ("report {other_schema}", 2),
    ("report {no_schema}", 2),
    ("report {doctor_empty}", 2),
    ("report {doctor_str_topology}", 2),
    ("report {doctor_str_findings}", 2),
]


@pytest.mark.parametrize(("line", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_plain_line_and_a_hint(line, code, files, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)  # a doctor that got this far would write its report here
    args = [part.format(**files) for part in line.split()]
    got = run_main(args)
    captured = capsys.readouterr()
    err = captured.err
    assert got == code, f"{line}: exit {got}\nstdout: {captured.out[-800:]}\nstderr: {err[-800:]}"
    lines = err.strip("\n").splitlines()
    if line == "report" or args[0] == "nosuchcommand":
        assert lines[0].startswith("error:"), err
    else:
        assert len(lines) == 2, f"{line}: expected an error and a hint, got:\n{err}"
        assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert not PYTHON_WORDS.search(err), f"{line}: Python leaks into the message:\n{err}"
    assert "Usage:" not in err


def test_report_html_to_a_missing_folder_or_a_folder_is_refused(files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_main(["doctor", "--simulate", "--skip-probe", "--json"]) == 0
    saved = next((tmp_path / "reports").glob("doctor-*.json"))
    capsys.readouterr()
    for target, needle in ((files["missing_dir_html"], "does not exist"), (files["dir"], "is a folder")):
        assert run_main(["report", str(saved), "--html", target]) == 2
        err = capsys.readouterr().err
        assert needle in err and not PYTHON_WORDS.search(err), err


def test_option_errors_take_one_line_not_four(capsys):
    assert run_main(["recommend", "--n", "two"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: gputopo recommend: Invalid value for '--n' / '-n': 'two' is not a whole number",
        "hint: `gputopo recommend --help` lists the options, with examples",
    ]


@pytest.mark.parametrize("command", ["topo", "recommend", "run", "probe", "kill-stale", "doctor", "report"])
def test_every_command_takes_dash_h_and_shows_examples(command, capsys):
    assert run_main([command, "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: gputopo {command}")
    assert "Examples:" in out and f"gputopo {command}" in out.split("Examples:")[1]
