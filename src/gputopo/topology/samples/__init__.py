"""Built-in sample machines for ``--input sample:NAME``: typical boxes, described by us.

Each sample is written as its link matrix (in ``nvidia-smi topo -m`` codes) plus what the box is made
of. They are descriptions of common machine types, not captures of particular machines: fields a
description cannot know (UUIDs, minor numbers, live PCIe state) stay ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.errors import InputError
from gputopo.model import Gpu, Matrix, Nic, PcieLink, Topology


@dataclass(frozen=True)
class Sample:
    """A described machine: a one-line summary and the parts its Topology is built from."""

    name: str
    summary: str
    gpu_name: str
    pcie_gen: int
    matrix: str
    cpu_affinity: Sequence[str]
    numa_affinity: Sequence[str]
    nics: Sequence[tuple[str, str]] = ()
    bus_ids: Sequence[str] = ()


def _bus_ids(buses: str) -> tuple[str, ...]:
    return tuple(f"00000000:{b}:00.0" for b in buses.split())


SAMPLES: dict[str, Sample] = {
    s.name: s
    for s in (
        Sample(
            name="seed-8gpu-nv4",
            summary="8 GPUs, NVLink bridges on pairs 0-1 2-3 4-5 6-7 (NV4), NODE in a socket, SYS across two",
            gpu_name="NVIDIA RTX A6000",
            pcie_gen=4,
            matrix="""
                X    NV4  NODE NODE SYS  SYS  SYS  SYS
                NV4  X    NODE NODE SYS  SYS  SYS  SYS
                NODE NODE X    NV4  SYS  SYS  SYS  SYS
                NODE NODE NV4  X    SYS  SYS  SYS  SYS
                SYS  SYS  SYS  SYS  X    NV4  NODE NODE
                SYS  SYS  SYS  SYS  NV4  X    NODE NODE
                SYS  SYS  SYS  SYS  NODE NODE X    NV4
                SYS  SYS  SYS  SYS  NODE NODE NV4  X
            """,
            cpu_affinity=["0-31,64-95"] * 4 + ["32-63,96-127"] * 4,
            numa_affinity=["0"] * 4 + ["1"] * 4,
            bus_ids=_bus_ids("1B 1C 3D 3E 88 89 B1 B2"),
        ),
        Sample(
            name="quad-nv4-pairs-2socket",
            summary="4 GPUs, NVLink bridges on pairs 0-1 and 2-3 (NV4), one pair per socket (SYS across)",
            gpu_name="NVIDIA RTX A6000",
            pcie_gen=4,
            matrix="""
                X    NV4  SYS  SYS
                NV4  X    SYS  SYS
                SYS  SYS  X    NV4
                SYS  SYS  NV4  X
            """,
            cpu_affinity=["0-15,32-47"] * 2 + ["16-31,48-63"] * 2,
            numa_affinity=["0"] * 2 + ["1"] * 2,
            bus_ids=_bus_ids("1B 1C 88 89"),
        ),
        Sample(
            name="dgx1-v100",
            summary="DGX-1 style: 8x V100 SXM2 in a hybrid cube mesh (NV1/NV2), 4 NICs, two sockets",
            gpu_name="Tesla V100-SXM2-32GB",
            pcie_gen=3,
            matrix="""
                X    NV1  NV1  NV2  NV2  SYS  SYS  SYS  PIX  SYS  PHB  SYS
                NV1  X    NV2  NV1  SYS  NV2  SYS  SYS  PIX  SYS  PHB  SYS
                NV1  NV2  X    NV2  SYS  SYS  NV1  SYS  PHB  SYS  PIX  SYS
                NV2  NV1  NV2  X    SYS  SYS  SYS  NV1  PHB  SYS  PIX  SYS
                NV2  SYS  SYS  SYS  X    NV1  NV1  NV2  SYS  PIX  SYS  PHB
                SYS  NV2  SYS  SYS  NV1  X    NV2  NV1  SYS  PIX  SYS  PHB
                SYS  SYS  NV1  SYS  NV1  NV2  X    NV2  SYS  PHB  SYS  PIX
                SYS  SYS  SYS  NV1  NV2  NV1  NV2  X    SYS  PHB  SYS  PIX
                PIX  PIX  PHB  PHB  SYS  SYS  SYS  SYS  X    SYS  PHB  SYS
                SYS  SYS  SYS  SYS  PIX  PIX  PHB  PHB  SYS  X    SYS  PHB
                PHB  PHB  PIX  PIX  SYS  SYS  SYS  SYS  PHB  SYS  X    SYS
                SYS  SYS  SYS  SYS  PHB  PHB  PIX  PIX  SYS  PHB  SYS  X
            """,
            cpu_affinity=["0-19,40-59"] * 4 + ["20-39,60-79"] * 4,
            numa_affinity=["0"] * 4 + ["1"] * 4,
            nics=(("mlx5_0", "mlx5_0"), ("mlx5_2", "mlx5_2"), ("mlx5_1", "mlx5_1"), ("mlx5_3", "mlx5_3")),
            bus_ids=_bus_ids("06 07 0A 0B 85 86 89 8A"),
        ),
        Sample(
            name="hgx-h100-nvswitch",
            summary="HGX H100 style: 8x H100 SXM through NVSwitch (NV18 all pairs), 8 NICs, two sockets",
            gpu_name="NVIDIA H100 80GB HBM3",
            pcie_gen=5,
            matrix="""
                X    NV18 NV18 NV18 NV18 NV18 NV18 NV18 PIX  NODE NODE NODE SYS  SYS  SYS  SYS
                NV18 X    NV18 NV18 NV18 NV18 NV18 NV18 NODE PIX  NODE NODE SYS  SYS  SYS  SYS
                NV18 NV18 X    NV18 NV18 NV18 NV18 NV18 NODE NODE PIX  NODE SYS  SYS  SYS  SYS
                NV18 NV18 NV18 X    NV18 NV18 NV18 NV18 NODE NODE NODE PIX  SYS  SYS  SYS  SYS
                NV18 NV18 NV18 NV18 X    NV18 NV18 NV18 SYS  SYS  SYS  SYS  PIX  NODE NODE NODE
                NV18 NV18 NV18 NV18 NV18 X    NV18 NV18 SYS  SYS  SYS  SYS  NODE PIX  NODE NODE
                NV18 NV18 NV18 NV18 NV18 NV18 X    NV18 SYS  SYS  SYS  SYS  NODE NODE PIX  NODE
                NV18 NV18 NV18 NV18 NV18 NV18 NV18 X    SYS  SYS  SYS  SYS  NODE NODE NODE PIX
                PIX  NODE NODE NODE SYS  SYS  SYS  SYS  X    NODE NODE NODE SYS  SYS  SYS  SYS
                NODE PIX  NODE NODE SYS  SYS  SYS  SYS  NODE X    NODE NODE SYS  SYS  SYS  SYS
                NODE NODE PIX  NODE SYS  SYS  SYS  SYS  NODE NODE X    NODE SYS  SYS  SYS  SYS
                NODE NODE NODE PIX  SYS  SYS  SYS  SYS  NODE NODE NODE X    SYS  SYS  SYS  SYS
                SYS  SYS  SYS  SYS  PIX  NODE NODE NODE SYS  SYS  SYS  SYS  X    NODE NODE NODE
                SYS  SYS  SYS  SYS  NODE PIX  NODE NODE SYS  SYS  SYS  SYS  NODE X    NODE NODE
                SYS  SYS  SYS  SYS  NODE NODE PIX  NODE SYS  SYS  SYS  SYS  NODE NODE X    NODE
                SYS  SYS  SYS  SYS  NODE NODE NODE PIX  SYS  SYS  SYS  SYS  NODE NODE NODE X
            """,
            cpu_affinity=["0-55,112-167"] * 4 + ["56-111,168-223"] * 4,
            numa_affinity=["0"] * 4 + ["1"] * 4,
            nics=tuple((f"NIC{i}", f"mlx5_{i}") for i in range(8)),
            bus_ids=_bus_ids("18 2A 3A 5D 9A AB BA DB"),
        ),
        Sample(
            name="pcie-8gpu-2socket",
            summary="8 PCIe GPUs, two per switch (PIX), switches paired (PXB), two sockets (SYS), 2 NICs",
            gpu_name="NVIDIA L40S",
            pcie_gen=4,
            matrix="""
                X    PIX  PXB  PXB  SYS  SYS  SYS  SYS  PIX  SYS
                PIX  X    PXB  PXB  SYS  SYS  SYS  SYS  PIX  SYS
                PXB  PXB  X    PIX  SYS  SYS  SYS  SYS  PXB  SYS
                PXB  PXB  PIX  X    SYS  SYS  SYS  SYS  PXB  SYS
                SYS  SYS  SYS  SYS  X    PIX  PXB  PXB  SYS  PIX
                SYS  SYS  SYS  SYS  PIX  X    PXB  PXB  SYS  PIX
                SYS  SYS  SYS  SYS  PXB  PXB  X    PIX  SYS  PXB
                SYS  SYS  SYS  SYS  PXB  PXB  PIX  X    SYS  PXB
                PIX  PIX  PXB  PXB  SYS  SYS  SYS  SYS  X    SYS
                SYS  SYS  SYS  SYS  PIX  PIX  PXB  PXB  SYS  X
            """,
            cpu_affinity=["0-23,48-71"] * 4 + ["24-47,72-95"] * 4,
            numa_affinity=["0"] * 4 + ["1"] * 4,
            nics=(("NIC0", "mlx5_0"), ("NIC1", "mlx5_1")),
            bus_ids=_bus_ids("1A 1B 3C 3D 9A 9B BC BD"),
        ),
        Sample(
            name="workstation-2gpu-nvlink",
            summary="Workstation: 2x RTX 3090 joined by an NVLink bridge (NV4), one socket",
            gpu_name="NVIDIA GeForce RTX 3090",
            pcie_gen=4,
            matrix="""
                X    NV4
                NV4  X
            """,
            cpu_affinity=["0-31"] * 2,
            numa_affinity=["N/A"] * 2,
            bus_ids=_bus_ids("01 21"),
        ),
        Sample(
            name="dgx2-v100-16gpu",
            summary="DGX-2 style: 16x V100 SXM3 through NVSwitch (NV6 all pairs), two sockets",
            gpu_name="Tesla V100-SXM3-32GB",
            pcie_gen=3,
            matrix="\n".join(" ".join("X" if i == j else "NV6" for j in range(16)) for i in range(16)),
            cpu_affinity=["0-23,48-71"] * 8 + ["24-47,72-95"] * 8,
            numa_affinity=["0"] * 8 + ["1"] * 8,
            bus_ids=_bus_ids("34 36 39 3B 57 59 5C 5E B7 B9 BC BE E0 E2 E5 E7"),
        ),
    )
}


def names() -> list[str]:
    """Names of the built-in samples, in a stable order."""
    return list(SAMPLES)


def load(name: str) -> Topology:
    """The Topology of sample ``name``; ``InputError`` (exit 2) listing the samples if unknown."""
    sample = SAMPLES.get(name)
    if sample is None:
        raise InputError(
            f"no sample machine named {name!r}",
            f"samples: {', '.join(SAMPLES)} (gputopo topo --list-samples)",
        )
    return build(sample)


def build(sample: Sample) -> Topology:
    """Turn a sample description into a Topology."""
    rows = [line.split() for line in sample.matrix.strip().splitlines()]
    n_gpus = len(sample.cpu_affinity)
    gpus = tuple(
        Gpu(
            index=i,
            name=sample.gpu_name,
            pci_bus_id=sample.bus_ids[i] if sample.bus_ids else None,
            cpu_affinity=sample.cpu_affinity[i],
            numa_affinity=sample.numa_affinity[i],
            pcie=PcieLink(gen_max=sample.pcie_gen, width_max=16),
        )
        for i in range(n_gpus)
    )
    nics = tuple(Nic(label=label, name=name) for label, name in sample.nics)
    labels = tuple([g.label for g in gpus] + [n.label for n in nics])
    return Topology(
        source=f"sample:{sample.name}",
        gpus=gpus,
        nics=nics,
        matrix=Matrix(labels, tuple(tuple(r) for r in rows)),
    )
