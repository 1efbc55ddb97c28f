"""Link problems a topology shows by itself (pure): failing GPUs, slow PCIe links, NVLinks down, P2P off.

``doctor`` puts these beside what the probes measured. Each finding says where, what, and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputopo.model import GPU_NOT_ACCESSIBLE, GPU_NOT_RESPONDING, LinkKind, Topology

PROBLEM = "problem"
NOTE = "note"


@dataclass(frozen=True)
class Finding:
    """One thing wrong (``severity`` problem) or worth knowing (note), with its remedy in words."""

    where: str
    what: str
    remedy: str
    severity: str = PROBLEM


def link_findings(topo: Topology) -> list[Finding]:
    """Everything the topology itself says is wrong, problems first."""
    found: list[Finding] = []
    for g in topo.gpus:
        if g.failing:
            found.append(
                Finding(
                    g.label,
                    f"the GPU does not answer NVML ({g.error})",
                    "look for Xid errors in `dmesg`; drain the jobs and reset the GPU (`nvidia-smi -r -i "
                    f"{g.index}`) or reboot; if it keeps falling off the bus, reseat it or open an RMA",
                )
            )
        elif g.state == GPU_NOT_RESPONDING:
            found.append(
                Finding(
                    g.label,
                    f"the GPU did not answer NVML in time ({g.error})",
                    "look for Xid errors in `dmesg` (79: fallen off the bus) and for processes stuck on the "
                    f"GPU; `nvidia-smi -i {g.index}` hanging too confirms it; a reset or reboot clears it",
                )
            )
        elif g.state == GPU_NOT_ACCESSIBLE:
            found.append(
                Finding(
                    g.label,
                    f"not accessible from here ({g.error}): another job's or container's GPU",
                    "nothing to fix on the GPU; run where the GPU is allocated to you to check it",
                    severity=NOTE,
                )
            )
        elif g.mig_enabled:
            found.append(
                Finding(
                    g.label,
                    f"MIG is enabled ({len(g.mig_devices)} MIG devices): left out of probes and sets",
                    "NCCL does not run on MIG devices; `nvidia-smi -i "
                    f"{g.index} -mig 0` (then a GPU reset) turns MIG off if the GPU is meant for training",
                    severity=NOTE,
                )
            )
        elif g.pcie_below_max_while_busy and g.pcie is not None:
            p = g.pcie
            found.append(
                Finding(
                    g.label,
                    f"PCIe link runs at Gen{p.gen_current} x{p.width_current} while busy; it can do "
                    f"Gen{p.gen_max} x{p.width_max}",
                    "check the slot and riser, and the BIOS PCIe speed setting; "
                    "`nvidia-smi -q -d PCIE` shows the link, and `lspci -vv` the slot",
                )
            )
    for p in topo.nvlinks or ():
        if p.links_down and p.gpu < p.peer:
            found.append(
                Finding(
                    f"GPU{p.gpu}-GPU{p.peer}",
                    f"{p.links_down} of {p.links_up + p.links_down} NVLinks are down",
                    "`nvidia-smi nvlink -s` and `nvidia-smi nvlink -e` show the state and error counters; "
                    "on NVSwitch systems check nvidia-fabricmanager; a reset or reseat usually brings links "
                    "back, persistent errors mean hardware service",
                )
            )
    found.extend(_p2p_findings(topo))
    return sorted(found, key=lambda f: f.severity != PROBLEM)


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
