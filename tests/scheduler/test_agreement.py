"""The per-step failure vote: with a fake process group, and for real over
gloo with two processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler_svc.agreement import agree_on_failures

ROOT = Path(__file__).resolve().parents[2]


class FakeGroup:
    """Plays rank `rank` of a group whose other ranks contribute fixed rows
    and messages. Records the collectives called."""

    def __init__(self, rank: int, rows: list[list[int]], messages: list[dict[int, str]]) -> None:
        self.rank = rank
        self.world_size = len(rows)
        self.rows = rows
        self.messages = messages
        self.calls: list[str] = []

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_gather")
        assert row.tolist() == self.rows[self.rank], "this rank's row is what it contributes"
        return torch.tensor(self.rows, dtype=torch.int64)

    def gather_to_0(self, obj: Any) -> list[Any] | None:
        self.calls.append("gather")
        assert obj == self.messages[self.rank]
        return list(self.messages) if self.rank == 0 else None

    def broadcast_from_0(self, obj: Any) -> Any:
        raise AssertionError("agreement never broadcasts")


def test_no_failures_costs_exactly_one_collective() -> None:
    # A row: active requests, the encoder-cache digest, then one verdict per new request.
    group = FakeGroup(0, [[3, 0, 0, 0], [3, 0, 0, 0]], [{}, {}])
    failed, active = agree_on_failures(group, [0, 0], ["", ""], active=3)
    assert failed == {}
    assert active == [3, 3]
    assert group.calls == ["all_gather"]


def test_failure_on_one_rank_is_seen_by_every_rank() -> None:
    rows = [[2, 0, 0, 0, 0], [2, 0, 0, 11, 0]]
    msgs = [{}, {1: "cannot open segment"}]
    for rank in (0, 1):
        group = FakeGroup(rank, rows, msgs)
        codes = rows[rank][2:]
        local = [msgs[rank].get(i, "") for i in range(3)]
        failed, active = agree_on_failures(group, codes, local, active=2)
        assert active == [2, 2]
        assert set(failed) == {1}
        assert failed[1].code == 11
        assert failed[1].ranks == (1,)
        assert group.calls == ["all_gather", "gather"]
        # Messages reach rank 0 only.
        assert failed[1].messages == ({1: "cannot open segment"} if rank == 0 else {})


def test_several_ranks_failing_report_the_first_failing_ranks_code() -> None:
    rows = [[0, 0, 0, 1], [0, 0, 11, 11], [0, 0, 2, 0]]
    msgs = [{1: "bad ref"}, {0: "a", 1: "b"}, {0: "c"}]
    group = FakeGroup(0, rows, msgs)
    failed, _ = agree_on_failures(group, rows[0][2:], ["", "bad ref"], active=0)
    assert failed[0].ranks == (1, 2)
    assert failed[0].code == 11
    assert failed[1].ranks == (0, 1)
    assert failed[1].code == 1
    assert failed[1].messages == {0: "bad ref", 1: "b"}


def test_step_without_new_requests_still_gathers_active_counts() -> None:
    group = FakeGroup(1, [[5, 0], [5, 0]], [{}, {}])
    failed, active = agree_on_failures(group, [], [], active=5)
    assert failed == {}
    assert active == [5, 5]


def test_each_rank_s_cache_digest_comes_back_in_the_same_collective() -> None:
    group = FakeGroup(1, [[1, 77, 0], [1, 78, 0]], [{}, {}])
    digests: list[int] = []
    failed, _ = agree_on_failures(group, [0], [""], active=1, digest=78, digests=digests)
    assert failed == {}
    assert digests == [77, 78]
    assert group.calls == ["all_gather"]


@pytest.mark.timeout(120)
def test_real_two_process_gloo_agreement() -> None:
    from mmsplit_server.serving import free_port

    port = str(free_port())
    codes = {0: ["0", "0", "2"], 1: ["0", "11", "0"]}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.gloo_agreement", str(r), port, *codes[r]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for result in results:
        assert result["active"] == [1, 2]
        assert set(result["failed"]) == {"1", "2"}
        assert result["failed"]["1"][:2] == [11, [1]]
        assert result["failed"]["2"][:2] == [2, [0]]
    assert results[0]["failed"]["1"][2] == {"1": "rank 1 failed 1"}
    assert results[1]["failed"]["1"][2] == {}
    # Plans: one buffer when they fit it, a second broadcast for the rest.
    for result in results:
        assert result["small"] == {"step": 7, "feed": [["a", 1]]}
        assert result["large_ok"]
