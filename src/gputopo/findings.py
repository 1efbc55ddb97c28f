"""The finding, and the rule row that makes it (pure); link problems a topology shows by itself: failing
GPUs, slow PCIe links, NVLinks down, P2P off; and NCCL settings in the environment that are meant for
debugging only.

``doctor`` puts these beside what the probes measured. Each finding says where, what, and what to do. A
finding a health rule makes is made by that rule (``Rule.finding``), so its severity, category, action and
remedy come from the rule's one row; the table of rows is ``health.rules``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gputopo.model import GPU_NOT_ACCESSIBLE, GPU_NOT_RESPONDING, Gpu, LinkKind, Topology

PROBLEM = "problem"
NOTE = "note"

SEVERITIES = (PROBLEM, NOTE)
# What a finding is about (docs/design.md, "The finding"): the subsystem, so a reader can filter and a
# scheduler can tell a bad GPU from a bad setting.
CATEGORIES = (
    "memory",
    "nvlink",
    "pcie",
    "compute",  # the per-GPU check: a GPU slow against its peers, or computing wrong bits
    "thermal",
    "power",
    "xid",
    "driver",
    "config",
    "topology",
    "process",
    "network",
)
# What to do, from least to most disruptive: "monitor" keeps an eye on it, "reset" a GPU reset (or
# reboot) clears it, "drain" take the node or GPU out of service now, "replace" hardware service,
# "config" a setting to change, "reboot" the node (NVML's node-reboot recovery action). Named after DCGM's
# health-response actions and NVML's recovery actions.
ACTIONS = ("none", "monitor", "reset", "drain", "replace", "config", "reboot")


@dataclass(frozen=True)
class Finding:
    """One thing wrong (``severity`` problem) or worth knowing (note), with its remedy in words.

    The one finding shape of every command that judges (docs/design.md): ``where`` names the place
    (``GPU3``, ``GPU0-GPU1``, ``NCCL_IB_HCA``), ``gpu`` the nvidia-smi index when the finding belongs to
    one GPU (``None`` for a pair, the node or a setting), ``category`` one of ``CATEGORIES``, ``what`` the
    evidence (counter values and window included), ``action`` one of ``ACTIONS``; ``rule`` the health rule
    that found it (``health.rules.RULES``), where one did.
    """

    where: str
    what: str
    remedy: str
    severity: str = PROBLEM
    gpu: int | None = None
    category: str = "topology"
    action: str = "none"
    rule: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The finding as the JSON object every output shows (the keys of docs/design.md's finding shape;
        ``rule`` is ``null`` where no health rule found it)."""
        return asdict(self)


# DCGM's own verdict for the signal a rule reads: "fail" (DCGM_HEALTH_RESULT_FAIL), "warn"
# (DCGM_HEALTH_RESULT_WARN), or "none" where DCGM's health watches have no such check.
DCGM_FAIL, DCGM_WARN, DCGM_NONE = "fail", "warn", "none"
# DCGM's health watches read GPUs and NVSwitches: a NIC port or a PCIe bridge's ACS has no DCGM verdict.
NOT_DCGM = "DCGM's health watches read GPUs and NVSwitches, not NIC ports or PCIe bridges"
# The finding actions that take a node out of service with ``check --drain``; "monitor", "config" and
# "none" never do (a note never does either: only problems drain).
DRAIN_ACTIONS = ("reset", "drain", "replace", "reboot")
# What stands for the GPU's index in a rule's remedy: filled in a finding, shown as ``N`` in the table.
GPU_INDEX = "{i}"


@dataclass(frozen=True)
class Rule:
    """One health rule. ``limit`` is the number the rule compares against (``None`` when the rule is a
    plain yes/no); ``unit`` says what the number counts; ``source`` where the rule comes from;
    ``remedy_template`` what to do, in short, ``{i}`` standing for the GPU's index (``remedy`` shows it as
    ``N``). ``dcgm`` is DCGM's own severity for the same signal (``fail``, ``warn`` or ``none``) and
    ``dcgm_source`` where DCGM says so; ``why`` says why gputopo's severity or action differs from DCGM's
    (empty where they agree: problem with a drain action = fail, note or a monitor action = warn), or,
    with ``dcgm`` ``none``, why DCGM has no verdict (listed as n/a)."""

    name: str
    category: str
    severity: str
    action: str
    limit: float | None
    unit: str
    meaning: str
    source: str
    remedy_template: str = ""
    dcgm: str = DCGM_NONE
    dcgm_source: str = ""
    why: str = ""
    enabled: bool = True

    @property
    def remedy(self) -> str:
        """The remedy as the rule table shows it (``N`` for the GPU's index)."""
        return self.remedy_template.replace(GPU_INDEX, "N")

    @property
    def drains(self) -> bool:
        """Whether a finding of this rule takes the node out of service under ``--drain``."""
        return self.severity == PROBLEM and self.action in DRAIN_ACTIONS

    def finding(
        self,
        where: str,
        what: str,
        remedy: str | None = None,
        *,
        gpu: int | None = None,
        severity: str | None = None,
        action: str | None = None,
        category: str | None = None,
    ) -> Finding:
        """This rule's finding at ``where``; ``what`` is the evidence (values, window, place).

        The severity, category, action and remedy are the row's (the remedy with ``gpu``'s index in it),
        so each is written once. A caller passes one only where the evidence decides it: a remedy that
        names the very port, bridge or test; a note for a port no GPU uses; DCGM's own status of a test.
        """
        if remedy is None:
            remedy = self.remedy_template.replace(GPU_INDEX, str(gpu)) if gpu is not None else self.remedy
        return Finding(
            where,
            what,
            remedy,
            severity or self.severity,
            gpu=gpu,
            category=category or self.category,
            action=action or self.action,
            rule=self.name,
        )

    def to_json(self) -> dict[str, Any]:
        """The row as ``check --list-rules --json`` prints it."""
        return {
            "name": self.name,
            "category": self.category,
            "limit": self.limit,
            "unit": self.unit,
            "severity": self.severity,
            "action": self.action,
            "drains": self.drains,
            "dcgm": self.dcgm,
            "dcgm_source": self.dcgm_source,
            "why": self.why,
            "meaning": self.meaning,
            "remedy": self.remedy,
            "source": self.source,
            "enabled": self.enabled,
        }


def finding_from_json(doc: dict[str, Any]) -> Finding:
    """A finding read back from ``to_json``'s object (older documents without the newer keys too)."""
    return Finding(
        where=str(doc.get("where", "")),
        what=str(doc.get("what", "")),
        remedy=str(doc.get("remedy", "")),
        severity=str(doc.get("severity", PROBLEM)),
        gpu=doc.get("gpu") if isinstance(doc.get("gpu"), int) else None,
        category=str(doc.get("category") or "topology"),
        action=str(doc.get("action") or "none"),
        rule=str(doc["rule"]) if isinstance(doc.get("rule"), str) else None,
    )


def link_findings(topo: Topology) -> list[Finding]:
    """Everything the topology itself says is wrong, problems first."""
    found = [f for f in map(_gpu_finding, topo.gpus) if f is not None]
    found.extend(_nvlink_findings(topo))
    found.extend(_p2p_findings(topo))
    return sorted(found, key=lambda f: f.severity != PROBLEM)


def _gpu_finding(g: Gpu) -> Finding | None:
    """What a GPU's own state says (the first that applies): it does not answer NVML, or not in time, it is
    another job's, MIG is on, or its PCIe link runs below its best while busy."""

    def on_gpu(
        what: str, remedy: str, category: str, action: str = "reset", severity: str = PROBLEM
    ) -> Finding:
        return Finding(g.label, what, remedy, severity, gpu=g.index, category=category, action=action)

    if g.failing:
        return on_gpu(
            f"the GPU does not answer NVML ({g.error})",
            "look for Xid errors in `dmesg`; drain the jobs and reset the GPU (`nvidia-smi -r -i "
            f"{g.index}`) or reboot; if it keeps falling off the bus, reseat it or open an RMA",
            "driver",
        )
    if g.state == GPU_NOT_RESPONDING:
        return on_gpu(
            f"the GPU did not answer NVML in time ({g.error})",
            "look for Xid errors in `dmesg` (79: fallen off the bus) and for processes stuck on the "
            f"GPU; `nvidia-smi -i {g.index}` hanging too confirms it; a reset or reboot clears it",
            "driver",
        )
    if g.state == GPU_NOT_ACCESSIBLE:
        return on_gpu(
            f"not accessible from here ({g.error}): another job's or container's GPU",
            "nothing to fix on the GPU; run where the GPU is allocated to you to check it",
            "config",
            "none",
            NOTE,
        )
    if g.mig_enabled:
        return on_gpu(
            f"MIG is enabled ({len(g.mig_devices)} MIG devices): left out of probes and sets",
            "NCCL does not run on MIG devices; `nvidia-smi -i "
            f"{g.index} -mig 0` (then a GPU reset) turns MIG off if the GPU is meant for training",
            "config",
            "none",
            NOTE,
        )
    if g.pcie_below_max_while_busy and g.pcie is not None:
        p = g.pcie
        return on_gpu(
            f"PCIe link runs at Gen{p.gen_current} x{p.width_current} while busy; it can do "
            f"Gen{p.gen_max} x{p.width_max}",
            "check the slot and riser, and the BIOS PCIe speed setting; "
            "`nvidia-smi -q -d PCIE` shows the link, and `lspci -vv` the slot",
            "pcie",
            "monitor",
        )
    return None


_NVLINK_REMEDY = (
    "`nvidia-smi nvlink -s` and `nvidia-smi nvlink -e` show the state and error counters; "
    "on NVSwitch systems check nvidia-fabricmanager; a reset or reseat usually brings links "
    "back, persistent errors mean hardware service"
)


def _nvlink_findings(topo: Topology) -> list[Finding]:
    """NVLinks down. A link to an NVSwitch belongs to its GPU, not to a pair (every pair of that GPU
    counts it): one finding per GPU, "GPU3: 2 of its 18 NVLinks are down". A direct GPU-GPU link (a
    bridge, an NVLink mesh) is the pair's: one finding per pair."""
    found: list[Finding] = []
    switch: dict[int, tuple[int, int]] = {}
    for p in topo.nvlinks or ():
        if p.switch_up or p.switch_down:
            switch.setdefault(p.gpu, (p.switch_up, p.switch_down))
    for gpu, (up, down) in sorted(switch.items()):
        if down:
            found.append(
                Finding(
                    f"GPU{gpu}",
                    f"GPU{gpu}: {down} of its {up + down} NVLinks are down (links to the NVSwitches, which "
                    "every peer's traffic crosses)",
                    _NVLINK_REMEDY,
                    gpu=gpu,
                    category="nvlink",
                    action="reset",
                )
            )
    for p in topo.nvlinks or ():
        up, down = p.links_up - p.switch_up, p.links_down - p.switch_down
        if down and p.gpu < p.peer:
            found.append(
                Finding(
                    f"GPU{p.gpu}-GPU{p.peer}",
                    f"{down} of {up + down} NVLinks are down",
                    _NVLINK_REMEDY,
                    category="nvlink",
                    action="reset",
                )
            )
    return found


def _p2p_findings(topo: Topology) -> list[Finding]:
    """P2P read/write not OK. Over NVLink or PCIe switches that is a problem (it should work), one per
    pair; through the CPU it is common (chipset or IOMMU), so one note per code: NCCL stages through
    host memory there."""
    if not topo.p2p or "read" not in topo.p2p:
        return []
    problems: list[Finding] = []
    through_cpu: dict[str, list[str]] = {}
    gpus = topo.gpus
    for i, a in enumerate(gpus):
        for j in range(i + 1, len(gpus)):
            b = gpus[j]
            codes = {topo.p2p[c][i][j] for c in ("read", "write") if c in topo.p2p}
            codes.discard("OK")
            if not codes or None in codes:
                continue
            code = "/".join(sorted(c for c in codes if c))
            link = topo.gpu_link(a.index, b.index)
            pair = f"GPU{a.index}-GPU{b.index}"
            if link is not None and link.kind.rank <= LinkKind.PXB.rank:
                problems.append(
                    Finding(
                        pair,
                        f"P2P read/write reported {code} over {link.code}, where it should work",
                        "check that nvidia-fabricmanager runs (NVSwitch), that the driver is current, and "
                        "that the IOMMU/ACS is off for these GPUs; until then expect slower all-reduce here",
                        category="config",
                        action="config",
                    )
                )
            else:
                through_cpu.setdefault(code, []).append(pair)
    notes = [
        Finding(
            ", ".join(pairs),
            f"P2P read/write reported {code} on {len(pairs)} pair(s) that connect through the CPU (common)",
            "NCCL copies through host memory on these pairs; prefer GPU sets without them for speed",
            NOTE,
        )
        for code, pairs in through_cpu.items()
    ]
    return problems + notes


# --- NCCL settings in the environment -----------------------------------------------------------------------

# NCCL's environment documentation (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) files these
# under "Debugging": they "should not be used in production nor retained in scripts ... Keeping them set may
# result in sub-optimal behavior, crashes, or hangs". What each does, in our words:
NCCL_DEBUG_ONLY = {
    "NCCL_P2P_DISABLE": "turns off direct GPU-to-GPU copies over NVLink and PCIe, so every transfer goes "
    "through host memory",
    "NCCL_P2P_LEVEL": "overrides how far apart two GPUs may be for NCCL to copy between them directly "
    "(NCCL picks this from the topology by itself)",
    "NCCL_NET_GDR_LEVEL": "overrides how close a NIC must be to a GPU for GPUDirect RDMA (NCCL picks this "
    "from the topology by itself)",
    "NCCL_ALGO": "forces the collective algorithms (Ring, Tree, ...) instead of NCCL's per-size tuning",
    "NCCL_PROTO": "forces the protocols (LL, LL128, Simple) instead of NCCL's per-size tuning",
}


def nccl_env_findings(env: Mapping[str, str], nic_names: Sequence[str] = ()) -> list[Finding]:
    """NCCL settings in ``env`` that hurt a production job, each with a remedy; never fatal.

    Debugging-only variables are problems. ``NCCL_IB_HCA`` without its leading ``=`` matches by prefix:
    NCCL strips an optional ``^`` and then an optional ``=`` from the whole value, and only with the ``=``
    compares names exactly (``ncclIbInit`` in NCCL's net_ib code: ``searchNot``/``searchExact``), so
    ``mlx5_1`` also selects ``mlx5_10`` to ``mlx5_19``. That is a problem when ``nic_names`` (the machine's
    NICs) shows an entry picking up a NIC it does not name, and a note otherwise.
    """
    found: list[Finding] = []
    for name, does in NCCL_DEBUG_ONLY.items():
        value = env.get(name)
        if value is None:
            continue
        found.append(
            Finding(
                f"{name}={value}",
                f"{name}={value} {does}; NCCL lists it among the variables for debugging, not for production",
                f"unset it (`unset {name}`) and remove it from job scripts, ~/.bashrc, /etc/nccl.conf and "
                "container images, unless it is a deliberate, dated workaround",
                category="config",
                action="config",
            )
        )
    hca = env.get("NCCL_IB_HCA")
    if hca is not None and hca.strip():
        found.extend(_ib_hca_findings(hca.strip(), nic_names))
    return found


def _ib_hca_findings(value: str, nic_names: Sequence[str]) -> list[Finding]:
    """``NCCL_IB_HCA`` entries that name one device but, lacking the leading ``=``, match as prefixes.

    An entry that ends in ``_<number>`` or is a NIC's full name is meant as one device (``mlx5_1``); one
    that is neither (``mlx5``, ``mlx5_bond``) is a deliberate family prefix and is fine as it is.
    """
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    if body.startswith("="):
        return []
    entries = [e.strip() for e in body.split(",") if e.strip()]
    inner_eq = [e for e in entries if e.startswith("=")]
    devices = [e.split(":", 1)[0].lstrip("=") for e in entries]
    single = [d for d in devices if _one_device(d, nic_names)]
    if not single and not inner_eq:
        return []
    verb = "leaves out" if exclude else "selects"
    extra = {
        d: sorted(n for n in nic_names if n != d and n.startswith(d) and n not in devices) for d in single
    }
    extra = {d: names for d, names in extra.items() if names}
    if extra:
        shown = "; ".join(f"{d} also matches {', '.join(names)}" for d, names in extra.items())
        what = f"NCCL_IB_HCA={value} matches by prefix, so it {verb} more NICs than it names ({shown})"
        severity = PROBLEM
    else:
        example = single[0] if single else "mlx5_1"
        what = f"NCCL_IB_HCA={value} matches NIC names by prefix ({example} also matches {example}0 and up)"
        severity = NOTE
    if inner_eq:
        what += f"; the '=' inside the list ({', '.join(inner_eq)}) is read as part of a name"
    remedy = _ib_hca_remedy(exclude, entries, devices, nic_names)
    return [Finding("NCCL_IB_HCA", what, remedy, severity, category="config", action="config")]


def _one_device(name: str, nic_names: Sequence[str]) -> bool:
    return bool(re.search(r"_\d+$", name)) or name in nic_names


def _ib_hca_remedy(exclude: bool, entries: list[str], devices: list[str], nic_names: Sequence[str]) -> str:
    """The exact form. NCCL applies a leading '=' to the whole list: family prefixes must be spelled out."""
    lead = "^=" if exclude else "="
    exact: list[str] = []
    for entry, device in zip(entries, devices, strict=True):
        port = entry.split(":", 1)[1] if ":" in entry else None
        if _one_device(device, nic_names):
            names = [device]
        else:  # a family prefix: its members on this machine, when known
            names = sorted(n for n in nic_names if n.startswith(device))
            if not names:
                return (
                    f"write the full device names after one leading '=' (NCCL_IB_HCA={lead}mlx5_0,mlx5_1): "
                    "the '=' applies to the whole list, so a family prefix cannot stay in it"
                )
        exact += [f"{n}:{port}" if port else n for n in names]
    return f"write NCCL_IB_HCA={lead}{','.join(exact)}: a leading '=' makes every name in the list exact"
