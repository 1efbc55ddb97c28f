"""The repository holds source, not build products: no file git tracks is binary, outside the fixture
folders named here (a committed wheel, archive, shared library or bytecode fails this test).

"Binary" is what git itself calls binary for a diff: a NUL byte in the first 8000 bytes (git's
``buffer_is_binary`` in xdiff-interface.c looks at ``FIRST_FEW_BYTES`` = 8000), read the same way.
Archives and compiled files are refused by their suffix too, whatever their first bytes hold.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_BYTES = 8000  # git's FIRST_FEW_BYTES
# Folders whose files may be binary (blobs a test reads as they are). None holds one today: the PCI
# config blobs tests/test_netpath.py reads are written by tests/sysfs_tree.py at test time, not committed.
BINARY_FIXTURES: tuple[str, ...] = ()
BUILD_SUFFIXES = (".whl", ".zip", ".tar", ".gz", ".tgz", ".xz", ".bz2", ".egg", ".so", ".pyc", ".pyo", ".o")


def is_binary(path: Path) -> bool:
    """Whether ``path`` is a build product or binary data: an archive or compiled suffix, or a NUL byte in
    its first 8000 bytes (UTF-8 text, UTF-8 with a BOM and an empty file are text)."""
    if path.name.lower().endswith(BUILD_SUFFIXES):
        return True
    with path.open("rb") as f:
        return b"\0" in f.read(FIRST_BYTES)


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or a copy): nothing tracked to look at")
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
    ).stdout
    return [name for name in out.decode("utf-8", "surrogateescape").split("\0") if name]


def test_no_binary_file_is_tracked_outside_the_fixtures() -> None:
    names = tracked_files()
    assert names, "git ls-files listed nothing"
    binary = [
        name
        for name in names
        if not name.startswith(BINARY_FIXTURES) and (ROOT / name).is_file() and is_binary(ROOT / name)
    ]
    assert not binary, f"binary files tracked by git (the repository holds only source): {binary}"


@pytest.mark.parametrize(
    ("name", "data", "binary"),
    [
        ("notes.md", "GPU0 NV4 — ok\n".encode(), False),
        ("bom.txt", b"\xef\xbb\xbfhello\n", False),
        ("empty.py", b"", False),
        ("blob.dat", b"PK\x03\x04\x00\x00rest", True),
        ("late-nul.txt", b"a" * (FIRST_BYTES - 1) + b"\0", True),
        ("after-the-window.txt", b"a" * FIRST_BYTES + b"\0", False),
        ("prometheus_client-0.26.0-py3-none-any.whl", b"looks like text", True),
        ("mod.cpython-312.pyc", b"text", True),
    ],
)
def test_what_counts_as_binary(tmp_path: Path, name: str, data: bytes, binary: bool) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    assert is_binary(path) is binary
