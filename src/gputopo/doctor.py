"""A shim, to be deleted at the merge: ``cli/probe.py`` still imports ``probe_findings`` and
``redirected_pairs`` from here. Their homes are ``probe.judge.findings`` and ``services.doctor``."""

from __future__ import annotations

from gputopo.probe.judge.findings import probe_findings
from gputopo.services.doctor import redirected_pairs

__all__ = ["probe_findings", "redirected_pairs"]
