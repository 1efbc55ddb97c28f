"""The layout stays as ARCHITECTURE.md draws it: no import circle between modules, no probe file over
500 lines, and, where import-linter is installed, every contract in pyproject.toml kept.

The circle check reads the sources with ``ast`` (every import, lazy ones inside functions included), so
it needs neither torch nor import-linter and runs in the oldest-versions environment too.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gputopo"
MAX_PROBE_FILE_LINES = 500


def module_names() -> dict[str, Path]:
    """Every module of gputopo by dotted name (a package by its own name, for its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` (a module, or a module's attribute) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the gputopo modules it imports, anywhere in its body."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name`` the module.
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target.startswith("gputopo"):
                    resolved = _resolve(target, modules)
                    if resolved is not None and resolved != name:
                        found.add(resolved)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_no_module_imports_itself_back_through_a_circle():
    graph = import_graph()
    assert graph["gputopo.probe.ranks.worker"]  # the graph holds the lazy imports too
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_circle_finder_finds_a_planted_circle():
    graph = import_graph()
    graph["gputopo.topology.bandwidth"] = graph["gputopo.topology.bandwidth"] | {"gputopo.recommend.search"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"gputopo.topology.bandwidth", "gputopo.recommend.search"} <= set(cycle)


def test_no_probe_file_is_over_500_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in (PACKAGE / "probe").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_PROBE_FILE_LINES
    }
    assert long == {}


def test_only_probe_ranks_imports_torch_and_only_system_nvml_imports_pynvml():
    found = []
    for name, path in module_names().items():
        # hang/torch_check: torch's Flight Recorder analyzer, lazily, on `gputopo hang --torch-check` only.
        if name.startswith("gputopo.probe.ranks") or name == "gputopo.hang.torch_check":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(n.split(".")[0] in ("torch", "torchvision", "pynvml") for n in names):
                found.append((name, names))
    # pynvml has its own seam: system/nvml.py.
    assert [(n, i) for n, i in found if n != "gputopo.system.nvml"] == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_linter_contracts_are_kept():
    done = subprocess.run(
        [shutil.which("lint-imports") or "lint-imports", "--no-cache"],
        cwd=SRC.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(SRC), "PATH": str(Path(sys.executable).parent)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
