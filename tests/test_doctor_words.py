"""Doctor's words must match what it shows (issue 23 item 9): the headline names where the remedies are
in every view (it is printed last in the terminal, first in the Markdown and HTML reports), and the
Checks table says "failures are explained above" only when there are failures to explain."""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest
from rich.console import Console

from gputopo.probe.judge.findings import probe_findings
from gputopo.services.doctor import REMEDIES_TITLE, DoctorOptions, headline, run_doctor
from gputopo.topology import samples
from gputopo.ui.doctor_markdown import to_markdown
from gputopo.ui.doctor_view import render_doctor
from gputopo.ui.html_report import render_html
from test_doctor import failed_probe_doc


def _terminal(doc: dict) -> str:
    buf = io.StringIO()
    Console(file=buf, width=160, no_color=True, color_system=None).print(render_doctor(doc))
    return buf.getvalue()


def _with_probe(tmp_path, probe: dict) -> dict:
    """A simulated doctor document (quad sample) with ``probe`` judged as the doctor judges it."""
    doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path))
    findings = probe_findings(probe)
    topo = samples.load("quad-nv4-pairs-2socket")
    doc.update(
        probe=probe,
        probe_note=None,
        findings=[asdict(f) for f in findings],
        verdict="problems" if findings else "healthy",
        headline=headline(topo, True, findings, [0, 1, 2, 3], probe, None),
    )
    return doc


def _passing(probe: dict) -> dict:
    good = dict(probe)
    good["sets"] = [
        {**s, "verdict": "pass", "checks": [c for c in s["checks"] if c["name"] != "p2p"]}
        for s in probe["sets"]
    ]
    good["verdict"] = "pass"
    return good


def test_the_headline_names_the_remedies_table_in_every_view(tmp_path):
    pytest.importorskip("matplotlib")  # the HTML view draws pictures
    doc = _with_probe(tmp_path, failed_probe_doc())
    assert doc["verdict"] == "problems"
    line = doc["headline"]
    assert "below" not in line and "above" not in line
    assert f"their remedies are under '{REMEDIES_TITLE}'" in line
    terminal = _terminal(doc)
    assert REMEDIES_TITLE in terminal and terminal.index(REMEDIES_TITLE) < terminal.index("problem(s) found")
    markdown = to_markdown(doc)
    assert f"## {REMEDIES_TITLE}" in markdown
    assert markdown.index("problem(s) found") < markdown.index(f"## {REMEDIES_TITLE}")
    assert f"<h2>{REMEDIES_TITLE}</h2>" in render_html(doc)


def test_checks_say_failures_are_explained_above_only_when_some_failed(tmp_path):
    failed = _terminal(_with_probe(tmp_path, failed_probe_doc()))
    assert "Checks (failures are explained above)" in failed
    healthy_doc = _with_probe(tmp_path, _passing(failed_probe_doc()))
    assert healthy_doc["verdict"] == "healthy"
    healthy = _terminal(healthy_doc)
    assert "Checks" in healthy and "failures are explained above" not in healthy
    assert "Problems and remedies" not in healthy


def test_health_problems_point_at_the_health_section():
    from gputopo.findings import Finding

    topo = samples.load("quad-nv4-pairs-2socket")
    sick = Finding("GPU0", "a row remapping is pending on GPU0", "drain the GPU and reset it")
    link = Finding("GPUs 0,1", "p2p check failed (corrupt)", "set NCCL_P2P_DISABLE=1")
    only_health = headline(topo, False, [sick], [1, 2, 3], None, "skipped", (sick,))
    assert only_health.endswith("their remedies are under 'Health'")
    both = headline(topo, False, [sick, link], [1, 2, 3], None, "skipped", (sick,))
    assert both.endswith(f"their remedies are under 'Health' and '{REMEDIES_TITLE}'")
