"""The multi-node part of the probe document and its Markdown (pure).

Node rank 0's ``gputopo/probe/v1`` document gets ``nodes`` (one row per node: node rank, host, verdict,
what points at it) and ``internode`` (how the launch ended, every inter-node test with its bus bandwidth
and lateness, the findings and notes). A node's verdict is ``pass`` only when nothing found points at it.
"""

from __future__ import annotations

from typing import Any

from gputopo.probe.judge import nodes
from gputopo.probe.judge.mnnvl import judge_mnnvl, parse_mnnvl, warning_findings
from gputopo.probe.judge.network import judge_network
from gputopo.probe.judge.progress import crash_findings, hang_findings

FAIL, PASS = "fail", "pass"
UNTESTED = "not tested"


def local_summary(node_rank: int, doc: dict[str, Any] | None, why_not: str | None = None) -> dict[str, Any]:
    """What a node's own checks found, small enough to travel to node rank 0 with the ranks' table."""
    if doc is None:
        return {"verdict": "skipped", "why": why_not, "sets": [], "findings": []}
    found = []
    sets = []
    for s in doc.get("sets") or []:
        label = ",".join(map(str, s["gpus"]))
        checks = []
        for c in s.get("checks") or []:
            checks.append({k: c.get(k) for k in ("name", "verdict", "kind", "detail")})
            if c.get("verdict") == FAIL:
                found.append(
                    {
                        "kind": c.get("kind"),
                        "nodes": [node_rank],
                        "detail": f"node {node_rank}, GPUs {label}, {c.get('name')}: {c.get('detail')}",
                        "remedy": c.get("remedy"),
                    }
                )
        sets.append({"gpus": s["gpus"], "verdict": s.get("verdict"), "checks": checks})
    return {"verdict": doc.get("verdict"), "sets": sets, "findings": found}


def _joined_text(joined: dict[str, str], nnodes: int) -> str:
    have = sorted(int(n) for n in joined)
    missing = [n for n in range(nnodes) if n not in have]
    if not have:
        return "no node could be seen there (its store never answered this node)"
    text = f"{len(have)} of {nnodes} nodes joined (node rank {', '.join(map(str, have))})"
    if missing:
        text += f"; never came: node rank {', '.join(map(str, missing))}"
    return text


def internode_section(
    options: dict[str, Any],
    status: str,
    record: dict[str, Any] | None,
    joined: dict[str, str],
    progress: dict[int, dict[str, Any]],
    message: str,
    network: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``nodes`` rows and the ``internode`` section for how the launch ended.

    ``options`` holds ``nnodes``, ``node_rank``, ``endpoint``, ``rdzv_id``, ``rdzv_timeout_s``,
    ``timeout_s`` and ``source``. ``network`` (``device``, ``nccl_lines``: node 0's NCCL log lines)
    lets the transport and the line rate be judged (``judge.network``); each node's NICs come with its
    own checks' summary (``local[...]["net"]``).
    """
    nnodes = int(options["nnodes"])
    section: dict[str, Any] = {**options, "status": status, "tests": [], "findings": [], "notes": []}
    if status == "ok" and record is not None:
        layout = nodes.Layout.from_table(record["ranks"], nnodes)
        found, notes = nodes.findings(layout, record["tests"])
        local = {int(k): v for k, v in (record.get("local") or {}).items()}
        if network is not None:
            nets = {n: (local.get(n) or {}).get("net") for n in layout.nodes}
            lines, device = network.get("nccl_lines"), network["device"]
            # The NVLink domain first: the tests it carried are judged against NVLink, not the NICs.
            dom_found, dom_notes, section["mnnvl"], inside = judge_mnnvl(
                device, record["tests"], lines, local, layout.nodes, network.get("nvlink_gbps")
            )
            rest = [t for i, t in enumerate(record["tests"]) if i not in inside]
            more, more_notes, section["network"] = judge_network(device, rest, lines, nets, layout.nodes)
            found, notes = [*found, *dom_found, *more], [*notes, *dom_notes, *more_notes]
        rows = nodes.node_verdicts(layout, found, local)
        section.update(tests=record["tests"], findings=found, notes=notes, ranks=record["ranks"])
        section["busbw_gbps"] = _busbw_summary(record["tests"])
        return rows, section
    if status == "rendezvous":
        text = (
            f"the rendezvous at {options['endpoint']} gave up after --rdzv-timeout "
            f"{float(options['rdzv_timeout_s']):g} s: {_joined_text(joined, nnodes)}"
        )
        missing = [n for n in range(nnodes) if str(n) not in joined]
        found = [
            {
                "kind": "missing",
                "nodes": missing,
                "detail": text,
                "remedy": "start gputopo on every node with the same --rdzv-endpoint and --rdzv-id, and "
                "check that each can reach the endpoint's port",
            }
        ]
        section.update(findings=found, message=text)
        return _unjudged_rows(nnodes, found, joined, progress), section
    if status == "hung":
        if int(options["node_rank"]) == 0:
            found = hang_findings(progress, float(options["timeout_s"]))
        else:
            found = [
                {
                    "kind": "hung",
                    "nodes": [],
                    "detail": f"no rank on this node moved for {float(options['timeout_s']):g} s; "
                    "node rank 0's report names the node behind",
                    "remedy": "read node rank 0's output",
                }
            ]
        section.update(findings=found, message=found[0]["detail"])
        return _unjudged_rows(nnodes, found, joined, progress), section
    what = "a rank died" if status == "failed" else "torch's elastic launcher failed"
    last_line = message.strip().splitlines()[-1] if message.strip() else "no message"
    # gloo's and NCCL's messages go on with advice after the first sentence; the first names the error.
    last_line = last_line.split(". ")[0][:200]
    found = crash_findings(progress, last_line) if status == "failed" else []
    # NCCL's "MNNVL ... is available but not working" stops the communicator: the cause, named first.
    here = [int(options["node_rank"])]
    found = [*warning_findings(parse_mnnvl((network or {}).get("nccl_lines") or []), here), *found]
    if not found:
        found = [
            {
                "kind": "crashed",
                "nodes": [],
                "detail": f"{what} during the inter-node tests: {last_line}",
                "remedy": "read every node's output; the first error is the cause, the others lost a peer",
            }
        ]
    section.update(findings=found, message=found[0]["detail"])
    return _unjudged_rows(nnodes, found, joined, progress), section


def _unjudged_rows(
    nnodes: int, found: list[dict[str, Any]], joined: dict[str, str], progress: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """A row per node when the tests did not finish: ``fail`` where a finding points at the node, else
    ``not tested``; the host from the node's progress, else from its word in the store when it joined."""
    hosts = {str(p["node"]): p.get("host") for p in progress.values()}
    return [
        {
            "node_rank": n,
            "host": hosts.get(str(n)) or joined.get(str(n)),
            "verdict": FAIL if any(n in f["nodes"] for f in found) else UNTESTED,
            "findings": [f for f in found if n in f["nodes"]],
        }
        for n in range(nnodes)
    ]


def _busbw_summary(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Peak bus bandwidth over every node, per node pair and per rail."""
    out: dict[str, Any] = {"all": None, "pairs": [], "rails": []}
    for t in tests:
        if t["kind"] == "all":
            out["all"] = t.get("busbw_gbps")
        elif t.get("rail") is not None:
            out["rails"].append({"rail": t["rail"], "busbw_gbps": t.get("busbw_gbps")})
        elif len(t["nodes"]) == 2:
            out["pairs"].append({"nodes": t["nodes"], "busbw_gbps": t.get("busbw_gbps"), "kind": t["kind"]})
    return out


def any_failed(rows: list[dict[str, Any]], section: dict[str, Any]) -> bool:
    """Whether the run across nodes failed: it did not finish, found something, or a node failed."""
    return (
        section["status"] != "ok" or bool(section.get("findings")) or any(r["verdict"] == FAIL for r in rows)
    )


def add_nodes(doc: dict[str, Any], rows: list[dict[str, Any]], section: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with ``nodes`` and ``internode``, and the run's verdict over all of them."""
    failing = doc.get("verdict") == FAIL or any_failed(rows, section)
    return {**doc, "verdict": FAIL if failing else PASS, "nodes": rows, "internode": section}


def _gbps(value: Any) -> str:
    return f"{float(value):.3f}" if value is not None else "-"


def test_label(t: dict[str, Any]) -> str:
    """``all``, ``pair 0-1``, ``bisect 1-3``, ``rail 2``."""
    if t.get("rail") is not None:
        return f"rail {t['rail']} (GPU {t['rail']} of every node)"
    if t["kind"] == "all":
        return "all nodes"
    return f"{t['kind']} {'-'.join(map(str, t['nodes']))}"


def test_rows(section: dict[str, Any]) -> list[list[str]]:
    """One row per inter-node test: test, nodes, #wrong, peak busbw, the lateness of each node."""
    rows = []
    for t in section.get("tests") or []:
        late = t.get("lateness_ms") or {}
        rows.append(
            [
                test_label(t),
                ",".join(map(str, t["nodes"])),
                str(t.get("wrong", "-")),
                _gbps(t.get("busbw_gbps")),
                ", ".join(f"{n}: {float(v):.1f}" for n, v in sorted(late.items(), key=lambda kv: int(kv[0]))),
            ]
        )
    return rows


TEST_HEADER = ["test", "nodes", "#wrong", "busbw GB/s", "lateness ms per node"]
NODE_HEADER = ["node rank", "host", "GPUs", "verdict", "what points at it"]


def node_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per node for the tables of every renderer."""
    return [
        [
            str(r["node_rank"]),
            str(r.get("host") or "?"),
            ",".join(map(str, r.get("gpus") or [])) or "-",
            str(r["verdict"]),
            "; ".join(f["detail"] for f in r.get("findings") or []) or "-",
        ]
        for r in doc.get("nodes") or []
    ]


def nodes_markdown(doc: dict[str, Any]) -> list[str]:
    """The multi-node sections of the Markdown report."""
    section = doc.get("internode") or {}
    out = [
        "",
        "## Nodes",
        "",
        f"- {section.get('nnodes')} nodes, rendezvous {section.get('endpoint')} "
        f"(id {section.get('rdzv_id')}, from {section.get('source')}); "
        f"inter-node tests: {section.get('status')}",
    ]
    if section.get("message"):
        out.append(f"- {section['message']}")
    net = section.get("network") or {}
    if net.get("transport") and net.get("transport") != "gloo":
        rate = (
            f", line rate {net['line_rate_gbs']:.1f} GB/s ({net.get('rails')} rails)"
            if net.get("judged")
            else ""
        )
        gdr = " with GPUDirect RDMA" if net.get("gdr") else ""
        out.append(f"- network between nodes: {net['transport']}{gdr}{rate}")
    mnnvl = section.get("mnnvl") or {}
    if mnnvl.get("used"):
        size = f", a clique of {mnnvl['clique_size']} GPUs" if mnnvl.get("clique_size") else ""
        nvls = ", NVLink SHARP on" if mnnvl.get("nvls_ranks") else ""
        out.append(f"- NVLink domain between nodes: used by NCCL (MNNVL{size}{nvls})")
    out += [f"- note: {n}" for n in section.get("notes") or []]
    out += ["", "| " + " | ".join(NODE_HEADER) + " |", "|---" * len(NODE_HEADER) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in node_rows(doc)]
    for r in doc.get("nodes") or []:
        out += ["", f"### Node {r['node_rank']} ({r.get('host') or '?'}): {r['verdict']}", ""]
        local = r.get("local") or {}
        if local.get("verdict") == "skipped":
            out.append(f"- its own checks: skipped ({local.get('why')})")
        for s in local.get("sets") or []:
            out.append(f"- its own checks, GPUs {','.join(map(str, s['gpus']))}: {s.get('verdict')}")
        for f in r.get("findings") or []:
            out.append(f"- **{f['kind']}**: {f['detail']}. {f.get('remedy') or ''}".rstrip())
    tests = test_rows(section)
    if tests:
        out += [
            "",
            "## Between nodes",
            "",
            "| " + " | ".join(TEST_HEADER) + " |",
            "|---" * len(TEST_HEADER) + "|",
        ]
        out += ["| " + " | ".join(row) + " |" for row in tests]
    return out
