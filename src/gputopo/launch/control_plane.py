"""Where ``gputopo run`` puts ``launch/worker_main.py`` in a command (pure: argv in, argv out), so that a
Python script runs inside torch's control plane without a change to it and ``gputopo hang --live`` /
``gputopo slow --live`` can ask each rank for its Flight Recorder while the job runs.

The wrapper goes where the interpreter would take the script: ``python [opts] WRAPPER train.py ARGS``,
``python [opts] WRAPPER -m pkg.mod ARGS``; under ``--torchrun`` a bare ``train.py`` becomes
``WRAPPER train.py`` (torchrun runs its first argument with Python); a command that is itself torchrun
gets the wrapper before its training script (``torchrun [opts] WRAPPER train.py``, and after the
interpreter in ``torchrun --no-python python train.py``). Everything else (a shell script, a binary,
``python -c``, ``torchrun -m``) runs as written, with the reason said once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
# Python's options that take the next word as their value (python --help: -W arg, -X opt, --check-hash-
# based-pycs mode).
_PY_VALUED = ("-W", "-X", "--check-hash-based-pycs")
# torchrun's own: the first of these makes the training script a module or a program, not a .py file.
_TORCHRUN_MODULE = ("-m", "--module")
_TORCHRUN_NO_PYTHON = ("--no-python", "--no_python")


@dataclass(frozen=True)
class Wrapped:
    command: tuple[str, ...]
    armed: bool
    why_not: str | None = None  # why the command runs as written


def is_python(word: str) -> bool:
    return bool(_PYTHON.match(word.rsplit("/", 1)[-1]))


def wrap(command: Sequence[str], wrapper: str, torchrun: bool) -> Wrapped:
    """``command`` with ``wrapper`` before its Python script (see the module docstring). ``torchrun``:
    gputopo itself puts torchrun in front of ``command``."""
    cmd = list(command)
    if not cmd:
        return Wrapped((), False, "no command")
    from gputopo.launch.line import is_torchrun

    if is_torchrun(cmd):
        return _in_torchrun(cmd, wrapper)
    if is_python(cmd[0]):
        return _after_python(cmd, 0, wrapper)
    if torchrun and cmd[0].endswith(".py"):
        return Wrapped((wrapper, *cmd), True)
    return Wrapped(tuple(cmd), False, f"{cmd[0]} is not a Python script")


def _after_python(cmd: list[str], at: int, wrapper: str) -> Wrapped:
    """``cmd[at]`` is the interpreter: the wrapper goes after its options."""
    i = at + 1
    while i < len(cmd):
        word = cmd[i]
        if word == "-m":
            break
        if word == "-c" or word.startswith("-c") and not word.startswith("--"):
            return Wrapped(tuple(cmd), False, "python -c runs code, not a script")
        if word == "-":
            return Wrapped(tuple(cmd), False, "python - reads its program from stdin")
        if not word.startswith("-"):
            break
        i += 2 if word in _PY_VALUED else 1
    if i >= len(cmd) or (cmd[i] == "-m" and i + 1 >= len(cmd)):
        return Wrapped(tuple(cmd), False, "no script after the interpreter")
    return Wrapped((*cmd[:i], wrapper, *cmd[i:]), True)


def _in_torchrun(cmd: list[str], wrapper: str) -> Wrapped:
    start = 1 if cmd[0].rsplit("/", 1)[-1] == "torchrun" else 3
    no_python = False
    for i in range(start, len(cmd)):
        word = cmd[i]
        if word in _TORCHRUN_MODULE:
            return Wrapped(tuple(cmd), False, "torchrun -m runs a module by name")
        if word in _TORCHRUN_NO_PYTHON:
            no_python = True
            continue
        if word.startswith("-"):
            continue
        if no_python and is_python(word):
            return _after_python(cmd, i, wrapper)
        if not no_python and word.endswith(".py"):
            return Wrapped((*cmd[:i], wrapper, *cmd[i:]), True)
    return Wrapped(tuple(cmd), False, "no Python script found in the torchrun line")


def wrapper_path() -> str:
    """The wrapper's file, run by path in the rank's own Python (which need not have gputopo)."""
    from pathlib import Path

    return str(Path(__file__).with_name("worker_main.py"))
