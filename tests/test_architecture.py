"""The layout stays as ARCHITECTURE.md draws it: no import circle between modules, no probe file over
500 lines, and, where import-linter is installed, every contract in pyproject.toml kept.

The circle check reads the sources with ``ast`` (every import, lazy ones inside functions included), so
it needs neither torch nor import-linter and runs in the oldest-versions environment too.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
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
        # launch/worker_main: run by path in a rank's Python by `gputopo run`, torch's control plane.
        if name.startswith("gputopo.probe.ranks") or name in (
            "gputopo.hang.torch_check",
            "gputopo.launch.worker_main",
        ):
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
    # pynvml has its own seam: system/nvml/backend.py (the one module of the NVML door that loads it).
    assert [(n, i) for n, i in found if n != "gputopo.system.nvml.backend"] == []


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


# --- One door to NVML -----------------------------------------------------------------------------------
#
# Every NVML read goes through the ``system/nvml/`` package (``Session.query`` and the typed ``NvmlBackend``):
# no module outside it names an NVML function (in code: comments and prose may cite one) or reaches into the
# private state of NVML's session, device or event set.

NVML_PACKAGE = PACKAGE / "system" / "nvml"
NVML_MODULES = sorted(NVML_PACKAGE.glob("*.py"))
_NVML_FUNCTION = re.compile(r"nvml[A-Z]\w+")


def nvml_functions_named(source: str, names: bool = True) -> list[tuple[int, str]]:
    """(line, name) of every NVML function a module names in code: an identifier, or a string that is
    nothing but the name (``getattr(lib, "nvmlDeviceGetEccMode")``). Comments and docstrings do not count."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if names and tok.type == tokenize.NAME and _NVML_FUNCTION.fullmatch(tok.string):
            found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and _NVML_FUNCTION.fullmatch(value):
                found.append((tok.start[0], value))
    return found


def nvml_private_names() -> set[str]:
    """The private attributes and methods of system/nvml/'s classes (``_lib``, ``_errors``, ...)."""
    names = set()
    for node in (n for path in NVML_MODULES for n in ast.walk(ast.parse(path.read_text()))):
        if isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.FunctionDef)
                    and sub.name.startswith("_")
                    and not sub.name.startswith("__")
                ):
                    names.add(sub.name)
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and sub.attr.startswith("_")
                    and not sub.attr.startswith("__")
                ):
                    names.add(sub.attr)
    return names


def private_reaches(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, attribute) where a module touches another object's ``private`` attribute (not ``self._x``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Attribute) and node.attr in private and not own:
            found.append((node.lineno, node.attr))
    return found


def test_only_system_nvml_names_an_nvml_function_or_its_session_state():
    private = nvml_private_names()
    assert {"_lib", "_errors", "_call"} <= private  # the finder sees the session's insides
    found = {}
    for name, path in module_names().items():
        if path.parent == NVML_PACKAGE:
            continue
        source = path.read_text()
        hits = [
            f"{line}: {what}"
            for line, what in nvml_functions_named(source) + private_reaches(source, private)
        ]
        if hits:
            found[name] = hits
    assert found == {}, "NVML is read only through system/nvml/ (Session.query, Device's reads): " + repr(
        found
    )


def test_the_nvml_door_check_catches_a_planted_call():
    planted = 'fn = getattr(session._lib, "nvmlDeviceGetEccMode")\nvalue = lib.nvmlDeviceGetPowerUsage(h)\n'
    assert [n for _, n in nvml_functions_named(planted)] == [
        "nvmlDeviceGetEccMode",
        "nvmlDeviceGetPowerUsage",
    ]
    assert private_reaches(planted, nvml_private_names()) == [(1, "_lib")]
    # Prose is not a call: a comment or docstring may cite the function it is about.
    assert nvml_functions_named('"""Reads nvmlDeviceGetEccMode."""\nx = 1  # nvmlDeviceGetEccMode\n') == []


def test_nvml_calls_only_the_typed_backend_and_the_fake_implements_all_of_it():
    """Every function system/nvml/ calls is declared in ``NvmlBackend``, and tests/fake_nvml.py's
    ``FakeNvml`` implements every one of them, so the Python fake covers every read gputopo makes."""
    from fake_nvml import FakeNvml
    from gputopo.system.nvml import NvmlBackend

    declared = {n for n in vars(NvmlBackend) if _NVML_FUNCTION.fullmatch(n)}
    # The strings system/nvml/ passes as a function's name (prefixes and constants of pynvml aside).
    not_functions = {"nvmlDeviceGet", "nvmlSystemGet", "nvmlMemory_v2", "nvmlEventTypeXidCriticalError"}
    called = {
        name for path in NVML_MODULES for _, name in nvml_functions_named(path.read_text(), names=False)
    } - not_functions
    assert len(called) > 40
    assert called - declared == set(), "called through the door but not in NvmlBackend"
    assert {n for n in declared if not hasattr(FakeNvml, n)} == set(), "NvmlBackend functions FakeNvml lacks"


# --- The drawing's numbers ----------------------------------------------------------------------------


def floors() -> list[list[str]]:
    """The floors of pyproject's first layers contract, top down, each a list of module prefixes."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: gputopo depends on tomli there
        import tomli as tomllib
    doc = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    layers = doc["tool"]["importlinter"]["contracts"][0]["layers"]
    return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in layers]


def floor_of(module: str, prefixes: list[list[str]]) -> int | None:
    """The floor (0 = top) of the longest prefix that holds ``module``; ``None`` when no floor does."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(prefixes):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return best[0] if best is not None else None


def arrows_back_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that point up: to a higher floor, or between two sibling rooms that import each other
    (the back half of a circle between rooms, which ``acyclic_siblings`` would need an exception for)."""
    layers = floors()
    up = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = floor_of(src, layers), floor_of(dst, layers)
            if a is not None and b is not None and b < a:
                up.append((src, dst))
    # Rooms: gputopo's direct subpackages and modules; a pair of rooms importing each other is a circle.
    room = {m: ".".join(m.split(".")[:2]) for m in graph}
    between: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for src, targets in graph.items():
        for dst in targets:
            if room[src] != room.get(dst, room[src]):
                between.setdefault((room[src], room[dst]), []).append((src, dst))
    # A room stands on the highest floor of its modules (procs/ on the services floor, by procs.survey).
    room_floor: dict[str, int] = {}
    for m, r in room.items():
        f = floor_of(m, layers)
        if f is not None:
            room_floor[r] = min(f, room_floor.get(r, f))
    for (a, b), edges in between.items():
        lower = a in room_floor and b in room_floor and room_floor[a] > room_floor[b]
        if (b, a) in between and lower:  # the edge from the lower room to the higher one points back up
            up += edges
    return sorted(set(up))


def test_the_drawing_has_no_arrow_back_up_and_no_circle(capsys):
    graph = import_graph()
    packages = sorted(n for n, p in module_names().items() if p.name == "__init__.py")
    up = arrows_back_up(graph)
    cycle = find_cycle(graph)
    with capsys.disabled():
        print(
            f"\ndrawing: {len(packages)} packages, {len(module_names())} modules, {len(floors())} floors, "
            f"{len(up)} arrows back up, {0 if cycle is None else 1} circles"
        )
    assert up == [], up
    assert cycle is None


def test_the_arrow_finder_finds_a_planted_arrow_back_up():
    graph = import_graph()
    graph["gputopo.system.lsof"] = graph["gputopo.system.lsof"] | {"gputopo.procs.survey"}  # to a service
    assert ("gputopo.system.lsof", "gputopo.procs.survey") in arrows_back_up(graph)
    graph = import_graph()
    # The old arrow: system/ down into a pure module of procs/, whose service imports system/.
    graph["gputopo.system.lsof"] = graph["gputopo.system.lsof"] | {"gputopo.procs.holders"}
    assert ("gputopo.system.lsof", "gputopo.procs.holders") in arrows_back_up(graph)
