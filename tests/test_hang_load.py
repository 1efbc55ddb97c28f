"""Loading Flight Recorder dumps safely: the restricted unpickler, size caps, truncated and corrupt dumps,
and the bad inputs of issue 24 (no dumps, mixed versions, a pickle with a class, a 2 GB file)."""

from __future__ import annotations

import copyreg
import json
import os
import pickle
import pickletools
import sys
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.errors import InputError
from gputopo.hang.load import (
    NothingToAnalyse,
    UnsafeDumpError,
    find_dump_files,
    load_dumps,
    load_one,
    safe_loads,
)
from hang_dumps import PREFIX, copy_dumps, real_dumps


@pytest.fixture(scope="module")
def never(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_dumps("never", tmp_path_factory.mktemp("fr"))


class _TouchOnLoad:
    """Unpickling this runs ``os.system('touch MARKER')``: what a hostile "dump" would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile(marker: Path, protocol: int) -> bytes:
    return pickle.dumps({"version": "2.10", "entries": [_TouchOnLoad(marker)]}, protocol=protocol)


def test_real_dumps_hold_only_plain_data(never: Path) -> None:
    """What the restricted unpickler rests on: torch's own dumps use no opcode that imports or builds."""
    data = (never / f"{PREFIX}0").read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"}
    assert safe_loads(data, never / f"{PREFIX}0") == pickle.loads(data)


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_pickle_that_runs_a_command_is_refused_and_nothing_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / f"{PREFIX}0"
    bad.write_bytes(_hostile(marker, protocol))
    # The same bytes through plain pickle would run it (proves the test's pickle is live) ...
    probe = tmp_path / "probe-ran"
    pickle.loads(_hostile(probe, protocol))
    assert probe.exists()
    # ... through gputopo, refused, naming the file, and the command never ran.
    with pytest.raises(UnsafeDumpError) as err:
        load_one(0, bad)
    message = err.value.message
    assert str(bad) in message and ("posix.system" in message or "os.system" in message)
    assert not marker.exists()


def test_the_cli_refuses_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / f"{PREFIX}0").write_bytes(_hostile(marker, 4))
    result = invoke("hang", str(tmp_path))
    assert result.exit_code == 2
    assert not marker.exists()
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and f"{PREFIX}0" in lines[0] and "refused" in lines[0]
    assert "Traceback" not in result.output


def test_extension_codes_are_refused_too(tmp_path: Path) -> None:
    """EXT1 opcodes name a global through copyreg's registry; the unpickler must not resolve it."""
    copyreg.add_extension(os.system.__module__, "system", 0xF0)
    try:
        data = pickle.dumps(os.system, protocol=2)
        assert b"\x82\xf0" in data  # EXT1 0xF0, not a GLOBAL
        with pytest.raises(UnsafeDumpError):
            safe_loads(data, tmp_path / "x")
    finally:
        copyreg.remove_extension(os.system.__module__, "system", 0xF0)


def test_a_truncated_dump_is_named_and_skipped_and_the_rest_analysed(never: Path, tmp_path: Path) -> None:
    folder = copy_dumps(never, tmp_path / "d")
    whole = (folder / f"{PREFIX}1").read_bytes()
    (folder / f"{PREFIX}1").write_bytes(whole[: len(whole) // 2])
    loaded = load_dumps([folder])
    assert [d.rank for d in loaded.dumps] == [0, 2]
    assert [(s.rank, s.why.split()[0]) for s in loaded.skipped] == [(1, "truncated")]
    result = invoke("hang", str(folder), "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verdict"] == "hang"
    assert doc["skipped_dumps"][0]["rank"] == 1 and doc["missing_dumps"] == [1]
    suspects = {s["rank"]: s["why"] for s in doc["groups"][0]["suspects"]}
    assert suspects == {1: "no_dump", 2: "never_entered"}


def test_corrupt_empty_and_foreign_files_are_skipped(never: Path, tmp_path: Path) -> None:
    folder = copy_dumps(never, tmp_path / "d")
    (folder / f"{PREFIX}0").write_bytes(b"\x80\x04\x95garbage that is not a pickle")
    (folder / f"{PREFIX}1").write_bytes(b"")
    (folder / f"{PREFIX}3.json").write_text(json.dumps({"hello": "world"}))
    loaded = load_dumps([folder])
    assert [d.rank for d in loaded.dumps] == [2]
    whys = {s.rank: s.why for s in loaded.skipped}
    assert "pickle" in whys[0] and "empty" in whys[1] and "not a Flight Recorder dump" in whys[3]


def test_a_2_gb_file_is_not_read(never: Path, tmp_path: Path) -> None:
    folder = copy_dumps(never, tmp_path / "d")
    with open(folder / f"{PREFIX}2", "wb") as f:
        f.truncate(2 * 1024**3)  # sparse: 2 GiB by size, no disk used
    loaded = load_dumps([folder])
    assert [s.rank for s in loaded.skipped] == [2] and "cap" in loaded.skipped[0].why


def test_no_dumps_is_exit_3_and_says_how_to_get_them(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("nothing here")
    result = invoke("hang", str(tmp_path))
    assert result.exit_code == 3
    assert "no Flight Recorder dumps" in result.output and "TORCH_FR_BUFFER_SIZE" in result.output
    with pytest.raises(NothingToAnalyse):
        load_dumps([tmp_path])


def test_dumps_of_different_versions_are_bad_input(never: Path, tmp_path: Path) -> None:
    folder = copy_dumps(never, tmp_path / "d")
    doc = pickle.loads((folder / f"{PREFIX}2").read_bytes())
    doc["version"] = "2.9"
    (folder / f"{PREFIX}2").write_bytes(pickle.dumps(doc))
    result = invoke("hang", str(folder))
    assert result.exit_code == 2 and "different Flight Recorder versions" in result.output


def test_a_prefix_selects_its_files_and_json_is_preferred(never: Path, tmp_path: Path) -> None:
    folder = copy_dumps(never, tmp_path / "d")
    copy_dumps(never, folder, json_dumps=True)  # rank_trace0.json ... beside rank_trace0 ...
    (folder / "other_trace0").write_bytes(b"")
    assert sorted(r for r, _ in find_dump_files(folder / PREFIX)) == [0, 0, 1, 1, 2, 2]
    loaded = load_dumps([folder / PREFIX])
    assert {d.format for d in loaded.dumps} == {"json"} and len(loaded.dumps) == 3
    assert any("read the JSON one" in n for n in loaded.notes)


def test_a_missing_path_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InputError):
        find_dump_files(tmp_path / "nope" / "trace_")
    result = invoke("hang", str(tmp_path / "nope" / "trace_"))
    assert result.exit_code == 2


def test_importing_the_hang_package_does_not_import_torch() -> None:
    code = (
        "import sys, gputopo.services.hang, gputopo.ui.hang_view, gputopo.cli.hang; "
        "print('torch' in sys.modules)"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_dump_cut_anywhere_is_loaded_or_skipped_never_a_crash(never: Path, tmp_path: Path) -> None:
    """A rank killed while dumping leaves a file cut at any byte; each cut is read or named and skipped."""
    for name in (f"{PREFIX}0", f"json/{PREFIX}0.json"):
        whole = (never / name).read_bytes()
        target = tmp_path / Path(name).name
        for cut in sorted({*range(0, len(whole), max(1, len(whole) // 97)), len(whole) - 1}):
            target.write_bytes(whole[:cut])
            result = load_one(0, target)
            assert hasattr(result, "why") or result.entries, cut
