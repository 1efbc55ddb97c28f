"""What torch says about CUDA on this machine, asked from the parent before any rank starts.

The one question the parent process puts to torch; it lives here because ``ranks`` is the only room
that imports torch (lazily here, so importing this module costs nothing).
"""

from __future__ import annotations

import json
import sys


def cuda_unavailable() -> str | None:
    """Why torch cannot drive CUDA here, or ``None`` when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "no CUDA device is visible to torch"


def visible_bus_ids() -> dict[str, object]:
    """The PCI bus id of every device CUDA numbers here, by ordinal (0, 1, ...), as NVML spells it; or
    ``{"error": why}``. CUDA applies this process's ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``, and
    skips the GPUs it cannot drive (an old display card a CUDA release dropped): the answer is CUDA's
    own numbering, which NVML's cannot predict. ``cudaDeviceProp.pciDomainID/pciBusID/pciDeviceID``
    (CUDA Runtime API, ``cudaGetDeviceProperties``) are torch's ``pci_domain_id``/``pci_bus_id``/
    ``pci_device_id``."""
    import torch

    from gputopo.probe.plan.identity import cuda_bus_id

    if torch.version.cuda is None:
        return {"error": f"this torch ({torch.__version__}) is built without CUDA"}
    try:
        count = torch.cuda.device_count()
        ids = []
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            ids.append(cuda_bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id))
    except Exception as exc:  # noqa: BLE001 - any CUDA error means CUDA cannot answer
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    return {"bus_ids": ids}


if __name__ == "__main__":
    # ``python -m gputopo.probe.ranks.cuda``: the short child the parent asks (pool.launch.ask_cuda_bus_ids),
    # so that CUDA is never initialised in the parent, which forks torch's agent later.
    sys.stdout.write(json.dumps(visible_bus_ids()) + "\n")
