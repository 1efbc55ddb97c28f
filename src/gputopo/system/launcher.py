"""What a launch needs from this machine (torchrun and its flags, numactl), and the exec itself.

torch is not imported: finding its files and reading ``torch/distributed/run.py`` as text tells whether
torchrun has ``--numa-binding`` in a few milliseconds, where ``import torch`` takes seconds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gputopo.errors import UnavailableError, UsageError
from gputopo.launch.line import LaunchTools


def detect_tools() -> LaunchTools:
    """torchrun (on PATH, else ``python -m torch.distributed.run``), its ``--numa-binding``, numactl."""
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return LaunchTools(torchrun=None, numa_binding=None, numactl=shutil.which("numactl") is not None)
    run_py = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "run.py"
    numa_binding = has_numa_binding(run_py)
    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    torchrun = ("torchrun",) if shutil.which("torchrun") else (sys.executable, "-m", "torch.distributed.run")
    return LaunchTools(
        torchrun=torchrun,
        torch_version=version,
        numa_binding=numa_binding,
        numactl=shutil.which("numactl") is not None,
    )


def has_numa_binding(run_py: Path) -> bool:
    """True when this torchrun source (``torch/distributed/run.py``) defines ``--numa-binding``."""
    try:
        return '"--numa-binding"' in run_py.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def exec_command(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Replace this process with ``argv`` in ``env``: its exit code and signals become the caller's.

    Only returns by raising: ``UsageError`` when the program is not found, ``UnavailableError`` when it
    cannot be run.
    """
    if not argv:
        raise UsageError(
            "no command given", "put the command after --, e.g. gputopo run --n 2 -- python train.py"
        )
    program = argv[0]
    if shutil.which(program, path=env.get("PATH")) is None:
        raise UsageError(f"{program}: command not found", "check the name and PATH, or give the full path")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(program, list(argv), dict(env))
    except OSError as exc:
        raise UnavailableError(
            f"{program}: cannot run ({exc.strerror})", "check that it is executable"
        ) from None
