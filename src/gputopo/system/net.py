"""Questions to this machine's network stack: two asked before a multi-node rendezvous starts, and what
NICs it has (``read_nics``) for judging the bandwidth between nodes.

Does the rendezvous host resolve (so a name nobody can connect to fails in a second, not after
``--rdzv-timeout``), and is a TCP port already held here (so a derived port that another job's store holds
fails loudly instead of making this job a client of that store).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from typing import Any

DEFAULT_RESOLVE_TIMEOUT_S = 10.0


def resolves(host: str, timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S) -> bool:
    """Whether ``host`` (a name or an address) has an address for TCP, within ``timeout_s``.

    ``getaddrinfo`` has no timeout of its own (a dead DNS server makes it wait for the resolver's retries),
    so it runs in a daemon thread; an answer that has not come in ``timeout_s`` counts as "does not
    resolve": torch's store would have to wait for the same answer.
    """
    result: list[bool] = []

    def look_up() -> None:
        try:
            result.append(bool(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)))
        except (OSError, UnicodeError):
            result.append(False)

    thread = threading.Thread(target=look_up, name="gputopo-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def port_taken(port: int) -> bool:
    """Whether a TCP listener (or any socket bound to it) already holds ``port`` on this machine.

    Binds the wildcard address with ``SO_REUSEADDR``, as torch's TCPStore server does, so a port left in
    TIME_WAIT by a finished job counts as free and one that something listens on, on any address, does
    not (Linux refuses the bind with EADDRINUSE). Tried on IPv4; an IPv6-only listener is tried too where
    the machine has IPv6.
    """
    for family, address in ((socket.AF_INET, ("0.0.0.0", port)), (socket.AF_INET6, ("::", port))):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            sock.close()
    return False


SYS_ROOT = Path("/sys")


def read_nics(sys_root: Path = SYS_ROOT) -> dict[str, list[dict[str, Any]]]:
    """This machine's RDMA ports and Ethernet interfaces, as the kernel's sysfs spells them (raw strings;
    ``probe.judge.network`` reads them):

    - ``ib``: every ``/sys/class/infiniband/DEV/ports/N/``: ``rate`` (e.g. ``"200 Gb/sec (4X HDR)"``),
      ``state`` (``"4: ACTIVE"``), ``link_layer`` (``InfiniBand``, or ``Ethernet`` for RoCE)
      (Documentation/ABI/stable/sysfs-class-infiniband);
    - ``eth``: every ``/sys/class/net/IF`` backed by a device (``device`` link: no loopback, bridge or
      veth): ``speed`` in Mb/s (``-1`` or unreadable when the link is down or the driver does not say),
      ``operstate`` (Documentation/ABI/testing/sysfs-class-net).
    """
    ib: list[dict[str, Any]] = []
    ib_root = sys_root / "class" / "infiniband"
    for dev in _names(ib_root):
        for port in _names(ib_root / dev / "ports"):
            folder = ib_root / dev / "ports" / port
            ib.append(
                {
                    "device": dev,
                    "port": port,
                    "rate": _read(folder / "rate"),
                    "state": _read(folder / "state"),
                    "link_layer": _read(folder / "link_layer"),
                }
            )
    eth: list[dict[str, Any]] = []
    net_root = sys_root / "class" / "net"
    for name in _names(net_root):
        if not os.path.exists(net_root / name / "device"):
            continue
        folder = net_root / name
        eth.append({"name": name, "speed": _read(folder / "speed"), "operstate": _read(folder / "operstate")})
    return {"ib": ib, "eth": eth}


def _names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # EINVAL from "speed" on a link that is down, or a missing file
        return None
