"""Reading a machine's topology: live (``system/``), saved ``topo -m`` text, JSON snapshots, samples."""

from __future__ import annotations

from pathlib import Path

from gputopo.errors import InputError
from gputopo.model import Topology

SAMPLE_PREFIX = "sample:"
# How NCCL topology XML begins (a pasted `topo -m` can begin with HTML tags, so not just "<").
NCCL_XML_STARTS = ("<?xml", "<system", "<graphs", "<!DOCTYPE")


def load_topology(spec: str | None) -> Topology:
    """The topology named by ``--input``, or this machine's when ``spec`` is ``None``.

    ``spec`` is ``sample:NAME``, a path to a JSON snapshot (``gputopo topo --json``), NCCL topology XML
    (``NCCL_TOPO_DUMP_FILE``: a ``.xml`` name or text starting ``<?xml``, ``<system``, ...), or saved
    ``nvidia-smi topo -m`` text. Raises ``InputError`` (exit 2) for anything unreadable and
    ``UnavailableError`` (exit 3) when reading live without an NVIDIA driver.
    """
    if spec is None:
        from gputopo.system.inventory import read_live

        return read_live()
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
    if path.suffix.lower() == ".xml" or text.lstrip("\ufeff \t\r\n").startswith(NCCL_XML_STARTS):
        from gputopo.topology.nccl_xml import parse_nccl_xml  # NCCL_TOPO_DUMP_FILE output

        return parse_nccl_xml(text, source=str(path))
    if text.lstrip().startswith("{"):
        from gputopo.topology import snapshot

        return snapshot.loads(text, source=str(path))
    from gputopo.topology.parse_smi import parse_topo_text

    return parse_topo_text(text, source=str(path))
