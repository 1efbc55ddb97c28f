"""What ``gputopo run`` adds so that a hang can be read afterwards (pure): the Flight Recorder's
variables, NCCL's diagnostics switch, and the run record (``gputopo/run-record/v1``, the shape is
documented in ``gputopo.hang.record``).

The variables, as torch 2.14 reads them (torch/csrc/distributed/c10d/FlightRecorder.hpp and
FlightRecorderDetail.cpp, ``getCvarInt``/``getCvarString`` take the first name of the list that is set):
- ``TORCH_FR_BUFFER_SIZE`` (older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``): entries kept per process;
- ``TORCH_NCCL_DUMP_ON_TIMEOUT``: the NCCL watchdog dumps every rank's recorder when a collective times
  out (gloo has no watchdog: a gloo job dumps only through the dump API);
- ``TORCH_FR_DUMP_TEMP_FILE`` (older ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): the dump's file name prefix;
  ``DebugInfoWriter`` appends the global rank: ``<prefix><rank>``. Default ``~/.cache/torch/
  comm_lib_trace_rank_``.
A value the user set (under either name) is kept and said; gputopo only fills in what is missing.

``NCCL_RUN_DIAGNOSTICS=1`` (``--nccl-diagnostics``) makes NCCL run its active diagnostics at each
communicator's init (NVIDIA/nccl ``src/diagnostics.cc``: ``NCCL_PARAM(Diagnostics, "RUN_DIAGNOSTICS",
0)``, NCCL 2.31 and later); the report goes to rank 0's stdout as ``<host>:<pid> NCCL DIAG ...`` lines
(``src/include/diagnostics_log.h``), which ``gputopo hang --nccl-log`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FR_BUFFER_SIZE = 2000
DUMP_PREFIX_NAME = "fr-dump-"
RECORD_SCHEMA = "gputopo/run-record/v1"
DIAGNOSTICS_SINCE = (2, 31)

# Each variable gputopo sets, with the older names torch also reads (the first set wins in torch).
BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DIAGNOSTICS = ("NCCL_RUN_DIAGNOSTICS",)


@dataclass(frozen=True)
class RecorderEnv:
    """What to add to the child's environment, what the user had set (kept), and where dumps go."""

    env: dict[str, str]
    kept: dict[str, str]
    dump_prefix: str | None
    buffer_size: int | None
    dump_on_timeout: bool

    def kept_line(self) -> str | None:
        """The one stderr line saying which of the user's values were kept, or ``None``."""
        if not self.kept:
            return None
        said = ", ".join(f"{k}={v}" for k, v in self.kept.items())
        return f"kept your {said} (gputopo sets these only where unset)"


def _set(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "") != "":
            return name, environ[name]
    return None


def recorder_env(
    environ: Mapping[str, str], dump_prefix: str, flight_recorder: bool = True, diagnostics: bool = False
) -> RecorderEnv:
    """The Flight Recorder's variables (and ``NCCL_RUN_DIAGNOSTICS``) for a launch, the user's kept."""
    env: dict[str, str] = {}
    kept: dict[str, str] = {}
    wanted: list[tuple[Sequence[str], str]] = []
    if flight_recorder:
        wanted += [(BUFFER, str(FR_BUFFER_SIZE)), (DUMP_ON_TIMEOUT, "1"), (DUMP_FILE, dump_prefix)]
    if diagnostics:
        wanted.append((DIAGNOSTICS, "1"))
    for names, value in wanted:
        found = _set(environ, names)
        if found is None:
            env[names[0]] = value
        else:
            kept[found[0]] = found[1]
    final = {**environ, **env}
    size = _set(final, BUFFER)
    prefix = _set(final, DUMP_FILE)
    try:
        buffer_size = int(size[1]) if size else None
    except ValueError:
        buffer_size = None
    return RecorderEnv(
        env=env,
        kept=kept,
        dump_prefix=prefix[1] if prefix else None,
        buffer_size=buffer_size,
        dump_on_timeout=final.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "") not in ("", "0"),
    )


INSPECTOR_DIR_NAME = "inspector"  # RUN_DIR/inspector/: where `gputopo slow RUN_DIR` looks
# The plugin's settings (NVIDIA/nccl plugins/profiler/inspector/README.md and inspector.cc's table of
# variables, at 5067397): NCCL loads the plugin named by NCCL_PROFILER_PLUGIN; NCCL_INSPECTOR_ENABLE
# turns it on; NCCL_INSPECTOR_DUMP_DIR is its output folder (it makes it); only kernel-timed operations
# are kept (NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING, default 1); the dump interval defaults to -1, "only at
# communicator teardown", so a job that is killed would leave nothing: once a second instead.
INSPECTOR_INTERVAL_US = 1_000_000


def inspector_env(
    environ: Mapping[str, str], plugin: str | None, dump_dir: str
) -> tuple[dict[str, str], dict[str, str]]:
    """The variables that arm NCCL's Inspector for a launch (none without a plugin), and those the user
    had set already (kept)."""
    if plugin is None and not environ.get("NCCL_PROFILER_PLUGIN"):
        return {}, {}
    wanted = {
        "NCCL_PROFILER_PLUGIN": plugin or "",
        "NCCL_INSPECTOR_ENABLE": "1",
        "NCCL_INSPECTOR_DUMP_DIR": dump_dir,
        "NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING": "1",
        "NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": str(INSPECTOR_INTERVAL_US),
    }
    env: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in wanted.items():
        if environ.get(name):
            kept[name] = environ[name]
        else:
            env[name] = value
    return env, kept


def diagnostics_unsupported(nccl_version: str | None) -> str | None:
    """Why ``NCCL_RUN_DIAGNOSTICS`` will do nothing with this NCCL, or ``None`` (new enough, or unknown)."""
    if not nccl_version:
        return None
    try:
        major, minor = (int(x) for x in nccl_version.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < DIAGNOSTICS_SINCE:
        return (
            f"NCCL {nccl_version} has no NCCL_RUN_DIAGNOSTICS (added in "
            f"{DIAGNOSTICS_SINCE[0]}.{DIAGNOSTICS_SINCE[1]}); it is set but NCCL will ignore it"
        )
    return None


# torchrun's flags that take no value (torch/distributed/run.py), so the word after them is the script.
_TORCHRUN_SWITCHES = frozenset(
    {"--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path"}
)


@dataclass(frozen=True)
class TorchrunLayout:
    """What a torchrun line says about the ranks of this node (``None`` where it does not say)."""

    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None


def torchrun_layout(argv: Sequence[str]) -> TorchrunLayout:
    """``--nproc-per-node``, ``--nnodes`` and ``--node-rank`` of a torchrun line (either spelling,
    ``--flag value`` or ``--flag=value``); stops at the script. ``--nnodes 1:4`` (elastic) is unknown."""
    found: dict[str, str] = {}
    names = {
        "--nproc-per-node": "nproc",
        "--nproc_per_node": "nproc",
        "--nnodes": "nnodes",
        "--node-rank": "node_rank",
        "--node_rank": "node_rank",
    }
    args = list(argv)
    i = 3 if len(args) > 2 and args[1] == "-m" else 1  # after ``torchrun`` or ``python -m torch...run``
    takes_value = False
    while i < len(args):
        a = args[i]
        key, sep, value = a.partition("=")
        if key in names:
            if not sep and i + 1 < len(args):
                value = args[i + 1]
                i += 1
            found[names[key]] = value
            takes_value = False
        elif a.startswith("-"):
            takes_value = not sep and a not in _TORCHRUN_SWITCHES
        elif takes_value:
            takes_value = False
        else:
            break  # the script: what follows is its own arguments
        i += 1

    def _n(v: str | None) -> int | None:
        return int(v) if v is not None and v.isdigit() else None

    return TorchrunLayout(_n(found.get("nproc")), _n(found.get("nnodes")), _n(found.get("node_rank")))


def run_record(
    *,
    host: str,
    layout: TorchrunLayout,
    gpus: Sequence[Mapping[str, Any]],
    versions: Mapping[str, Any],
    env: Mapping[str, str],
    recorder: RecorderEnv | None,
    facts: Mapping[str, Any],
    created: str,
    command: Sequence[str],
) -> dict[str, Any]:
    """The run record of this node. ``gpus``: the chosen GPUs in ``CUDA_VISIBLE_DEVICES`` order, each
    ``{"index", "uuid", "pci_bus_id"}``; local rank i gets the i-th (torchrun's ranks use
    ``cuda:LOCAL_RANK``)."""
    per_node = layout.nproc_per_node
    nnodes = layout.nnodes
    node_rank = layout.node_rank if layout.node_rank is not None else (0 if nnodes in (None, 1) else None)
    world = per_node * nnodes if per_node is not None and nnodes is not None else None
    if world is None and per_node is not None and nnodes in (None, 1):
        world, nnodes = per_node, 1
    placed = [
        {"local_rank": i, "index": g.get("index"), "uuid": g.get("uuid"), "pci_bus_id": g.get("pci_bus_id")}
        for i, g in enumerate(gpus)
    ]
    return {
        "schema": RECORD_SCHEMA,
        "host": host,
        "node_rank": node_rank,
        "nnodes": nnodes,
        "ranks_per_node": per_node,
        "world_size": world,
        "rank_base": node_rank * per_node if node_rank is not None and per_node is not None else None,
        "cuda_visible_devices": [g.get("uuid") or str(g.get("index")) for g in gpus],
        "gpus": placed,
        "ranks": [],
        "versions": dict(versions),
        "env": dict(env),
        "flight_recorder": (
            {
                "buffer_size": recorder.buffer_size,
                "dump_prefix": recorder.dump_prefix,
                "dump_on_timeout": recorder.dump_on_timeout,
                "set_by": "user" if recorder.kept else "gputopo",
                "kept": dict(recorder.kept),
            }
            if recorder is not None
            else None
        ),
        "config": dict(facts),
        "command": list(command),
        "created": created,
    }


def with_ranks(record: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The record with this node's ranks as the launch found them (``found``: ``rank``, ``local_rank``,
    ``pid``, ``started``), each given its host and GPU (local rank i has the i-th chosen GPU), so
    ``gputopo hang`` can name a suspect's process and ``--live`` can look at it. Every rank that ever
    ran stays: one the launch no longer shows (it ended before the others) keeps its row, marked
    ``exited``, since ``hang`` and ``slow`` map its dumps and logs (by PID) through this record."""
    gpus = {g.get("local_rank"): g for g in record.get("gpus") or []}
    rows = []
    now = {r["rank"] for r in found}
    for r in found:
        gpu = gpus.get(r.get("local_rank"))
        rows.append(
            {
                "rank": r["rank"],
                "local_rank": r.get("local_rank"),
                "pid": r.get("pid"),
                "started": r.get("started"),
                "host": record.get("host"),
                "gpu": gpu.get("index") if gpu else None,
                "exited": False,
            }
        )
    for old in record.get("ranks") or []:
        if isinstance(old, Mapping) and old.get("rank") not in now:
            rows.append({**old, "exited": True})
    return {**record, "ranks": sorted(rows, key=lambda r: r["rank"])}
