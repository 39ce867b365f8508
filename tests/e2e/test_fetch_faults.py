"""The small version of bench/fetch_faults.py: slow origins fail nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fetch_faults import run

pytestmark = pytest.mark.e2e


def test_delayed_fetches_do_not_fail_requests(tiny_model: Path, tmp_path: Path) -> None:
    # One round: fetches 0 and 8 of its 12 are delayed past the budget.
    report = run(rounds=1, clients=12, tp=1, model=tiny_model, workdir=tmp_path)
    assert len(report.outcomes) == 12
    assert report.delayed, "no fetch was delayed"
    assert report.failure_rate == 0, report.failures
    # The delayed ones waited for the origin, not on a CPU budget.
    assert min(report.delayed) > 3.0
