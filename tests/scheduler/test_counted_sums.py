"""`CountedSums`: what a rank whose forward raised may drain, and what it
then sums (a fake backend records the calls; the real one is exercised at
TP=2 over gloo in tests/e2e/test_engine.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scheduler_svc.counted_sums import CountedSums
from scheduler_svc.shm_allreduce import SumAborted

CPU = torch.device("cpu")


class FakeDist:
    class ReduceOp:
        SUM = "sum"
        MAX = "max"

    def __init__(self, others: int = 0) -> None:
        self.calls: list[tuple[tuple[int, ...], torch.dtype, float]] = []
        self.others = others  # what the other ranks add to a settling sum
        self.groups: list[Any] = []

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        self.calls.append((tuple(tensor.shape), tensor.dtype, float(tensor.sum())))
        self.groups.append(group)
        if tensor.dtype == torch.int64:
            tensor += self.others

    def get_world_size(self) -> int:
        return 2

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return [0, 1]


def counted(others: int = 0) -> tuple[CountedSums, FakeDist]:
    sums = CountedSums()
    fake = FakeDist(others)
    sums._dist = fake  # type: ignore[assignment]
    return sums, fake


def forward(sums: CountedSums, kind: str, shape: tuple[int, ...], n: int, *, fail_after: int | None = None) -> None:
    sums.begin(kind, shape, torch.float32, CPU, settled=kind == "decode")
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("injected")
        sums.all_reduce(torch.ones(shape), group="tp")
    sums.end()


def test_a_failed_forward_drains_the_sums_its_kind_makes_in_zeros_then_settles() -> None:
    sums, fake = counted()
    forward(sums, "decode", (4, 1, 8), 6)
    fake.calls.clear()
    fake.groups.clear()
    with pytest.raises(RuntimeError):
        forward(sums, "decode", (3, 1, 8), 6, fail_after=2)
    assert sums.drainable()
    assert sums.drain()
    assert fake.calls[:2] == [((3, 1, 8), torch.float32, 3 * 8.0)] * 2  # the two made before the error
    assert fake.calls[2:6] == [((3, 1, 8), torch.float32, 0.0)] * 4  # the four the other rank still makes
    assert fake.calls[6:] == [((1,), torch.int64, 1.0)]  # "this rank failed", for the other's settle
    assert fake.groups[2:6] == ["tp"] * 4, "drained over the group the forward's sums use"
    assert not sums.drainable(), "once drained, no forward is under way"


def test_nothing_is_drained_where_the_sums_are_not_known() -> None:
    sums, fake = counted()
    with pytest.raises(RuntimeError):  # the first forward of its kind: its count is unknown
        forward(sums, "prefill", (1, 5, 8), 4, fail_after=1)
    assert not sums.drain()
    forward(sums, "prefill", (1, 5, 8), 4)
    with pytest.raises(RuntimeError):
        forward(sums, "decode", (1, 1, 8), 4, fail_after=1)
    assert not sums.drain(), "a prefill's count says nothing of a decode's"
    fake.calls.clear()
    # A sum of a shape the forward did not announce: this module does not know the layout.
    sums.begin("prefill", (1, 5, 8), torch.float32, CPU)
    sums.all_reduce(torch.ones(5, 8), group="tp")
    sums.end()
    with pytest.raises(RuntimeError):
        forward(sums, "prefill", (1, 5, 8), 4, fail_after=1)
    assert not sums.drain()
    assert len(fake.calls) == 2, "nothing more was summed"
    # Only that kind: a decode (which never runs a vision tower, say) still drains.
    forward(sums, "decode", (1, 1, 8), 4)
    with pytest.raises(RuntimeError):
        forward(sums, "decode", (1, 1, 8), 4, fail_after=3)
    assert sums.drain()


def test_an_error_inside_a_sum_is_not_drained() -> None:
    """The backend's own error (a peer gone, a timeout): the other ranks may
    be anywhere in the forward, so nothing more is summed."""
    sums, fake = counted()
    forward(sums, "prefill", (1, 5, 8), 4)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    fake.all_reduce = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="peer"):
        forward(sums, "prefill", (1, 5, 8), 4)
    assert not sums.drainable()
    assert not sums.drain()


def test_a_kind_whose_count_varies_or_has_no_sum_is_never_drained() -> None:
    sums, _ = counted()
    forward(sums, "prefill", (1, 5, 8), 4)
    forward(sums, "prefill", (1, 5, 8), 3)
    with pytest.raises(RuntimeError):
        forward(sums, "prefill", (1, 5, 8), 4, fail_after=1)
    assert not sums.drainable()
    other, _ = counted()
    forward(other, "decode", (1, 1, 8), 0)  # sums that go some other way (DTensor, say)
    with pytest.raises(RuntimeError):
        forward(other, "decode", (1, 1, 8), 1, fail_after=0)
    assert not other.drainable()


def test_settle_raises_where_another_rank_drained() -> None:
    sums, _ = counted(others=1)
    forward(sums, "decode", (2, 1, 8), 2)
    with pytest.raises(SumAborted):
        sums.settle()
    calm, _ = counted(others=0)
    forward(calm, "decode", (2, 1, 8), 2)
    calm.settle()
