"""Two questions to this machine's network stack, asked before a multi-node rendezvous starts.

Does the rendezvous host resolve (so a name nobody can connect to fails in a second, not after
``--rdzv-timeout``), and is a TCP port already held here (so a derived port that another job's store holds
fails loudly instead of making this job a client of that store).
"""

from __future__ import annotations

import errno
import socket
import threading

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
