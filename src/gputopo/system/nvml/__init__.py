"""The one door to NVML: this package is the only code that names an NVML function, and its ``backend``
module the only ``pynvml`` import in gputopo. One module per kind of read: ``session`` (the session, its
``query`` door and ``Device``), ``answer`` (what a read gives back, the errors), ``inventory`` (what
``topo`` draws), ``health`` (health counters), ``fabric`` (NVLink fabric and platform), ``processes``
(kill-stale's lists), ``events`` (Xid events); ``backend`` (pynvml, or a test's fake).

NVML is loaded and initialised lazily, inside ``session()``, and shut down when the session ends; importing
this package does neither. Every pynvml error is turned into something of ours here (``Session.query``), so
nothing outside this package ever sees one. The rule, per call:

- a value the GPU or driver does not have (``NotSupported``, ``FunctionNotFound`` from a driver older than
  the bindings, ``InvalidArgument`` for an NVLink index past the last, ``NotFound``) returns ``None``,
  which the rest of gputopo shows as n/a;
- only a GPU that is gone (``GpuIsLost``, ``ResetRequired``, ``GpuNotFound``) raises ``DeviceFailed`` for
  that GPU, so the caller marks it "failing" and keeps reading the others;
- the handle refused for permission (``NoPermission``, or ``OperatingSystem``: "blocked by the operating
  system/cgroups") raises ``DeviceFailed`` with state "not accessible": GPUs hidden from a Slurm job;
- any other error (``Unknown``, ``NotReady``, ``InvalidState``, ``CorruptedInforom``, ``Timeout``,
  ``NoPermission`` on a single value, ...) blanks that one value and leaves a warning in
  ``Session.warnings``; the GPU's other values are still read;
- NVML that cannot start at all (no ``libnvidia-ml.so``, driver not loaded, driver/library mismatch)
  raises ``NvmlUnavailable``, a project error with exit code 3.

Every nvidia-ml-py from the lowest version pyproject allows is handled: names that newer bindings added
(``NVMLLibraryMismatchError``, ``NVML_ERROR_GPU_NOT_FOUND``, functions like ``nvmlDeviceGetNumaNodeId``)
are looked up with ``getattr``, never assumed.

Tests swap the backend (the object the ``nvml*`` functions are called on) with ``use_backend(fake)``; the
real backend is the ``pynvml`` module itself. A fake implements the functions named in ``NvmlBackend``, with
pynvml's names, arguments and return shapes, and raises pynvml's own ``NVMLError`` subclasses. The tests of
the real path load the real pynvml against a fake ``libnvidia-ml.so.1`` (tests/fakedriver).
"""

from gputopo.system.nvml.answer import (
    NOT_IN_BINDINGS,
    Answer,
    DeviceFailed,
    NvmlCallFailed,
    NvmlUnavailable,
    bitmask_ids,
    cuda_version_text,
    normalize_bus_id,
)
from gputopo.system.nvml.backend import (
    START_CALL,
    NvmlBackend,
    _pynvml,
    backend_overridden,
    library_present,
    set_backend,
    use_backend,
)
from gputopo.system.nvml.events import XidEventSet
from gputopo.system.nvml.fabric import FabricInfo, PlatformInfo
from gputopo.system.nvml.inventory import NvlinkEnd, RemoteKind
from gputopo.system.nvml.processes import ProcessList, ProcessListKind, process_list, process_name
from gputopo.system.nvml.session import Device, Session, session

__all__ = [
    "NOT_IN_BINDINGS",
    "START_CALL",
    "Answer",
    "Device",
    "DeviceFailed",
    "FabricInfo",
    "NvlinkEnd",
    "PlatformInfo",
    "NvmlBackend",
    "NvmlCallFailed",
    "NvmlUnavailable",
    "ProcessList",
    "ProcessListKind",
    "RemoteKind",
    "Session",
    "XidEventSet",
    "_pynvml",
    "backend_overridden",
    "bitmask_ids",
    "cuda_version_text",
    "library_present",
    "normalize_bus_id",
    "process_list",
    "process_name",
    "session",
    "set_backend",
    "use_backend",
]
