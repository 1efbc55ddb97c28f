"""What ``gputopo run`` (and ``recommend --launch``) add to a launch line: the user's command checked and
split, this environment's NCCL settings turned into findings (said through ``warn``), the launcher's
tools found, the line built (``line.build_launch``), and a Python script wrapped to serve torch's
control plane (``control_plane``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from gputopo.errors import UsageError
from gputopo.findings import Finding
from gputopo.launch.control_plane import Wrapped, wrap, wrapper_path
from gputopo.launch.line import LaunchPlan, LaunchTools
from gputopo.model import Topology

Warn = Callable[[str], None]


def launch_plan_for(
    topo: Topology, gpus: Sequence[int], text: str, nnodes: int, prefer_uuid: bool, warn: Warn
) -> LaunchPlan:
    """``recommend --launch "CMD ..." [--nnodes N]``: the torchrun line for ``gpus``, NCCL settings checked.

    CMD is wrapped in torchrun unless it already starts torchrun; NCCL settings from this environment
    that are for debugging only come back as notes (and warnings on stderr).
    """
    from gputopo.launch.line import build_launch, is_torchrun, split_command
    from gputopo.system.launcher import detect_tools

    if nnodes < 1:
        raise UsageError(
            f"--nnodes {nnodes}: must be at least 1", "give the number of machines, e.g. --nnodes 2"
        )
    try:
        argv = split_command(text)
    except ValueError as exc:
        raise UsageError(f"--launch {text!r}: {exc}", "quote the command as a shell would") from None
    if not argv:
        raise UsageError(
            "--launch: empty command", 'give the training command, e.g. --launch "train.py --lr 0.1"'
        )
    wrap = not is_torchrun(argv)
    findings = warn_nccl_env(warn, [nic.name or nic.label for nic in topo.nics])
    tools = detect_tools() if wrap else LaunchTools()
    return build_launch(
        topo,
        gpus,
        argv,
        torchrun=wrap,
        nnodes=nnodes,
        tools=tools,
        prefer_uuid=prefer_uuid,
        env_findings=findings,
    )


def check_command(command: Sequence[str], torchrun: bool, path: str | None = None) -> None:
    """Refuse, before anything starts, a command that cannot run: ``UsageError`` "command not found: X".

    Alone, ``X`` must be a program on ``PATH`` (or a path to one). Under torchrun a ``.py`` first word is a
    script torchrun runs with Python (``line.build_launch``), so it must be a file; anything else is run
    as a program (``--no-python``). An option first (``-m module``) is torchrun's to judge.
    """
    import shutil

    if not command or command[0].startswith("-"):
        return
    program = command[0]
    if torchrun and program.endswith(".py"):
        if not os.path.isfile(program):
            raise UsageError(f"command not found: {program}", "no such script here; check the path")
        return
    if shutil.which(program, path=path if path is not None else os.environ.get("PATH")) is None:
        raise UsageError(f"command not found: {program}", "check the name and PATH, or give the full path")


def warn_nccl_env(warn: Warn, nic_names: list[str] | None = None) -> list[Finding]:
    """NCCL settings of this environment that are for debugging only, as warnings on stderr (never fatal)."""
    from gputopo.findings import nccl_env_findings

    findings = nccl_env_findings(os.environ, nic_names or [])
    for f in findings:
        warn(f"{f.what}; {f.remedy}")
    return findings


def served_command(command: Sequence[str], torchrun: bool) -> Wrapped:
    """The user's command with ``launch/worker_main.py`` put where Python takes the script, so each rank
    serves torch's control plane (``launch.control_plane.wrap``: what is wrapped, or why not)."""
    return wrap(command, wrapper_path(), torchrun)
