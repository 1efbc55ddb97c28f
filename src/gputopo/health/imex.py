"""IMEX judged only where a daemon is expected (pure): what ``nvidia-imex-ctl`` said, read into findings.

IMEX (NVIDIA's Internode Memory Exchange service) lets the trays of an NVLink rack (GB200/GB300 NVL72) map
each other's GPU memory. A node is meant to run its daemon when its IMEX node configuration is there
(``/etc/nvidia-imex/nodes_config.cfg``, or the file ``IMEX_NODE_CONFIG_FILE`` in ``config.cfg`` names; NVIDIA
IMEX guide, "IMEX Service Config Options") or when the admin says so (``check --expect-imex``). Anywhere
else no daemon is expected and none is judged: under NVIDIA's Kubernetes DRA driver the daemons run only
while a ComputeDomain is active, so an idle, healthy node has none; an HGX B200 board has no multi-node
NVLink at all. DCGM judges every node and fails those (``IMEX daemon status is -3``: NVIDIA/DCGM #308,
NVIDIA/aicr #2641): here they are "not checked: no IMEX daemon expected here", never a problem.

What ``nvidia-imex-ctl`` answers (facts checked against the sources named):

- ``-q`` "Query the status of the IMEX daemon once and return" (NVIDIA IMEX guide, "IMEX Service Command
  Service"; quoted by NVIDIA/k8s-dra-driver-gpu ``cmd/compute-domain-daemon/main.go``, ``check``, which
  takes exactly ``READY\\n`` as ready). The answer is one state word; DCGM's ``DcgmImexManager``
  (``dcgmlib/src/DcgmImexManager.h``, ``DcgmImexDaemonStatus``; read at NVIDIA/DCGM 72fa3fe) knows eight:
  INITIALIZING, STARTING_AUTH_SERVER, WAITING_FOR_PEERS, WAITING_FOR_RECOVERY, INIT_GPU, READY,
  SHUTTING_DOWN, UNAVAILABLE, and compares the trimmed answer case-insensitively (``ParseDaemonStatusText``).
- ``-N`` "Gets the full status of the entire IMEX domain", ``-j`` in JSON (IMEX guide). The keys read here,
  as DCGM's tests quote a real answer (``dcgmlib/src/tests/DcgmImexManagerTests.cpp``, "actual sample JSON
  from specification") and NVIDIA/ISV-NCP-Validation-Suite's IMEX domain test confirmed live
  (``imex_domain_test.py``, 2026-09-04)::

      {"nodes": {"<index>": {"status": "READY", "host": "10.0.0.1", "hostName": "",
                             "connections": {"<index>": {"host": "10.0.0.2", "status": "CONNECTED",
                                                         "changed": true}},
                             "changed": true, "version": "580.30"}},
       "timestamp": "5/22/2025 19:46:40.891", "status": "UP"}

  ``status`` (top level): the domain, UP, DOWN or DEGRADED (DCGM ``DcgmImexDomainStatus``; DCGM takes the
  last ``"status":`` in the text, which is the top-level one because it comes after ``nodes``; a JSON parser
  needs no such care). ``nodes``: every member the node configuration lists, each with its ``status`` (the
  daemon states above), ``host`` (its address as the node configuration names it), ``hostName`` (filled only
  with ``-H``) and ``connections`` (its links to the other members: CONNECTED, or INVALID where the peer is
  not reached). A member whose daemon is down is listed UNAVAILABLE with every connection INVALID.
- ``Failed to read node configuration file`` in either answer: IMEX is not configured on this node (DCGM
  ``GetDaemonStatusFromCommand``/``GetDomainStatusFromCommand`` look for exactly these words;
  ``nvidia-imex-ctl`` exits 255 then, per the ISV suite).

How it is judged (rules in ``health.rules``): a daemon not READY (or not answering at all) on a node that
expects one is a problem that drains (DCGM fails the same); the domain DOWN or DEGRADED, a member not
READY and a link between members not CONNECTED are problems naming the member by host, which do not drain
this node: every tray of the rack sees the same domain, and one bad tray must not drain the other 17.
One fault is named once: a member that is down is one finding (its INVALID links are not named again),
and the domain's state goes into those findings rather than beside them. This node is reported once, as
its daemon: where that is not READY, its own member (found by its address among the host's, or as the one
member in the daemon's own state) is not named again, nor are the other members' links to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gputopo.findings import Finding
from gputopo.health.judge import NotChecked
from gputopo.health.rules import DEFAULT_THRESHOLDS, Thresholds

# The daemon states DCGM's DcgmImexManager knows (DcgmImexDaemonStatus, with its numbers as DCGM reports
# them in DCGM_FI_IMEX_DAEMON_STATUS). Only READY is ready.
DAEMON_STATES = {
    "INITIALIZING": 0,
    "STARTING_AUTH_SERVER": 1,
    "WAITING_FOR_PEERS": 2,
    "WAITING_FOR_RECOVERY": 3,
    "INIT_GPU": 4,
    "READY": 5,
    "SHUTTING_DOWN": 6,
    "UNAVAILABLE": 7,
}
READY = "READY"
# The domain states (DcgmImexDomainStatus): UP is healthy, DOWN and DEGRADED fail in DCGM's MonitorImex.
DOMAIN_UP = "UP"
DOMAIN_BAD = ("DOWN", "DEGRADED")
CONNECTED = "CONNECTED"
# What nvidia-imex-ctl prints when the node's IMEX configuration cannot be read (DcgmImexManager.cpp).
NOT_CONFIGURED_TEXT = "Failed to read node configuration file"
WHAT = "IMEX"


@dataclass(frozen=True)
class CtlAnswer:
    """One ``nvidia-imex-ctl`` run as ``system.imex`` saw it: ``command`` as a shell line, ``stdout`` and
    ``stderr`` (``stdout`` ``None`` when it gave no answer), ``exit_code``, and ``error``: why there is no
    answer (not found, cut off at the budget, could not start)."""

    command: str
    stdout: str | None = None
    stderr: str = ""
    exit_code: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class ImexReading:
    """What this node shows of IMEX: the node configuration file looked at (``nodes_config``, the path as
    the machine names it), whether it lists any member (``configured``; ``config_why`` why not), and the
    two answers (``None``: not run, because no daemon is expected or the first answer made the second
    pointless), and ``own_hosts``: this host's addresses and names, to find itself among the members."""

    nodes_config: str
    configured: bool
    config_why: str | None = None
    daemon: CtlAnswer | None = None
    domain: CtlAnswer | None = None
    own_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Member:
    """One member of the domain in ``-N -j``: its index (the key), ``host`` (address), ``host_name``
    (``hostName``, empty without ``-H``), ``status`` and its ``connections`` as (peer host, status)."""

    index: str
    host: str
    host_name: str
    status: str
    connections: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        """The member by host: ``10.0.0.2`` or ``10.0.0.2 (gpu-node-2)``."""
        if self.host_name and self.host_name != self.host:
            return f"{self.host} ({self.host_name})"
        return self.host or f"node {self.index}"


@dataclass(frozen=True)
class Domain:
    """The domain as ``-N -j`` showed it: its ``status`` and every member."""

    status: str
    members: tuple[Member, ...]


def not_configured(answer: CtlAnswer | None) -> bool:
    """Whether the answer is nvidia-imex-ctl's "Failed to read node configuration file"."""
    if answer is None:
        return False
    return NOT_CONFIGURED_TEXT.lower() in f"{answer.stdout or ''}\n{answer.stderr}".lower()


def daemon_state(text: str | None) -> str | None:
    """The state ``-q`` printed (upper case), ``None`` when the answer is not one state word."""
    if text is None:
        return None
    word = text.strip().upper()
    return word if word in DAEMON_STATES else None


def parse_domain(text: str | None) -> Domain | None:
    """The domain in ``-N -j``'s JSON; ``None`` when it is not JSON or has no top-level ``status``."""
    if not text:
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("status"), str):
        return None
    nodes = doc.get("nodes")
    members = []
    for index, node in nodes.items() if isinstance(nodes, dict) else ():
        if not isinstance(node, dict):
            continue
        conns = node.get("connections")
        links = tuple(
            (_text(c.get("host")), _text(c.get("status")).upper())
            for c in (conns.values() if isinstance(conns, dict) else ())
            if isinstance(c, dict)
        )
        members.append(
            Member(
                str(index),
                _text(node.get("host")),
                _text(node.get("hostName")),
                _text(node.get("status")).upper(),
                links,
            )
        )
    members.sort(key=lambda m: (not m.index.isdigit(), int(m.index) if m.index.isdigit() else 0, m.index))
    return Domain(doc["status"].strip().upper(), tuple(members))


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def judge_imex(
    reading: ImexReading, expect: bool, thresholds: Thresholds = DEFAULT_THRESHOLDS
) -> tuple[list[Finding], list[NotChecked]]:
    """IMEX's findings and what could not be checked. ``expect`` is ``--expect-imex``."""
    if not (reading.configured or expect):
        config = reading.config_why or "no node configuration"
        why = f"no IMEX daemon expected here: {config}, no --expect-imex"
        return [], [NotChecked(WHAT, why)]
    daemon, domain = reading.daemon, reading.domain
    if not_configured(daemon) or not_configured(domain):
        return _not_configured(reading, "nvidia-imex-ctl: " + NOT_CONFIGURED_TEXT, thresholds), []
    if daemon is None or daemon.stdout is None:
        why = daemon.error if daemon is not None and daemon.error else "nvidia-imex-ctl was not run"
        if not reading.configured:  # --expect-imex, and this node has no configuration to run one from
            return _not_configured(reading, reading.config_why or "no node configuration", thresholds), []
        return [], [NotChecked(WHAT, why)]
    state = daemon_state(daemon.stdout)
    if state is None:
        if daemon.exit_code not in (0, None):
            said = _first_line(daemon) or f"exit status {daemon.exit_code}"
            return _daemon(f"the IMEX daemon did not answer (`{daemon.command}`: {said})", thresholds), []
        return [], [
            NotChecked(WHAT, f"`{daemon.command}` answered {_first_line(daemon)!r}, not a daemon state")
        ]
    found: list[Finding] = []
    if state != READY:
        found += _daemon(
            f"the IMEX daemon is {state}, not READY (`{daemon.command}`; DCGM's daemon status "
            f"{DAEMON_STATES[state]})",
            thresholds,
        )
    skipped: list[NotChecked] = []
    if domain is None or domain.stdout is None:
        if domain is not None and domain.error:
            skipped.append(NotChecked("IMEX domain", domain.error))
        elif state == READY:
            skipped.append(NotChecked("IMEX domain", "nvidia-imex-ctl -N -j was not run"))
        return found, skipped
    parsed = parse_domain(domain.stdout)
    if parsed is None:
        said = _first_line(domain) or f"exit status {domain.exit_code}"
        skipped.append(NotChecked("IMEX domain", f"`{domain.command}` gave no domain status ({said})"))
        return found, skipped
    me = own_member(parsed, reading.own_hosts, state)
    found += _domain(parsed, domain.command, thresholds, skipped, me if state != READY else None)
    return found, skipped


def own_member(domain: Domain, own_hosts: tuple[str, ...], state: str) -> Member | None:
    """The member that is this node: the one whose address (or name) is among this host's; where none is,
    the one member whose status is the local daemon's own answer when that is not READY. ``None`` when
    neither tells."""
    own = {h.lower() for h in own_hosts if h}
    for m in domain.members:
        if m.host.lower() in own or (m.host_name and m.host_name.lower() in own):
            return m
    if state == READY:
        return None
    same = [m for m in domain.members if m.status == state]
    return same[0] if len(same) == 1 else None


def _first_line(answer: CtlAnswer) -> str:
    for text in (answer.stdout or "", answer.stderr):
        for line in text.splitlines():
            if line.strip():
                return line.strip()[:200]
    return ""


def _not_configured(reading: ImexReading, said: str, rules: Thresholds) -> list[Finding]:
    rule = rules["imex_not_configured"]
    if not rule.enabled:
        return []
    return [
        rule.finding(
            WHAT,
            f"IMEX is expected here but not configured: {said} ({reading.nodes_config})",
            "write the addresses of the domain's nodes, one a line, into the node configuration "
            f"({reading.nodes_config}, or the file IMEX_NODE_CONFIG_FILE in config.cfg names) on every node, "
            "then `systemctl restart nvidia-imex`; drop --expect-imex where no IMEX daemon is meant to run",
        )
    ]


def _daemon(what: str, rules: Thresholds) -> list[Finding]:
    rule = rules["imex_daemon_not_ready"]
    if not rule.enabled:
        return []
    return [rule.finding(WHAT, what)]


def _domain(
    domain: Domain, command: str, rules: Thresholds, skipped: list[NotChecked], me: Member | None = None
) -> list[Finding]:
    """The members not READY (one finding each), the links between READY members not CONNECTED (one per
    pair), and the domain's own state where no member or link finding explains it. ``me``: this node's
    own member when its daemon is not READY, already reported as the daemon: it is not named again, nor
    are the other members' links to it (a daemon that is not ready is DISCONNECTED from every peer)."""
    bad_domain = domain.status in DOMAIN_BAD
    if domain.status != DOMAIN_UP and not bad_domain:
        skipped.append(NotChecked("IMEX domain", f"`{command}` reports the domain {domain.status!r}"))
    context = f"; the IMEX domain is {domain.status}" if bad_domain else ""
    others = [m for m in domain.members if me is None or m.index != me.index]
    down = [m for m in others if m.status != READY]
    issues: list[tuple[str, str]] = [
        (
            f"IMEX member {m.label}",
            f"IMEX member {m.label} is {m.status or 'without a status'}, not READY "
            f"({len(down)} of {len(others)} {'other ' if me else ''}members not ready{context})",
        )
        for m in down
    ]
    down_hosts = {m.host for m in down} | ({me.host} if me is not None else set())
    pairs: dict[tuple[str, str], list[str]] = {}
    for m in others:
        if m.status != READY:
            continue
        for peer, status in m.connections:
            if not peer or peer == m.host or peer in down_hosts or status == CONNECTED:
                continue
            a, b = sorted((m.host, peer))
            pairs.setdefault((a, b), []).append(f"{m.host} sees {peer} {status or 'without a status'}")
    by_host = {m.host: m.label for m in domain.members}
    for (a, b), seen in sorted(pairs.items()):
        la, lb = by_host.get(a, a), by_host.get(b, b)
        issues.append(
            (
                f"IMEX link {la} - {lb}",
                f"IMEX members {la} and {lb} are not connected ({'; '.join(seen)}{context})",
            )
        )
    member_rule, domain_rule = rules["imex_member_down"], rules["imex_domain_unhealthy"]
    if issues and member_rule.enabled:
        return [member_rule.finding(where, what) for where, what in issues]
    if not bad_domain or not domain_rule.enabled or (me is not None and not issues):
        return []  # a domain down only for want of this node's daemon: the daemon's finding says it
    named = "; ".join(where for where, _ in issues) or "every member READY and connected"
    return [
        domain_rule.finding(
            WHAT, f"the IMEX domain is {domain.status} (`{command}`): {named}", member_rule.remedy
        )
    ]
