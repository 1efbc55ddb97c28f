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


def _floors_contract() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: gputopo depends on tomli there
        import tomli as tomllib
    doc = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    return doc["tool"]["importlinter"]["contracts"][0]


def floors() -> list[list[str]]:
    """The floors of pyproject's first layers contract, top down, each a list of module prefixes."""
    layers = _floors_contract()["layers"]
    return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in layers]


def floors_ignored() -> set[tuple[str, str]]:
    """The imports that contract names as its exceptions (``a -> b``): lint-imports lets them pass, and
    so does the drawing (each says in pyproject.toml why it is there and when it goes)."""
    pairs = (line.split("->") for line in _floors_contract().get("ignore_imports", []))
    return {(a.strip(), b.strip()) for a, b in pairs}


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
    ignored = floors_ignored()
    up = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = floor_of(src, layers), floor_of(dst, layers)
            if a is not None and b is not None and b < a and (src, dst) not in ignored:
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


# --- The command layer's rules: one shape for every command (cli/ -> services/ -> the rooms below) -------
#
# Each measure below is a plain function over the sources (``ast`` and the import graph), and each test
# asserts the rule: cli/ is typer only (no body over 30 lines, no JSON key set, only item 2's imports, no
# system/ module, no check-state call), no Options field is typed Any, the drain rule lives in two files.
# They began as ratchets while the commands moved to services/; the move reached every target.
# ``pytest tests/test_architecture.py -k command_layer -s`` prints every value.

CLI = PACKAGE / "cli"

# cli/ may import only these (issue 41, item 2), and itself.
CLI_MAY_IMPORT = (
    "gputopo.cli",
    "gputopo.services",
    "gputopo.ui",
    "gputopo.errors",
    "gputopo.outputs",
    "gputopo.report",
    "gputopo.model",
    "gputopo.inputs",
    "gputopo.gpulist",
)
CLI_MAY_IMPORT_EXACT = ("gputopo",)  # the package itself: ``__version__`` (its prefix would allow all)
MAX_CLI_BODY_LINES = 30

# The check state's life cycle: every public function of health/state.py, and check.py's state helpers.
CHECK_STATE_MODULE = "gputopo.health.state"
CHECK_STATE_HELPERS = {"gputopo.services.check": {"default_state_path", "load_state"}}

# The drain rule ("no multi-GPU set holds a GPU whose driver asks to drain P2P"): the names that apply it,
# and the one module that may define them.
DRAIN_RULE_NAMES = {"p2p_drained", "p2p_drained_gpus"}
DRAIN_RULE_HOME = "gputopo.health.judge"


def cli_modules() -> dict[str, Path]:
    return {n: p for n, p in module_names().items() if n == "gputopo.cli" or n.startswith("gputopo.cli.")}


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def body_lines(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, from its first statement (docstring included) to its last; the
    signature (a typer command's option block) is not counted."""
    return func.body[-1].end_lineno - func.body[0].lineno + 1  # type: ignore[operator]


def long_function_bodies(modules: dict[str, Path], limit: int = MAX_CLI_BODY_LINES) -> dict[str, int]:
    """``module:function`` -> body lines, for every function (nested ones too) whose body is over
    ``limit`` lines."""
    out = {}
    for name, path in modules.items():
        for func in _functions(ast.parse(path.read_text())):
            if (n := body_lines(func)) > limit:
                out[f"{name}:{func.name}"] = n
    return out


def imports_outside(
    graph: dict[str, set[str]], sources: set[str], allowed: tuple[str, ...], exact: tuple[str, ...] = ()
) -> dict[str, set[str]]:
    """Project module -> the modules of ``sources`` that import it, for every import of a module that is
    under none of the ``allowed`` prefixes and none of the ``exact`` names."""
    out: dict[str, set[str]] = {}
    for src in sources:
        for dst in graph.get(src, ()):
            if dst not in exact and not any(dst == a or dst.startswith(a + ".") for a in allowed):
                out.setdefault(dst, set()).add(src)
    return out


def json_key_assignments(modules: dict[str, Path]) -> list[str]:
    """``module:line key`` for every ``x["key"] = ...`` (or ``+=``, or ``x.setdefault("key", ...)``): a
    document (or a launch's environment) built or edited key by key."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        isinstance(sub, ast.Subscript)
                        and isinstance(sub.slice, ast.Constant)
                        and isinstance(sub.slice.value, str)
                    ):
                        found.append(f"{name}:{sub.lineno} {sub.slice.value}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setdefault"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.append(f"{name}:{node.lineno} {node.args[0].value}")
    return sorted(found)


def _mentions_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a string annotation
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return "Any" in annotation.value
    return any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation)
    )


def options_fields_typed_any(modules: dict[str, Path]) -> list[str]:
    """``module:Class.field`` for every field typed ``Any`` (``Any``, ``Any | None``, ``list[Any]``...) of a
    class named ``...Options`` (a command's options)."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Options"):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.AnnAssign)
                        and isinstance(stmt.target, ast.Name)
                        and _mentions_any(stmt.annotation)
                    ):
                        found.append(f"{name}:{node.name}.{stmt.target.id}")
    return sorted(found)


def _imported_names(tree: ast.AST, package: str, module: str) -> tuple[set[str], dict[str, str]]:
    """What a module binds from ``module``: (aliases of the module itself, {local name: function})."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    parent, _, leaf = module.rpartition(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == module and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                if base == module:
                    functions[a.asname or a.name] = a.name
                elif base == parent and a.name == leaf:
                    modules.add(a.asname or a.name)
    return modules, functions


def calls_into(modules: dict[str, Path], module: str, only: set[str] | None = None) -> list[str]:
    """``caller:line function`` for every call, in ``modules``, of a function imported from ``module``
    (as ``f(...)`` after ``from module import f``, or ``m.f(...)`` after ``from parent import m as m``);
    ``only``: just these functions."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases, functions = _imported_names(tree, package, module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            called = None
            if isinstance(f, ast.Name) and f.id in functions:
                called = functions[f.id]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases:
                called = f.attr
            if called is not None and (only is None or called in only) and called[:1].islower():
                found.append(f"{name}:{node.lineno} {called}")
    return sorted(found)


def check_state_calls(modules: dict[str, Path]) -> list[str]:
    """Calls that load, change or save the check state (health/state.py's functions, check.py's state
    helpers) made from ``modules``."""
    found = calls_into(modules, CHECK_STATE_MODULE)
    for module, names in CHECK_STATE_HELPERS.items():
        found += calls_into(modules, module, names)
    return sorted(found)


def modules_naming(modules: dict[str, Path], names: set[str]) -> dict[str, list[int]]:
    """Module -> lines where its code (not its comments or docstrings) names one of ``names``: as a
    name, an attribute, an import or a definition."""
    out: dict[str, list[int]] = {}
    for name, path in modules.items():
        lines = []
        for node in ast.walk(ast.parse(path.read_text())):
            hit = (
                (isinstance(node, ast.Name) and node.id in names)
                or (isinstance(node, ast.Attribute) and node.attr in names)
                or (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names)
                or (isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names))
            )
            if hit:
                lines.append(node.lineno)
        if lines:
            out[name] = sorted(set(lines))
    return out


def drain_rule_files() -> dict[str, list[int]]:
    """The modules that apply the drain rule, its home (where it is defined) included."""
    return modules_naming(module_names(), DRAIN_RULE_NAMES)


def _show(capsys: pytest.CaptureFixture[str], what: str, value: int, limit: int, detail: object) -> None:
    with capsys.disabled():
        print(f"\ncommand layer: {what}: {value} (allowed {limit})")
    assert value <= limit, f"{what}: {value} > {limit}: {detail}"


# What each rule allows. Measured before the move (main af10927): 13 long bodies, 49 outside imports, 7 of
# them in system/, 24 JSON key assignments, 4 Any fields, the drain rule in 3 files besides its home, and 6
# check-state calls in cli/.
CLI_LONG_BODIES_ALLOWED = 0
CLI_IMPORTS_OUTSIDE_ALLOWED = 0  # cli/ imports only services/, ui/ and item 2's shared modules
CLI_IMPORTS_SYSTEM_ALLOWED = 0  # the machine is reached through a service, never from cli/
CLI_JSON_KEYS_ALLOWED = 0  # each command's document is built in its Report.document()
OPTIONS_ANY_FIELDS_ALLOWED = 0  # hooks are typed callbacks, inputs typed values
DRAIN_RULE_FILES_ALLOWED = 2  # its home (health/judge.py) and the one machine step (services/machine.py)
CLI_CHECK_STATE_CALLS_ALLOWED = 0  # the check state's life cycle lives in services/check.py


def test_command_layer_cli_function_bodies_over_30_lines(capsys):
    long = long_function_bodies(cli_modules())
    _show(
        capsys,
        f"cli/ function bodies over {MAX_CLI_BODY_LINES} lines",
        len(long),
        CLI_LONG_BODIES_ALLOWED,
        long,
    )


def test_command_layer_cli_imports_only_the_allowed_modules(capsys):
    graph = import_graph()
    outside = imports_outside(graph, set(cli_modules()), CLI_MAY_IMPORT, CLI_MAY_IMPORT_EXACT)
    _show(
        capsys,
        "project modules cli/ imports beyond item 2's list",
        len(outside),
        CLI_IMPORTS_OUTSIDE_ALLOWED,
        sorted(outside),
    )


def test_command_layer_no_json_key_is_set_in_cli(capsys):
    keys = json_key_assignments(cli_modules())
    _show(capsys, "JSON key assignments in cli/", len(keys), CLI_JSON_KEYS_ALLOWED, keys)


def test_command_layer_no_options_field_is_typed_any(capsys):
    fields = options_fields_typed_any(module_names())
    _show(capsys, "Options fields typed Any", len(fields), OPTIONS_ANY_FIELDS_ALLOWED, fields)


def test_command_layer_the_drain_rule_lives_in_few_files(capsys):
    files = drain_rule_files()
    assert DRAIN_RULE_HOME in files  # the measure still sees the rule where it is defined
    _show(capsys, "files naming the drain-P2P rule", len(files), DRAIN_RULE_FILES_ALLOWED, sorted(files))


def test_command_layer_no_check_state_call_in_cli(capsys):
    calls = check_state_calls(cli_modules())
    _show(
        capsys, "check-state load/change/save calls in cli/", len(calls), CLI_CHECK_STATE_CALLS_ALLOWED, calls
    )


def test_command_layer_cli_reaches_no_system_module(capsys):
    outside = imports_outside(import_graph(), set(cli_modules()), CLI_MAY_IMPORT, CLI_MAY_IMPORT_EXACT)
    system = sorted(m for m in outside if m.startswith("gputopo.system."))
    _show(capsys, "system/ modules cli/ imports", len(system), CLI_IMPORTS_SYSTEM_ALLOWED, system)


def test_the_command_layer_measures_catch_planted_code(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(31))
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import Any\n"
        "from gputopo.health import state as st\n"
        "from gputopo.services.check import load_state, run_check\n"
        "from dataclasses import dataclass\n\n"
        "@dataclass(frozen=True)\n"
        "class PlantedOptions:\n"
        "    hook: Any\n"
        "    maybe: 'Any | None' = None\n"
        "    fine: int = 0\n\n"
        f"def long(\n    a: int = 1,\n    b: int = 2,\n):\n{body}\n\n"
        "def short(doc):\n"
        "    doc['verdict'] = 'ok'\n"
        "    doc.setdefault('findings', [])\n"
        "    doc[0] = 1\n"
        "    state, _ = load_state(None, 'n')\n"
        "    run_check(None)\n"
        "    return st.dumps(st.resumed(state)), p2p_drained_gpus\n"
    )
    modules = {"planted": planted}
    assert long_function_bodies(modules) == {"planted:long": 31}  # the signature's lines are not counted
    assert [k.split(" ")[1] for k in json_key_assignments(modules)] == ["verdict", "findings"]
    assert options_fields_typed_any(modules) == [
        "planted:PlantedOptions.hook",
        "planted:PlantedOptions.maybe",
    ]
    assert sorted(c.split(" ")[1] for c in check_state_calls(modules)) == ["dumps", "load_state", "resumed"]
    last_line = len(planted.read_text().splitlines())
    assert modules_naming(modules, DRAIN_RULE_NAMES) == {"planted": [last_line]}
    graph = {"gputopo.cli.x": {"gputopo.ui.v", "gputopo.system.net", "gputopo", "gputopo.services.topo"}}
    assert set(imports_outside(graph, {"gputopo.cli.x"}, CLI_MAY_IMPORT, CLI_MAY_IMPORT_EXACT)) == {
        "gputopo.system.net"
    }


# --- One way from rule to finding (issue 41, item 5) ----------------------------------------------------
#
# A rule row makes its finding (``Rule.finding``, in gputopo.findings beside the finding; the table is
# health/rules.py), so a finding's severity, category, action and remedy come from the row. Nothing else
# builds a ``Finding(..., rule=...)`` by hand.
RULE_FINDING_HOME = "gputopo.findings:Rule.finding"
# The hand-built ones still allowed, by module (or module:function), each with its reason: finding_from_json
# reads a finding back from its JSON, where no rule judges anything.
RULE_FINDINGS_BY_HAND_ALLOWED = {"gputopo.findings:finding_from_json": 1}


def rule_findings_by_hand(modules: dict[str, Path]) -> list[str]:
    """``module:function:line`` for every ``Finding(...)`` call that passes ``rule=`` (the function is the
    innermost enclosing one, as ``Class.method`` for a method; ``<module>`` at the top level)."""
    found: list[str] = []

    def visit(node: ast.AST, name: str, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if where == "<module>" else f"{where}.{child.name}"
            if isinstance(child, ast.Call):
                f = child.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if called == "Finding" and any(k.arg == "rule" for k in child.keywords):
                    found.append(f"{name}:{where}:{child.lineno}")
            visit(child, name, inner)

    for name, path in modules.items():
        visit(ast.parse(path.read_text()), name, "<module>")
    return sorted(found)


def _allowance_key(site: str) -> str:
    module, function, _ = site.split(":")
    return f"{module}:{function}" if f"{module}:{function}" in RULE_FINDINGS_BY_HAND_ALLOWED else module


def test_findings_with_a_rule_are_made_by_the_rule_row():
    sites = [s for s in rule_findings_by_hand(module_names()) if not s.startswith(RULE_FINDING_HOME + ":")]
    counts: dict[str, list[str]] = {}
    for site in sites:
        counts.setdefault(_allowance_key(site), []).append(site)
    over = {k: v for k, v in counts.items() if len(v) > RULE_FINDINGS_BY_HAND_ALLOWED.get(k, 0)}
    assert not over, f"findings built by hand with rule= (make them with Rule.finding): {over}"


def test_the_rule_finding_measure_catches_a_planted_finding(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from gputopo.findings import Finding\n\n"
        "class Judge:\n"
        "    def add(self):\n"
        "        return Finding('GPU0', 'what', 'remedy', rule='ecc_off')\n\n"
        "def fine():\n"
        "    return Finding('GPU0', 'what', 'remedy')\n"
    )
    assert rule_findings_by_hand({"planted": planted}) == ["planted:Judge.add:5"]
    assert _allowance_key("gputopo.findings:finding_from_json:9") == "gputopo.findings:finding_from_json"
    assert _allowance_key("gputopo.health.xid:xid_findings:9") == "gputopo.health.xid"


def test_each_rule_remedy_is_written_once():
    """A row's remedy is the finding's remedy: no string in the code outside the rows says it again."""
    from gputopo.health.rules import REPORTED_RULES, RULES

    remedies = {
        r.remedy_template: r.name for r in (*RULES.values(), *REPORTED_RULES.values()) if r.remedy_template
    }
    rows = {"gputopo.health.rules", "gputopo.topology.pcie_path"}
    again = [
        f"{name}:{node.lineno} {remedies[node.value]}"
        for name, path in module_names().items()
        if name not in rows
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in remedies
    ]
    assert not again, f"a rule's remedy written again outside its row (use Rule.finding's default): {again}"
