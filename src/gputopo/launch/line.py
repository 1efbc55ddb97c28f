"""From a chosen GPU set to the line that launches a job on it (pure: data in, data out).

``gputopo run`` executes this line and ``recommend --launch`` prints it. The line sets
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` (UUIDs where known, so a renumbering cannot
move the job), optionally wraps the command in ``torchrun --nproc-per-node K`` with ``--numa-binding node``
where everything that flag needs is there, and for jobs across nodes names the NICs nearest the chosen
GPUs in ``NCCL_IB_HCA``. What is found on the machine (torch's flags, ``numactl``) comes in as
``LaunchTools``; ``gputopo.system.launcher`` reads it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.findings import Finding
from gputopo.model import LaunchTools, LinkKind, Topology  # noqa: F401 - LaunchTools: as launch's callers know it

SCHEMA = "gputopo/launch/v1"

# NICs a GPU can use for GPUDirect RDMA or at least without crossing CPU sockets, nearest first. NODE and
# SYS NICs are left out: a GPU that only reaches a NIC through another host bridge or socket is better
# served by NCCL's own choice (PXN through a peer GPU) than by a NIC list that pins it there.
NIC_TIERS = (LinkKind.PIX, LinkKind.PXB, LinkKind.PHB)

# torch added ``--numa-binding`` to torchrun in 2.9 (torch/distributed/run.py; docs.pytorch.org/docs/2.9/
# elastic/numa.html). Its "node" mode binds each rank to the CPUs of the NUMA node of the GPU whose *local*
# index is the rank's, found through torch.cuda's PCI bus id, so it follows CUDA_VISIBLE_DEVICES; and it
# wraps the worker command in the ``numactl`` program, which must be installed (torch/numa/binding.py).
NUMA_BINDING_SINCE = "2.9"


@dataclass(frozen=True)
class LaunchPlan:
    """The launch: ``env`` to add, the full ``argv`` to run, and notes on what was left out and why."""

    gpus: tuple[int, ...]
    env: dict[str, str]
    argv: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def command(self) -> str:
        """The line to paste into a shell: ``VAR=value ... torchrun ... CMD``."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*assignments, shlex.join(self.argv)])

    def to_dict(self) -> dict[str, Any]:
        """The ``launch`` object of ``recommend --json`` and ``run --dry-run --json``."""
        return {
            "command": self.command,
            "env": dict(self.env),
            "argv": list(self.argv),
            "gpus": list(self.gpus),
            "notes": list(self.notes),
        }


def device_env(topo: Topology, gpus: Sequence[int], prefer_uuid: bool) -> dict[str, str]:
    """``CUDA_DEVICE_ORDER`` and ``CUDA_VISIBLE_DEVICES`` for ``gpus``: UUIDs when asked and all known."""
    uuids = [topo.gpu(g).uuid for g in gpus]
    if prefer_uuid and uuids and all(uuids):
        devices = ",".join(u for u in uuids if u)
    else:
        devices = ",".join(str(g) for g in gpus)
    # CUDA numbers devices fastest-first unless told to follow the PCI bus order nvidia-smi uses.
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": devices}


def nearest_nics(topo: Topology, gpus: Sequence[int]) -> tuple[list[str], list[str]]:
    """NIC names nearest each GPU (its best of PIX, then PXB, then PHB), in topology order, and notes.

    A NIC no chosen GPU reaches within PHB (a storage or management NIC on another socket) is left out.
    """
    notes: list[str] = []
    chosen: set[str] = set()
    unnamed: set[str] = set()
    for g in gpus:
        by_tier: dict[LinkKind, list[str]] = {}
        for nic in topo.nics:
            try:
                link = topo.matrix.link(f"GPU{g}", nic.label)
            except KeyError:
                continue
            if link is not None and link.kind in NIC_TIERS:
                by_tier.setdefault(link.kind, []).append(nic.label)
        nearest = next((by_tier[t] for t in NIC_TIERS if t in by_tier), [])
        chosen.update(nearest)
        if not nearest and topo.nics:
            notes.append(
                f"GPU{g} has no NIC within PHB; NCCL will reach the network through a peer or the CPU"
            )
    names: list[str] = []
    for nic in topo.nics:
        if nic.label not in chosen:
            continue
        name = nic.name or (nic.label if not nic.label.startswith("NIC") else None)
        if name is None:
            unnamed.add(nic.label)
        else:
            names.append(name)
    if unnamed:
        notes.append(
            f"{', '.join(sorted(unnamed))} have no device name in the input (no NIC Legend), so NCCL_IB_HCA "
            "cannot name them"
        )
    return names, notes


def build_launch(
    topo: Topology,
    gpus: Sequence[int],
    command: Sequence[str],
    *,
    torchrun: bool,
    nnodes: int = 1,
    tools: LaunchTools | None = None,
    prefer_uuid: bool = False,
    env_findings: Sequence[Finding] = (),
) -> LaunchPlan:
    """The launch of ``command`` on ``gpus``: environment, argv and notes (see the module docstring)."""
    tools = tools or LaunchTools()
    gpus = tuple(gpus)
    env = device_env(topo, gpus, prefer_uuid)
    notes: list[str] = []
    if nnodes > 1:
        names, nic_notes = nearest_nics(topo, gpus)
        notes.extend(nic_notes)
        if names:
            # The leading '=' makes NCCL compare every name exactly; without it mlx5_1 also picks mlx5_1x.
            env["NCCL_IB_HCA"] = "=" + ",".join(names)
        elif not topo.nics:
            notes.append("the input shows no NICs, so NCCL_IB_HCA is left to NCCL")
        else:
            notes.append("no NIC near the chosen GPUs has a name, so NCCL_IB_HCA is left to NCCL")
    argv: list[str] = []
    if torchrun:
        if tools.torchrun is None:
            notes.append("torch is not installed here; the line names torchrun as it would run elsewhere")
        argv.extend(tools.torchrun or ("torchrun",))
        argv.extend(["--nproc-per-node", str(len(gpus))])
        if nnodes > 1:
            argv.extend(["--nnodes", str(nnodes)])
            notes.append(
                "across nodes torchrun also needs the same --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                "--rdzv-id NAME on every node"
            )
        missing = numa_binding_missing(topo, gpus, tools)
        if missing:
            notes.append("no --numa-binding: " + "; ".join(missing))
        else:
            argv.extend(["--numa-binding", "node"])
        if command and not command[0].endswith(".py"):
            # torchrun runs its first argument with the Python interpreter unless told it is a program.
            argv.append("--no-python")
    argv.extend(command)
    notes.extend(f"{f.what}: {f.remedy}" for f in env_findings)
    return LaunchPlan(gpus=gpus, env=env, argv=tuple(argv), notes=tuple(notes))


def numa_binding_missing(topo: Topology, gpus: Sequence[int], tools: LaunchTools) -> list[str]:
    """What ``--numa-binding node`` would need and is not there (empty when it can be used)."""
    missing: list[str] = []
    if tools.numa_binding is None:
        missing.append("torch is not installed")
    elif not tools.numa_binding:
        version = f"torch {tools.torch_version}" if tools.torch_version else "this torch"
        missing.append(f"{version} has no torchrun --numa-binding (added in {NUMA_BINDING_SINCE})")
    no_affinity = [f"GPU{g}" for g in gpus if not _known(topo.gpu(g).cpu_affinity)]
    if no_affinity:
        missing.append(
            f"{', '.join(no_affinity)} {'has' if len(no_affinity) == 1 else 'have'} no CPU affinity"
        )
    if not tools.numactl:
        missing.append("numactl is not installed (torch runs it to bind)")
    return missing


def _known(value: str | None) -> bool:
    return bool(value and value.strip() and value.strip().upper() not in ("N/A", "NA", "-"))


def split_command(text: str) -> list[str]:
    """``--launch "CMD ..."`` as argv, the way a POSIX shell would split it; ``ValueError`` if unbalanced."""
    return shlex.split(text)


def is_torchrun(argv: Sequence[str]) -> bool:
    """True when ``argv`` already starts torchrun (``torchrun`` or ``python -m torch.distributed.run``)."""
    if not argv:
        return False
    if argv[0].rsplit("/", 1)[-1] == "torchrun":
        return True
    return (
        len(argv) >= 3
        and argv[1] == "-m"
        and argv[2] in ("torch.distributed.run", "torch.distributed.launch")
    )


def merged_env(base: Mapping[str, str], plan: LaunchPlan) -> dict[str, str]:
    """The child's environment: ``base`` with the plan's variables set on top."""
    return {**base, **plan.env}
