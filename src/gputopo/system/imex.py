"""This node's IMEX: its node configuration and ``nvidia-imex-ctl -q`` / ``-N -j``, within the time left.

The configuration is read through the re-rootable /etc (``system.sysfs``: ``GPUTOPO_ETC_ROOT``):
``nvidia-imex/config.cfg`` may name the node configuration in ``IMEX_NODE_CONFIG_FILE=`` (its default is
``/etc/nvidia-imex/nodes_config.cfg``; NVIDIA IMEX guide, "IMEX Service Config Options"; NVIDIA's DRA driver
writes the key the same way, ``templates/compute-domain-daemon-config.tmpl.cfg``). The node configuration
lists the domain's nodes, one address a line; a file with no address is no configuration: Slurm IMEX
prologs empty it between jobs and stop the daemon.

``nvidia-imex-ctl`` runs only where a daemon is expected (the caller says so), once for ``-q`` and once for
``-N -j``, each cut off at the time left in check's ``--budget`` (and at ``TIMEOUT_S``): a hung one is killed
with its process group and reported, never waited on. It is looked for on ``PATH`` and then where DCGM
looks (``DcgmImexManager::GetImexCtlSearchPaths``), so a health check run with no ``PATH`` finds it too.
What the answers mean is judged in ``health.imex``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time

from gputopo.errors import stop_held
from gputopo.health.imex import CtlAnswer, ImexReading, daemon_state, not_configured
from gputopo.system.sysfs import FsView, read_bytes, view

CTL = "nvidia-imex-ctl"
CONFIG = "nvidia-imex/config.cfg"
DEFAULT_NODES_CONFIG = "/etc/nvidia-imex/nodes_config.cfg"
# DCGM's trusted places for nvidia-imex-ctl (DcgmImexManager.cpp, GetImexCtlSearchPaths).
SEARCH_DIRS = (
    "/usr/bin",
    "/usr/local/bin",
    "/opt/nvidia/imex/bin",
    "/usr/local/nvidia/imex/bin",
    "/usr/libexec/datacenter-gpu-manager-4",
)
# The longest one call may take when the budget leaves more (DCGM waits 30 s, in the background; a
# node health check has a budget of seconds).
TIMEOUT_S = 5.0
# Kept back from the time left for what follows (rendering the result).
RESERVE_S = 0.5
# Below this no call is started: it could not finish.
MIN_CALL_S = 0.2
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # -N -j of a 72-tray domain is a few tens of kilobytes
CONFIG_BYTES = 1024 * 1024


def ctl_path() -> str | None:
    """``nvidia-imex-ctl`` on ``PATH``, else in DCGM's search directories."""
    found = shutil.which(CTL)
    if found:
        return found
    return shutil.which(CTL, path=os.pathsep.join(SEARCH_DIRS))


def nodes_config_path(fs: FsView) -> str:
    """The node configuration file, as the machine names it: the last ``IMEX_NODE_CONFIG_FILE=`` in
    ``config.cfg`` (``#`` starts a comment), or the default."""
    data = read_bytes(fs.etc_path(CONFIG), CONFIG_BYTES)
    named = None
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        key, sep, value = line.split("#", 1)[0].partition("=")
        if sep and key.strip() == "IMEX_NODE_CONFIG_FILE" and value.strip():
            named = value.strip()
    return named or DEFAULT_NODES_CONFIG


def read_config(fs: FsView) -> tuple[str, bool, str | None]:
    """(the node configuration's path, whether it lists a node, why not)."""
    name = nodes_config_path(fs)
    data = read_bytes(fs.etc_path(name), CONFIG_BYTES)
    if data is None:
        return name, False, f"no {name}"
    addresses = [line.split("#", 1)[0].strip() for line in data.decode("utf-8", "replace").splitlines()]
    if not any(addresses):
        return name, False, f"{name} lists no node"
    return name, True, None


def read_imex(expect: bool, deadline: float, fs: FsView | None = None) -> ImexReading:
    """This node's IMEX; ``nvidia-imex-ctl`` is run only when the configuration is there or ``expect``
    (``--expect-imex``). ``deadline`` is a ``time.monotonic()`` reading: no call runs past it."""
    name, configured, why = read_config(fs or view())
    reading = ImexReading(name, configured, why)
    if not (configured or expect):
        return reading
    exe = ctl_path()
    if exe is None:
        missing = CtlAnswer(CTL + " -q", error=f"{CTL} not found (PATH, {', '.join(SEARCH_DIRS[:4])})")
        return ImexReading(name, configured, why, missing)
    daemon = run_ctl(exe, ["-q"], deadline)
    if daemon.stdout is None or not_configured(daemon) or daemon_state(daemon.stdout) is None:
        return ImexReading(name, configured, why, daemon)  # -N -j would say no more
    domain = run_ctl(exe, ["-N", "-j"], deadline)
    return ImexReading(name, configured, why, daemon, domain, own_hosts())


def own_hosts() -> tuple[str, ...]:
    """This host's addresses (every interface's IPv4 and IPv6, psutil) and names (``gethostname`` and its
    short form): how it finds itself among the IMEX domain's members, which the node configuration names
    by address (or name)."""
    import socket

    import psutil

    found: list[str] = []
    with contextlib.suppress(OSError):
        for addrs in psutil.net_if_addrs().values():
            found += [
                a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
            ]
    with contextlib.suppress(OSError):
        name = socket.gethostname()
        found += [name, name.split(".", 1)[0]]
    return tuple(dict.fromkeys(h for h in found if h))


def run_ctl(exe: str, args: list[str], deadline: float) -> CtlAnswer:
    """``exe ARGS`` cut off at ``deadline`` (less ``RESERVE_S``) or ``TIMEOUT_S``, whichever comes first."""
    line = shlex.join([CTL, *args])
    left = deadline - RESERVE_S - time.monotonic()
    if left < MIN_CALL_S:
        return CtlAnswer(line, error=f"`{line}` not run: the time budget (--budget) was spent")
    limit = min(TIMEOUT_S, left)
    proc: subprocess.Popen[bytes] | None = None
    try:
        # Its own process group, so a hung tool and anything it started are killed together; a stop
        # signal while it starts is raised once proc holds it, and takes the group with it.
        with stop_held():
            try:
                proc = subprocess.Popen(
                    [exe, *args],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                return CtlAnswer(line, error=f"`{line}`: {exc.strerror or exc}")
        out, err = proc.communicate(timeout=limit)
    except KeyboardInterrupt:
        if proc is not None:
            _kill_group(proc)
        raise
    except subprocess.TimeoutExpired:
        assert proc is not None
        _kill_group(proc)
        return CtlAnswer(
            line, error=f"`{line}` did not answer within {limit:.1f} s (cut off to keep --budget)"
        )
    return CtlAnswer(
        line,
        out[:MAX_ANSWER_BYTES].decode("utf-8", "replace"),
        err[:MAX_ANSWER_BYTES].decode("utf-8", "replace"),
        proc.returncode,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    # A grandchild that left the group may still hold the pipes: give up on it after a second.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=1.0)
