"""Across nodes: the transport NCCL really used between the nodes, and the bandwidth against the NICs'
line rate (pure: log lines and sysfs strings in, findings out).

A run that fell back to TCP sockets on the management Ethernet still passes every exactness check, and
with two to four nodes there are too few pairs to compare with each other; so the inter-node tests are
also judged against the hardware:

- the **transport**, from node rank 0's NCCL INIT log (NVIDIA/nccl): ``src/init.cc`` writes
  ``NCCL INFO Using network IB`` (or ``Socket``, or a plugin's name: ``INFO(NCCL_INIT, "Using network
  %s", comm->ncclNet->name)``); ``src/transport/net_ib`` writes ``NET/IB : Using [0]mlx5_0:1/IB
  [1]mlx5_1:1/RoCE ; OOB ib0:10.1.0.1<0>`` (the devices it will use) or ``NET/IB : No device found.``;
  ``src/transport/net_socket.cc`` writes ``NET/Socket : Using [0]eth0:10.0.0.11<0>``; the plugin loader
  writes ``NET/Plugin ...`` lines; and ``src/transport/net.cc`` (``sendSetup``/``recvSetup``) writes one
  line per channel and peer, ``Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s`` (network
  name, device index, ``/GDRDMA`` when GPUDirect RDMA is on), or ``NET/%s/%d(%d)`` with a proxy rank (PXN).
  Sockets between nodes whose NICs include an active InfiniBand or RoCE port are a problem: the RDMA
  path is broken (libibverbs missing in the container, ``/dev/infiniband`` not mounted,
  ``NCCL_IB_DISABLE``, a wrong ``NCCL_IB_HCA``) and the job runs many times slower.
- the **line rate**: the peak bus bandwidth of each test over whole nodes (all nodes, node pairs) against
  the sum of the rates of the NICs NCCL used on node 0 (``/sys/class/infiniband/*/ports/*/rate``; for
  sockets ``/sys/class/net/IF/speed``), i.e. the rate times the rails. A ring all-reduce between nodes
  crosses each node's NICs once per direction, so nccl-tests' bus bandwidth (doc/PERFORMANCE.md: it
  "should reflect the speed of the hardware bottleneck") approaches that sum on a healthy fabric (80-95%
  at hundreds of MiB). Below ``LOW_FRACTION`` of it at messages of ``MIN_JUDGED_BYTES`` or more is a
  degraded fabric (a port at a fraction of its speed, a rail down, traffic through the CPU), not tuning.
  Judged for every node count, two nodes included.

On CPU ranks the tests run over gloo, not NCCL: neither is judged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

LOW_FRACTION = 0.40
MIN_JUDGED_BYTES = 64 << 20

_USING_NETWORK = re.compile(r"NCCL INFO Using network (?P<net>.+?)\s*$")
_IB_USING = re.compile(r"NCCL INFO NET/IB ?: Using (?P<rest>.*)$")
_IB_DEV = re.compile(r"\[(?P<idx>\d+)\](?P<name>[^\s:\[\]]+):(?P<port>\d+)/(?P<kind>IB|RoCE)")
_SOCKET_USING = re.compile(r"NCCL INFO NET/Socket ?: Using (?P<rest>.*)$")
_SOCKET_IF = re.compile(r"\[(?P<idx>\d+)\](?P<name>[^\s:\[\]]+):")
_VIA_NET = re.compile(
    r"NCCL INFO Channel \d+(?:/\d+)? : .* via NET/(?P<net>[^/]+?)/(?P<dev>\d+)(?P<rest>\S*)"
)
_IB_RATE = re.compile(r"(?P<gbit>\d+(?:\.\d+)?)\s*Gb/sec")


def parse_nccl_net(lines: Iterable[str]) -> dict[str, Any]:
    """What NCCL's INIT log says about the network between nodes.

    ``network``: the ``Using network`` name (``IB``, ``Socket``, a plugin's); ``via``: how many channel
    connections each network carried; ``devices``: NCCL's device index -> ``name:port`` of the IB/RoCE
    devices it listed (``kinds``: ``IB`` or ``RoCE`` each); ``used``: device indices the channels used;
    ``socket_ifs``: interfaces NET/Socket listed; ``gdr``: GPUDirect RDMA on some channel;
    ``ib_missing``: NCCL said ``NET/IB : No device found``; ``plugin``: the last ``NET/Plugin`` line.
    """
    out: dict[str, Any] = {
        "network": None,
        "via": {},
        "devices": {},
        "kinds": {},
        "used": [],
        "socket_ifs": [],
        "gdr": False,
        "ib_missing": False,
        "plugin": None,
    }
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        if m := _USING_NETWORK.search(line):
            out["network"] = m["net"]
        elif "NET/IB : No device found" in line or "NET/IB: No device found" in line:
            out["ib_missing"] = True
        elif m := _IB_USING.search(line):
            for d in _IB_DEV.finditer(m["rest"]):
                out["devices"][int(d["idx"])] = f"{d['name']}:{d['port']}"
                out["kinds"][int(d["idx"])] = d["kind"]
        elif m := _SOCKET_USING.search(line):
            for d in _SOCKET_IF.finditer(m["rest"]):
                if d["name"] not in out["socket_ifs"]:
                    out["socket_ifs"].append(d["name"])
        elif "NET/Plugin" in line:
            out["plugin"] = line.split("NCCL INFO", 1)[1].strip()
        elif m := _VIA_NET.search(line):
            net = m["net"]
            out["via"][net] = out["via"].get(net, 0) + 1
            dev = int(m["dev"])
            if net != "Socket" and dev not in out["used"]:
                out["used"].append(dev)
            out["gdr"] = out["gdr"] or "GDRDMA" in m["rest"]
    out["used"].sort()
    return out


def transport_name(nccl: Mapping[str, Any]) -> str | None:
    """``NET/IB``, ``NET/Socket``, ``NET/<plugin>``: what the channels between nodes went through (the
    channels' own word first, then ``Using network``); ``None`` when NCCL logged neither."""
    via = nccl.get("via") or {}
    if via:
        return "NET/" + max(via.items(), key=lambda kv: kv[1])[0]
    if nccl.get("network"):
        return f"NET/{nccl['network']}"
    return None


def parse_ib_rate(text: str | None) -> float | None:
    """``"200 Gb/sec (4X HDR)"`` -> 200.0 (Gb/s); ``None`` when unreadable."""
    if not text:
        return None
    m = _IB_RATE.search(text)
    return float(m["gbit"]) if m else None


def rdma_ports(raw: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The IB/RoCE ports of one node's ``read_nics`` answer: ``name`` (``mlx5_0:1``), ``kind`` (``IB``
    or ``RoCE``), ``rate_gbit``, ``active``."""
    ports = []
    for p in (raw or {}).get("ib") or []:
        ports.append(
            {
                "name": f"{p.get('device')}:{p.get('port')}",
                "kind": "RoCE" if (p.get("link_layer") or "").lower() == "ethernet" else "IB",
                "rate_gbit": parse_ib_rate(p.get("rate")),
                "active": "ACTIVE" in (p.get("state") or "").upper(),
            }
        )
    return ports


def eth_speed_gbit(raw: Mapping[str, Any] | None, name: str) -> float | None:
    """An Ethernet interface's speed in Gb/s (sysfs gives Mb/s; ``-1`` when unknown)."""
    for e in (raw or {}).get("eth") or []:
        if e.get("name") == name:
            try:
                mbit = int(str(e.get("speed")))
            except ValueError:
                return None
            return mbit / 1000 if mbit > 0 else None
    return None


def line_rate(nccl: Mapping[str, Any], raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The rate of the NICs NCCL used on this node, summed over the rails: ``{"gbit", "gbs", "nics",
    "rails"}`` (``gbs`` in GB/s, as the bus bandwidth is); ``None`` when it cannot be told."""
    transport = transport_name(nccl)
    nics: list[tuple[str, float]] = []
    if transport == "NET/Socket":
        for name in nccl.get("socket_ifs") or []:
            speed = eth_speed_gbit(raw, name)
            if speed is None:
                return None
            nics.append((name, speed))
    elif transport is not None:
        ports = {p["name"]: p for p in rdma_ports(raw)}
        devices = nccl.get("devices") or {}
        used = [devices.get(i) for i in nccl.get("used") or sorted(devices)]
        if not used or None in used:
            return None
        for name in used:
            port = ports.get(name)
            if port is None or port["rate_gbit"] is None:
                return None
            nics.append((name, port["rate_gbit"]))
    if not nics:
        return None
    gbit = sum(rate for _, rate in nics)
    return {"gbit": gbit, "gbs": gbit / 8, "nics": [f"{n} {r:g} Gb/s" for n, r in nics], "rails": len(nics)}


def judge_network(
    device: str,
    tests: Sequence[Mapping[str, Any]],
    nccl_lines: Sequence[str] | None,
    nets: Mapping[int, Mapping[str, Any] | None],
    nodes: Sequence[int],
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """Findings, notes and the ``network`` summary for the inter-node tests.

    ``nccl_lines``: node rank 0's NCCL log lines (``None`` when none were kept); ``nets``: each node's
    ``read_nics`` answer by node rank.
    """
    if device != "cuda":
        note = "transport and line rate between nodes: not judged (gloo: CPU ranks, not NCCL)"
        return [], [note], {"transport": "gloo", "judged": False}
    nccl = parse_nccl_net(nccl_lines or [])
    transport = transport_name(nccl)
    summary: dict[str, Any] = {
        "transport": transport,
        "gdr": nccl["gdr"],
        "devices": [nccl["devices"][i] for i in sorted(nccl["devices"])],
        "socket_ifs": nccl["socket_ifs"],
        "plugin": nccl["plugin"],
        "judged": False,
    }
    found: list[dict[str, Any]] = []
    notes: list[str] = []
    if transport is None:
        notes.append("NCCL logged no network between nodes (no NCCL_DEBUG INIT lines): transport not judged")
        return found, notes, summary
    rdma = {n: [p for p in rdma_ports(raw) if p["active"]] for n, raw in nets.items() if rdma_ports(raw)}
    if transport == "NET/Socket":
        with_rdma = sorted(n for n, ports in rdma.items() if ports)
        if with_rdma:
            example = rdma[with_rdma[0]][0]
            rate = f" {example['rate_gbit']:g} Gb/s" if example["rate_gbit"] else ""
            ifs = ", ".join(nccl["socket_ifs"]) or "an Ethernet interface"
            who = f"node {', '.join(map(str, with_rdma))} {'has' if len(with_rdma) == 1 else 'have'}"
            found.append(
                {
                    "kind": "transport",
                    "nodes": list(nodes),
                    "detail": f"NCCL sent the traffic between nodes over TCP sockets (NET/Socket on {ifs}) "
                    f"although {who} active InfiniBand/RoCE ports ({example['name']} {example['kind']}{rate})"
                    + (": NCCL found no IB device" if nccl["ib_missing"] else ""),
                    "remedy": "make the RDMA path usable: libibverbs/rdma-core in the image, /dev/infiniband "
                    "mounted, no NCCL_IB_DISABLE=1 or NCCL_NET=Socket, NCCL_IB_HCA naming the right "
                    "devices (ibv_devinfo lists them)",
                }
            )
        else:
            notes.append(
                f"NCCL used TCP sockets between nodes ({', '.join(nccl['socket_ifs']) or 'Ethernet'}); "
                "no node reported an active InfiniBand/RoCE port"
            )
    rate = line_rate(nccl, nets.get(0))
    if rate is None:
        notes.append(f"line rate of node 0's NICs unknown ({transport}): bandwidth not compared with it")
        return found, notes, summary
    summary.update(line_rate_gbs=round(rate["gbs"], 3), rails=rate["rails"], nics=rate["nics"], judged=True)
    low = []
    judged = 0
    for t in tests:
        if t.get("rail") is not None or len(t.get("nodes") or []) < 2 or int(t.get("wrong") or 0) > 0:
            continue
        rows = t.get("rows") or []
        big = [r for r in rows if int(r.get("bytes") or 0) >= MIN_JUDGED_BYTES]
        if not big or t.get("busbw_gbps") is None:
            continue
        judged += 1
        peak = max(float(r["busbw_gbps"]) for r in big)
        if peak < LOW_FRACTION * rate["gbs"]:
            low.append((t, peak))
    if not judged and tests:
        notes.append(
            f"no inter-node test reached {MIN_JUDGED_BYTES >> 20} MiB messages: bandwidth not compared with "
            f"the line rate ({rate['gbs']:.1f} GB/s)"
        )
    if low:
        parts = [f"{_label(t)} {peak:.1f} GB/s ({100 * peak / rate['gbs']:.0f}%)" for t, peak in low]
        involved = sorted({int(n) for t, _ in low for n in t["nodes"]})
        found.append(
            {
                "kind": "slow",
                "nodes": involved,
                "detail": f"bus bandwidth between nodes far below the line rate {rate['gbs']:.1f} GB/s "
                f"({' + '.join(rate['nics'])}, {rate['rails']} rail{'s' if rate['rails'] != 1 else ''} on "
                f"node 0; {transport}): {'; '.join(parts)}",
                "remedy": "check each NIC's link (ibstat: rate and width, or ethtool), the switch ports, and "
                "that NCCL uses every rail (NCCL_IB_HCA, NCCL_DEBUG=INFO's NET/IB line)",
                "metrics": {"line_rate_gbs": round(rate["gbs"], 3), "low_fraction": LOW_FRACTION},
            }
        )
    return found, notes, summary


def _label(t: Mapping[str, Any]) -> str:
    if t.get("kind") == "all":
        return "all nodes"
    return f"{t.get('kind')} {'-'.join(map(str, t['nodes']))}"
