"""The model's tensor-parallel sums over the group's own backend (gloo, or
NCCL on GPUs), counted, so that one rank's failure inside a forward fails
that forward on every rank instead of ending the group.

transformers' TP layers sum each rank's partial output with
`torch.distributed.all_reduce`, twice per decoder layer. A rank whose
forward raises between two of those sums (an out-of-memory on one rank, a
fault of its own) never makes the rest, and the other ranks wait in the
next one until the collective timeout ends the group: a model reload for
one request. (A local CPU group sums over shared memory instead, where the
failing rank releases the others at once: `shm_allreduce.Arena.abort`.)

`CountedSums` stands in for `torch.distributed` in transformers' TP module
and counts a forward's sums. A forward of a given kind (prefill, decode)
makes the same number of sums every time, each of its hidden state's shape
``[rows, tokens, hidden]``: learned from the forwards that ran (the engine
runs a one-token prefill and decode as the group starts for this,
`Engine._learn_sums`), checked on every sum. A rank whose forward raises then `drain`s: it makes the sums the
others are still to make, of zeros of that shape, so every rank ends the
forward and meets the others in the engine's agreement, where the rows are
undone alike. Where the count or the shape is not known (no forward of that
kind has run yet, a sum of another shape was seen for it, or the error came from a
sum itself, whose peers may be anywhere) nothing is drained and the group
ends as before.

A decode forward whose ranks need not agree when all went well (the engine
agrees on a decode only after a failure) ends with one more sum, `settle`:
0 from a rank whose forward ran, 1 from one that drained, so the others
learn of the failure (`SumAborted`) and join the agreement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler_svc.shm_allreduce import SumAborted, spans_world, transformers_tp

if TYPE_CHECKING:
    import torch


class CountedSums:
    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._expected: dict[str, int] = {}  # kind of forward -> its sums
        self._unsound: set[str] = set()  # kinds with a sum of another shape, or counts that varied
        self._kind: str | None = None  # the forward under way, if any
        self._shape: tuple[int, ...] = ()
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._settled = False
        self._done = 0
        self._groups: dict[Any, bool] = {}
        self._group: Any = None  # the group the counted sums went over (the TP mesh's)
        self._flag: torch.Tensor | None = None  # `settle`'s

    def begin(
        self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, settled: bool = False
    ) -> None:
        """A forward of `kind` starts; its sums are of `shape` and `dtype`,
        on `device`; `settled`: it ends with `settle`."""
        self._kind, self._shape, self._dtype, self._device, self._settled = kind, shape, dtype, device, settled
        self._done = 0

    def end(self) -> None:
        """The forward ran to its end on this rank: its sums are the count for its kind."""
        kind, self._kind = self._kind, None
        if kind is None:
            return
        if self._expected.setdefault(kind, self._done) != self._done:
            self._unsound.add(kind)  # a kind whose count varies: never drained

    def settle(self) -> None:
        """After a forward that ran (begun with `settled`): raises
        SumAborted if another rank's forward failed and drained."""
        import torch

        if self._flag is None or self._flag.device != self._device:
            self._flag = torch.zeros(1, dtype=torch.int64, device=self._device)
        flag = self._flag.zero_()
        self._dist.all_reduce(flag)
        if int(flag.item()):
            raise SumAborted("another rank's forward failed")

    def drainable(self) -> bool:
        """Whether `drain` would: a forward is under way (not left by an
        error inside one of its sums), of a kind whose sums are known (a
        kind with none counted sums some other way)."""
        expected = self._expected.get(self._kind) if self._kind is not None else None
        sound = self._kind not in self._unsound
        return bool(expected) and sound and self._done <= expected  # type: ignore[operator]

    def drain(self) -> bool:
        """After this rank's forward raised: the sums the other ranks still
        make (and the settling one), so that all leave the forward. False,
        having done nothing, where they are not known (`drainable`)."""
        import torch

        if not self.drainable():
            self._kind = None
            return False
        kind, self._kind = self._kind, None
        zeros = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        for _ in range(self._expected[kind] - self._done):  # type: ignore[index]
            zeros.zero_()
            self._dist.all_reduce(zeros, group=self._group)  # where the others wait: the same communicator
        if self._settled:
            self._dist.all_reduce(torch.ones(1, dtype=torch.int64, device=self._device))
        return True

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        dist = self._dist
        whole = spans_world(dist, group, self._groups)
        counted = self._kind is not None and not async_op and op in (None, dist.ReduceOp.SUM) and whole
        if counted and (tuple(tensor.shape) != self._shape or tensor.dtype != self._dtype):
            self._unsound.add(self._kind)  # type: ignore[arg-type]  # a layout this module does not know
        try:
            out = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)
        except BaseException:
            # The backend's own error: the other ranks may be anywhere in
            # this forward, so it is not drained (the group ends).
            self._kind = None
            raise
        if counted:
            self._done += 1
            self._group = group
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


def install() -> CountedSums | None:
    """Count transformers' TP sums of this rank (after the group is joined);
    None where transformers has no such module any more (a failing forward
    then ends the group, as before)."""
    tensor_parallel = transformers_tp()
    if tensor_parallel is None:
        return None
    sums = CountedSums()
    tensor_parallel.dist = sums  # type: ignore[assignment]
    return sums
