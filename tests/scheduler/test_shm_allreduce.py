"""The model's TP sums over shared memory (`scheduler_svc.shm_allreduce`),
with real forked ranks (tests/support/shm_sums.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from mmsplit_server.serving import free_port
from scheduler_svc.shm_allreduce import supported
from tests.support.services import ROOT

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not supported(), reason="the arena is used on x86 only; other hosts keep gloo"),
]


def run(world: int, case: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.shm_sums", str(world), case, str(free_port())],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    for result in results:
        assert "exception" not in result, result["exception"]
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_holds_the_sum_in_rank_order_bit_for_bit(world: int) -> None:
    """float32 and bfloat16, from one element to more than a slot (summed in
    two pieces): every rank's result equals the sum in rank order exactly,
    so the ranks never drift apart."""
    results = run(world, "sums")
    for result in results:
        pieces = result.pop("pieces")
        assert pieces == 5 + 4, "four sizes per dtype, the largest float32 one in two pieces"
        assert all(equal for equal, _ in result.values()), result
    assert all(r == results[0] for r in results[1:])


def test_a_rank_that_never_comes_fails_the_sum_after_the_timeout() -> None:
    rank0, _ = run(2, "late")
    assert rank0["error"].startswith("shared-memory all-reduce: rank(s) [1] did not arrive within 1s"), rank0
    assert 1.0 <= rank0["waited"] < 2.5, rank0


def test_only_a_sum_of_a_contiguous_cpu_tensor_takes_the_arena() -> None:
    """What transformers' TP layers call (`dist.all_reduce` of their output)
    goes through the arena; a MAX, a strided tensor and every other
    attribute are torch.distributed's own."""
    for rank, result in enumerate(run(2, "routed")):
        assert result["sum"] == [[3.0] * 8, 1], (rank, result)
        assert result["max"] == [[2.0] * 8, 1], (rank, result)
        assert result["strided"] == [[3.0] * 8, 1], (rank, result)
        assert result["world"] == 2


def test_a_rank_that_aborts_releases_the_one_waiting_and_both_go_on() -> None:
    """What a forward that fails on one rank between two sums does: the
    other rank leaves its sum at once (not after the timeout), and after the
    agreement and `resync` both sum right again."""
    rank0, rank1 = run(2, "aborted")
    assert rank0["first"] == rank1["first"] == [3.0] * 4
    assert rank0["second"] == "aborted", rank0
    assert rank0["waited"] < 5, rank0
    assert rank0["after"] == rank1["after"] == [3.0] * 4
