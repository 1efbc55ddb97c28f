"""Reading a machine's topology: live (``system/``), saved ``topo -m`` text, JSON snapshots, samples."""

from __future__ import annotations

from pathlib import Path

from gputopo.errors import InputError
from gputopo.model import Topology

SAMPLE_PREFIX = "sample:"


def load_topology(spec: str | None, nvml_timeout_s: float | None = None) -> Topology:
    """The topology named by ``--input``, or this machine's when ``spec`` is ``None``.

    ``spec`` is ``sample:NAME``, a path to a JSON snapshot (``gputopo topo --json``), or a path to saved
    ``nvidia-smi topo -m`` text. Raises ``InputError`` (exit 2) for anything unreadable and
    ``UnavailableError`` (exit 3) when reading live without an NVIDIA driver. ``nvml_timeout_s`` bounds
    each live NVML read (``--nvml-timeout``; default ``system.nvml_worker.DEFAULT_TIMEOUT_S``).
    """
    if spec is None:
        from gputopo.system.inventory import read_live

        return read_live() if nvml_timeout_s is None else read_live(nvml_timeout_s=nvml_timeout_s)
    if spec.startswith(SAMPLE_PREFIX):
        from gputopo.topology import samples

        return samples.load(spec[len(SAMPLE_PREFIX) :])
    path = Path(spec)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(
            f"--input {spec}: no such file",
            "give a saved `nvidia-smi topo -m` output, a JSON snapshot, "
            "or sample:NAME (gputopo topo --list-samples)",
        ) from None
    except IsADirectoryError:
        raise InputError(f"--input {spec}: is a folder, not a file", "name the file itself") from None
    except OSError as exc:
        raise InputError(
            f"--input {spec}: cannot read ({exc.strerror})", "check the path and its permissions"
        ) from None
    text = raw.decode("utf-8", errors="replace")
    if text.lstrip().startswith("{"):
        from gputopo.topology import snapshot

        return snapshot.loads(text, source=str(path))
    from gputopo.topology.parse_smi import parse_topo_text

    return parse_topo_text(text, source=str(path))
