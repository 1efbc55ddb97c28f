"""The probe's allowance for older torch builds on GPU images (probe/ranks/compat.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gputopo.probe.ranks import compat  # noqa: E402


def test_a_torch_without_sort_ranks_refuses_an_order_it_cannot_keep(monkeypatch):
    monkeypatch.setattr(compat, "_new_group_takes_sort_ranks", lambda: False)
    with pytest.raises(RuntimeError, match=r"torch>=2\.14"):
        compat.new_group_in_order([1, 0])


def test_the_installed_torch_keeps_the_order_through_sort_ranks():
    # pyproject's lower bound (torch>=2.14) has the keyword; the fallback is for vendor builds only.
    assert compat._new_group_takes_sort_ranks() is True
