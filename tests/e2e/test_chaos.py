"""A minute of `bench/chaos.py` (many faults at once under mixed load: CPU
workers, the forkserver, rank 1 of a group and whole groups SIGKILLed and
restarted, ranks frozen): nothing lost, no untyped error, every failure
typed and retriable or the request's own bad input, nothing left in
/dev/shm or in the slab, the tokenizer's descriptors back where they were."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import chaos
from tests.support.leaks import PROJECT_PREFIX

pytestmark = pytest.mark.e2e


def test_a_minute_of_chaos_loses_nothing(
    family_models: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny Qwen2-VL (images and videos), as the bench runs by default."""
    args = argparse.Namespace(minutes=1.0, concurrency=6, seed=7, fault_every_s=5.0, prefix=f"{PROJECT_PREFIX}ch")
    status, tally = chaos.run(args, tmp_path, model=family_models("qwen2-vl"))
    report = capsys.readouterr().out
    assert status == 0, report
    assert tally.outcomes["ok"] > 20, report
    assert sum(n for fault, n in tally.faults.items() if fault != "restarts") >= 5, report
