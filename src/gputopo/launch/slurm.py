"""The Slurm job a probe runs in: its nodes, this node's place among them, and the GPUs Slurm gave it.

``gputopo probe`` is started once per node with ``srun``; each copy reads its defaults for a torchrun-style
rendezvous (how many nodes, which one am I, whose address is the rendezvous) from the environment Slurm
set for it. Pure: it takes the environment as a mapping and, optionally, a way to ask Slurm itself to
expand a node list (``gputopo.system.scontrol.hostnames``), and touches nothing.

What Slurm puts in a task's environment, and why the step's variables come first
------------------------------------------------------------------------------------
Read in Slurm's source (SchedMD/slurm), ``src/common/env.c``, ``env_array_for_step``: inside an ``srun``
step ``SLURM_STEP_NODELIST`` and ``SLURM_STEP_NUM_NODES`` describe the *step*, and so do the obsolete
``SLURM_NNODES`` and ``SLURM_NODEID`` (slurmstepd sets ``SLURM_NODEID`` as the alias of
``SLURM_STEP_NODEID``), while ``SLURM_JOB_NODELIST`` and ``SLURM_JOB_NUM_NODES`` keep describing the whole
*job*. For ``srun -N2`` inside a four-node job, node id 1 is the step's second node, not the job's: pairing
``SLURM_NODEID`` with ``SLURM_JOB_NODELIST`` would name the wrong host. So the step's list and count are
read first, the job's only outside a step (a batch script, where the node id is 0).
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gputopo.errors import UsageError

# torchrun's c10d rendezvous listens here when --rdzv-endpoint names no port: torch 2.14,
# torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, ``DEFAULT_PORT = 29400`` (used by
# ``parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)``; torch/distributed/run.py's help
# says the same: "If no port number is specified HOST_NODE_ADDR defaults to 29400").
DEFAULT_RDZV_PORT = 29400

# Under Slurm the rendezvous port comes from the job id instead (``rendezvous_port``): every node of the
# job computes the same one, and two jobs whose first node is the same machine do not meet on 29400, where
# torch's store would make the second job a client of the first's (c10d_rendezvous_backend.py,
# ``_create_tcp_store``: when hosting fails it retries as a client) and die when that job ends. The range
# starts above torch's two defaults (29400 here, 29500 for MASTER_PORT in torch/distributed/run.py) and
# ends below Linux's ephemeral ports (``ip_local_port_range`` defaults to 32768-60999,
# Documentation/networking/ip-sysctl.rst), so an outgoing connection never holds it by chance.
SLURM_RDZV_PORT_LOW = 29501
SLURM_RDZV_PORT_HIGH = 32767  # inclusive

# Slurm refuses ranges of more than 64K hosts (src/common/hostlist.c, MAX_RANGE); so do we, so that a typo
# such as ``n[0-999999999]`` is an error, not a list that fills the memory.
MAX_HOSTS = 64 * 1024

# Slurm's own fallback value when gres.conf names no device files (older src/plugins/gres/common/
# gres_common.c, common_gres_set_env): Slurm gave GPUs but cannot say which.
_NO_DEV_FILES = "NoDevFiles"

_DIGITS = re.compile(r"[0-9]+")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")

_HOSTLIST_HINT = "expected a Slurm hostlist such as node[01-04,07]; `scontrol show hostnames EXPR` expands it"


def expand_hostlist(text: str) -> list[str]:
    """The host names a Slurm hostlist expression stands for, in Slurm's order.

    The syntax, as Slurm documents it (the ``Slurm::Hostlist`` man page of libslurm-perl: "one or more
    hostnames or bracketed hostlists separated by either ',' or whitespace. A bracketed hostlist is denoted
    by a common prefix followed by a list of numeric ranges contained within brackets: e.g.
    tux[0-5,12,20-25]"; slurm_hostlist_create(3): "linux[1-3,6] represents linux1, linux2, linux3, and
    linux6") and as its parser ``src/common/hostlist.c`` implements it:

    - ``node[01-04,07]``: the zero padding of each range comes from its lower bound's width
      (``_parse_single_range``: ``range->width = strlen(lo)``), so ``n[8-10]`` is n8, n9, n10;
    - ``rack[1-2]-n[1-3]``: several bracket groups are a cartesian product with the leftmost group slowest
      (``_push_range_list`` expands the prefix's group first and recurses): rack1-n1, rack1-n2, ...;
    - ``a,b[1-2],c``: commas (and whitespace) separate hosts only outside brackets;
    - ``gpu-a[1-2]-ib``: text after the last bracket. The Slurm versions read for this refuse it
      (``_hostlist_create_bracketed`` requires ``]`` to end the token), pdsh's and Flux's hostlists accept
      it (Flux RFC 29: ``prefix[idlist]suffix``); it is accepted here, the superset, and the system's
      ``scontrol show hostnames`` is asked first anyway.

    Raises ``UsageError`` naming the expression for an empty expression or item, unbalanced or nested
    brackets, an empty range list, a range that is not digits (``[a-c]``, ``[-3]``), a descending range
    (``[3-1]``), or more than ``MAX_HOSTS`` hosts.
    """
    if not text or not text.strip():
        raise UsageError(f"empty Slurm hostlist {text!r}", _HOSTLIST_HINT)
    hosts: list[str] = []
    for item in _split_top_level(text):
        groups = _item_groups(text, item)
        count = 1
        for group in groups:
            count *= len(group)
        if len(hosts) + count > MAX_HOSTS:
            raise UsageError(
                f"Slurm hostlist {text!r} stands for more than {MAX_HOSTS} hosts", _HOSTLIST_HINT
            )
        hosts.extend("".join(parts) for parts in itertools.product(*groups))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """The comma- or whitespace-separated items of ``text``, brackets kept whole and checked."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            if depth:
                raise UsageError(f"bad Slurm hostlist {text!r}: '[' inside brackets", _HOSTLIST_HINT)
            depth = 1
        elif ch == "]":
            if not depth:
                raise UsageError(f"bad Slurm hostlist {text!r}: ']' without '['", _HOSTLIST_HINT)
            depth = 0
        elif not depth and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise UsageError(f"bad Slurm hostlist {text!r}: '[' is never closed", _HOSTLIST_HINT)
    items.append("".join(current))
    # Whitespace runs and a space after a comma are one separator (Slurm's tokenizer skips them);
    # a comma with nothing on one side is not, it is a broken list.
    stripped = text.strip()
    if stripped.startswith(",") or stripped.endswith(",") or re.search(r",\s*,", _outside(text)):
        raise UsageError(f"bad Slurm hostlist {text!r}: an empty item between commas", _HOSTLIST_HINT)
    return [item for item in items if item]


def _outside(text: str) -> str:
    """``text`` with every bracketed part blanked, so separators inside brackets are not looked at."""
    return re.sub(r"\[[^\]]*\]", "[]", text)


def _item_groups(text: str, item: str) -> list[list[str]]:
    """One item as a list of alternatives per part: literal text is one choice, a bracket several."""
    # _split_top_level has checked that brackets pair up and do not nest.
    groups: list[list[str]] = []
    rest = item
    while rest:
        literal, bracket, rest = rest.partition("[")
        if literal:
            groups.append([literal])
        if bracket:
            body, _, rest = rest.partition("]")
            groups.append(_range_values(text, body))
    return groups


def _range_values(text: str, body: str) -> list[str]:
    """The numbers a bracket's ``01-04,07`` stands for, each padded to its range's lower bound."""
    if not body:
        raise UsageError(f"bad Slurm hostlist {text!r}: empty brackets", _HOSTLIST_HINT)
    values: list[str] = []
    for piece in body.split(","):
        match = _RANGE.fullmatch(piece.strip())
        if match is None:
            raise UsageError(
                f"bad Slurm hostlist {text!r}: {piece!r} is not a number or a range of numbers",
                _HOSTLIST_HINT,
            )
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if lo > hi:
            raise UsageError(f"bad Slurm hostlist {text!r}: range {piece!r} runs backwards", _HOSTLIST_HINT)
        if len(values) + hi - lo + 1 > MAX_HOSTS:
            raise UsageError(
                f"Slurm hostlist {text!r} stands for more than {MAX_HOSTS} hosts", _HOSTLIST_HINT
            )
        width = len(lo_text)
        values.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return values


@dataclass(frozen=True)
class SlurmJob:
    """This node's view of the Slurm job (or of the ``srun`` step, inside one) it runs in.

    ``nodelist`` is the expression as Slurm wrote it, ``hosts`` its expansion (``nnodes`` of them, in
    Slurm's order), ``node_id`` this node's index into ``hosts``. ``gpus`` are the GPUs Slurm gave this
    node, as Slurm numbers them (see ``slurm_job``), or ``None`` when the environment does not say.
    """

    job_id: str
    nnodes: int
    node_id: int
    nodelist: str
    hosts: tuple[str, ...]
    gpus: tuple[int, ...] | None
    # Tasks of the step (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS): gputopo wants one per node, since
    # each node's gputopo starts a rank per GPU itself.
    ntasks: int | None = None
    # The address Slurm has for node 0 (``scontrol show node NAME``: ``NodeAddr``), when asked and known.
    first_addr: str | None = None
    # This node's name as its slurmd knows it (``SLURMD_NODENAME``: slurmstepd sets it in every task's
    # environment to ``conf->node_name``, the ``-N`` name of a slurmd; SchedMD/slurm
    # src/slurmd/slurmstepd/task.c, ``exec_task``), when set.
    node_name: str | None = None

    @property
    def first_host(self) -> str:
        """Node 0's host name: the usual rendezvous host, the one every node can compute alike."""
        return self.hosts[0]

    @property
    def rendezvous_host(self) -> str:
        """Where the nodes meet: node 0's ``NodeAddr``, else its name. A node's name need not be the
        address to connect to: on a cluster whose ``slurm.conf`` sets ``NodeAddr`` the name may not resolve
        at all (or resolve to another network)."""
        return self.first_addr or self.first_host

    @property
    def rendezvous_port(self) -> int:
        """The job's own rendezvous port (``rendezvous_port``)."""
        return rendezvous_port(self.job_id)

    @property
    def rendezvous_endpoint(self) -> str:
        """``HOST:PORT`` (an IPv6 address in brackets) for torchrun's ``--rdzv-endpoint``."""
        host = self.rendezvous_host
        return f"[{host}]:{self.rendezvous_port}" if ":" in host else f"{host}:{self.rendezvous_port}"

    @property
    def this_host(self) -> str:
        """This node's name as Slurm knows it: ``SLURMD_NODENAME``, else its entry in the node list. Never
        ``gethostname()``: several slurmd on one machine (a test cluster) share one host name, and a site's
        host names need not be its node names."""
        return self.node_name or self.hosts[self.node_id]


def rendezvous_port(job_id: str) -> int:
    """The rendezvous port of Slurm job ``job_id``: ``SLURM_RDZV_PORT_LOW + job_id % span``, span being
    the size of ``SLURM_RDZV_PORT_LOW..SLURM_RDZV_PORT_HIGH`` (3267 ports).

    The same on every node of the job (it depends on nothing else), and different for any two jobs whose
    ids differ by less than the span, which consecutive jobs on one node do. A job id that is not a
    number (Slurm's are) is hashed with CRC-32, which is the same in every Python process.
    """
    span = SLURM_RDZV_PORT_HIGH - SLURM_RDZV_PORT_LOW + 1
    text = job_id.strip()
    number = int(text) if _DIGITS.fullmatch(text) else zlib.crc32(text.encode())
    return SLURM_RDZV_PORT_LOW + number % span


def slurm_job(
    environ: Mapping[str, str],
    hostnames: Callable[[str], list[str] | None] | None = None,
    node_addr: Callable[[str], str | None] | None = None,
) -> SlurmJob | None:
    """The Slurm job described by ``environ``, or ``None`` outside Slurm (no ``SLURM_JOB_ID``).

    Nodes: ``SLURM_STEP_NODELIST`` with ``SLURM_STEP_NUM_NODES`` (or ``SLURM_NNODES``) inside an ``srun``
    step, else ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) with ``SLURM_JOB_NUM_NODES`` (or
    ``SLURM_NNODES``); this node is ``SLURM_STEP_NODEID``, else ``SLURM_NODEID`` (why the step's come first:
    the module docstring). Hosts come from ``hostnames(nodelist)`` (the system's ``scontrol show
    hostnames``, which knows every syntax the installed Slurm does) and from ``expand_hostlist`` when it
    is not given or answers ``None``. With more than one node, ``node_addr(name)`` (the system's
    ``scontrol show node``) gives the address Slurm has for node 0, where the nodes meet
    (``SlurmJob.rendezvous_host``); not asked, or answering ``None``, node 0's name stands in.

    GPUs: ``SLURM_STEP_GPUS`` inside a step, ``SLURM_JOB_GPUS`` outside one. Slurm's man pages (OUTPUT
    ENVIRONMENT VARIABLES, Slurm 23): ``SLURM_JOB_GPUS`` holds "the global GPU IDs of the GPUs allocated to
    this job. The GPU IDs are not relative to any device cgroup, even if devices are constrained with
    task/cgroup. Only set in batch and interactive jobs." In the source, the GPU plugin writes this
    "global" list to ``SLURM_JOB_GPUS``/``SLURM_STEP_GPUS`` and the "local" one to ``CUDA_VISIBLE_DEVICES``
    (SchedMD/slurm ``src/plugins/gres/common/gres_common.c``, ``gres_common_gpu_set_env``). The global list
    is the GPUs' index on the node in PCI bus order ("GPUs ... want it to match the order they enumerate on
    the PCI bus", ``common_gres_set_env``): nvidia-smi's numbering. Older Slurm releases wrote the number of
    the ``/dev/nvidiaN`` file instead, which the GRES guide (doc/html/gres.shtml) warns need not match
    NVML's order. The local list is no use here: with ``ConstrainDevices`` the cgroup hides the other GPUs
    and it counts from 0 (gres.shtml: a job given /dev/nvidia1 sees ``CUDA_VISIBLE_DEVICES=0``), and it may
    hold UUIDs; ``GPU_DEVICE_ORDINAL`` is the same local list for OpenCL/ROCm. ``SLURM_JOB_GPUS`` is not
    read inside a step: it is only set for the batch script, so a step inherits the batch host's, node 0's
    (gres.shtml: what is set for sbatch "only reflects the GPUs allocated to that job on that node, node
    zero of the allocation"). Empty, or Slurm's ``NoDevFiles`` (GPUs given, device files unknown), is
    ``None``.

    Raises ``UsageError`` with a hint when the environment contradicts itself: a count or id that is not
    a whole number, a node id outside ``0..nnodes-1``, a host count other than ``nnodes``, a GPU list that
    is not numbers, or a missing node list, count or id.
    """
    job_id = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not job_id:
        return None

    step_nodelist = environ.get("SLURM_STEP_NODELIST")
    in_step = step_nodelist is not None
    if in_step:
        nodelist_name, nodelist = "SLURM_STEP_NODELIST", step_nodelist
        nnodes_name, nnodes_text = _first_set(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    else:
        nodelist_name, nodelist = _first_set(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        nnodes_name, nnodes_text = _first_set(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node_id_name, node_id_text = _first_set(environ, "SLURM_STEP_NODEID", "SLURM_NODEID")

    if nodelist is None or not nodelist.strip():
        raise UsageError(
            f"Slurm job {job_id}: the environment names no node list (SLURM_JOB_NODELIST)",
            _ENV_HINT,
        )
    if nnodes_text is None:
        raise UsageError(f"Slurm job {job_id}: the environment gives no node count (SLURM_NNODES)", _ENV_HINT)
    if node_id_text is None:
        raise UsageError(
            f"Slurm job {job_id}: SLURM_NODEID is not set, so this is not a task of the job",
            "run `gputopo probe` on every node with `srun`, not from the salloc shell or the login node",
        )
    nnodes = _whole_number(nnodes_name, nnodes_text)
    node_id = _whole_number(node_id_name, node_id_text)
    if nnodes < 1:
        raise UsageError(f"Slurm job {job_id}: {nnodes_name}={nnodes_text} nodes", _ENV_HINT)
    if node_id >= nnodes:
        raise UsageError(
            f"Slurm job {job_id}: {node_id_name}={node_id} is not below {nnodes_name}={nnodes}", _ENV_HINT
        )

    nodelist = nodelist.strip()
    hosts = hostnames(nodelist) if hostnames is not None else None
    if not hosts:
        hosts = expand_hostlist(nodelist)
    if len(hosts) != nnodes:
        raise UsageError(
            f"Slurm job {job_id}: {nodelist_name}={nodelist} names {len(hosts)} hosts "
            f"but {nnodes_name}={nnodes}",
            _ENV_HINT,
        )

    tasks_name, tasks_text = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    ntasks = _whole_number(tasks_name, tasks_text) if tasks_text is not None and in_step else None
    gpus_name = "SLURM_STEP_GPUS" if in_step else "SLURM_JOB_GPUS"
    gpus = _gpu_list(gpus_name, environ.get(gpus_name))
    first_addr = node_addr(hosts[0]) if node_addr is not None and nnodes > 1 else None
    return SlurmJob(
        job_id=job_id,
        nnodes=nnodes,
        node_id=node_id,
        nodelist=nodelist,
        hosts=tuple(hosts),
        gpus=gpus,
        ntasks=ntasks,
        first_addr=first_addr or None,
        node_name=(environ.get("SLURMD_NODENAME") or "").strip() or None,
    )


_ENV_HINT = (
    "the SLURM_* variables contradict each other: were some set by hand or carried over from another "
    "job? Compare `env | grep ^SLURM_` inside `srun` with `scontrol show job $SLURM_JOB_ID`"
)


def _first_set(environ: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    """The first of ``names`` that is set, and its value; the first name and ``None`` when none is."""
    for name in names:
        value = environ.get(name)
        if value is not None:
            return name, value
    return names[0], None


def _whole_number(name: str, text: str) -> int:
    """``text`` as a non-negative integer; ``UsageError`` naming the variable otherwise."""
    if not _DIGITS.fullmatch(text.strip()):
        raise UsageError(f"{name}={text!r} is not a whole number", _ENV_HINT)
    return int(text.strip())


def _gpu_list(name: str, text: str | None) -> tuple[int, ...] | None:
    """A Slurm GPU list (``0,1,2,3``) as indices; ``None`` when unset, empty or ``NoDevFiles``."""
    if text is None or not text.strip() or text.strip() == _NO_DEV_FILES:
        return None
    entries = [entry.strip() for entry in text.split(",")]
    if not all(_DIGITS.fullmatch(entry) for entry in entries):
        raise UsageError(f"{name}={text!r} is not a list of GPU numbers", _ENV_HINT)
    return tuple(int(entry) for entry in entries)
