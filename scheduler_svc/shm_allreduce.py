"""The model's tensor-parallel all-reduces over shared memory, for a CPU
group whose ranks are forks of rank 0 on one host.

transformers' TP layers sum each rank's partial output with
`torch.distributed.all_reduce`, twice per decoder layer. Over gloo that is a
TCP round trip through gloo's threads: ~570 µs for a 2 KB tensor on the
2-core development host, ~500 µs for 64 KB, against ~9 and ~20 µs here
(`bench/tp_sums.py`). Sixteen of them per step of an 8-layer model were most
of what TP=2 added to a step.

`Arena` is an anonymous shared mapping made by rank 0 before it forks the
other ranks (so no name in /dev/shm, nothing to unlink, and it goes with the
last process that maps it). Each rank has a sequence counter (its own cache
line) and, per parity of the sequence, a slot of `SLOT_BYTES`. An all-reduce
of sequence s: every rank copies its part into its slot of parity s % 2,
publishes s, waits until every rank has published s, and sums the slots in
rank order (the same additions on every rank, so every rank holds the same
bits). Tensors larger than a slot go in slot-sized pieces. A slot of parity
p is written again at s + 2, which a rank reaches only after every rank
published s + 1, i.e. after every rank finished reading s.

The order "data, then counter" seen by another core needs x86's total store
order; elsewhere the group keeps gloo (`supported`). A rank that does not
arrive within the collective timeout fails the step, as a gloo timeout does.

A rank whose forward raises between two sums calls `abort`: the ranks
waiting for it in a sum raise `SumAborted` at once (instead of waiting out
the timeout), every rank meets the others in the engine's agreement on the
forward, and `resync` puts every rank on one sequence again.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

# This module imports torch and numpy where it uses them: rank 0 makes the
# arena in `scheduler_svc.group`, which a spawned rank imports first and
# which must stay light (see there).

SLOT_BYTES = 4 << 20
_LINE = 64  # bytes between two ranks' counters
_SPINS = 2000  # polls before a waiting rank yields its core
_YIELD_S = 0.002  # yielding this long, a waiting rank sleeps between polls
_VIEWS = 256  # shapes whose slot views are kept


def supported() -> bool:
    """Whether this machine orders one core's stores as every other core sees them (x86)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SumAborted(RuntimeError):
    """Another rank's forward failed while this rank waited for it in a sum."""


class Arena:
    """Shared memory for `world` ranks; made before the fork, `attach`ed
    by each rank after it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._header = _LINE * (world + 1)  # a counter per rank, then the abort word
        self._map = mmap.mmap(-1, self._header + 2 * world * SLOT_BYTES)  # MAP_SHARED | MAP_ANONYMOUS
        self.rank = -1
        self.timeout_s = 60.0
        self._seq = 0
        self._bytes: torch.Tensor | None = None
        self._add: Any = None  # torch.add, once attached
        self._counters: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}
        self._abort_word: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._seen = 0  # the abort word's value this rank has dealt with

    def attach(self, rank: int, timeout_s: float) -> None:
        import numpy as np
        import torch

        self.rank = rank
        self.timeout_s = timeout_s
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._add = torch.add
        self._counters = np.ndarray((self.world,), dtype=np.int64, buffer=self._map, strides=(_LINE,))
        self._abort_word = np.ndarray((1,), dtype=np.int64, buffer=self._map, offset=_LINE * self.world)
        self._seen = int(self._abort_word[0])

    def abort(self) -> None:
        """This rank's forward failed: release the ranks waiting for it."""
        assert self._abort_word is not None
        self._abort_word[0] = self._seen + 1

    def resync(self, sequences: list[int]) -> None:
        """Once every rank is past the agreement after an aborted forward
        (`sequences`: every rank's `sums` there): go on from the furthest.
        No rank reads a slot then, and every counter is at most that."""
        assert self._abort_word is not None
        self._seq = max(sequences)
        self._seen = int(self._abort_word[0])

    @property
    def sums(self) -> int:
        """Pieces this rank has summed so far."""
        return self._seq

    def _slots(self, parity: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        """Every rank's slot of `parity` as `n` values of `dtype` (views made
        once per shape: a step sums the same few shapes again and again)."""
        key = (parity, dtype, n)
        views = self._views.get(key)
        if views is None:
            assert self._bytes is not None
            if len(self._views) >= _VIEWS:
                self._views.clear()
            starts = [self._header + (parity * self.world + r) * SLOT_BYTES for r in range(self.world)]
            views = self._views[key] = [self._bytes[s : s + n * dtype.itemsize].view(dtype) for s in starts]
        return views

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (contiguous, on CPU) over the ranks, in place."""
        flat = tensor.view(-1)
        step = SLOT_BYTES // tensor.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce_piece(flat[start : start + step])

    def _reduce_piece(self, part: torch.Tensor) -> None:
        assert self._counters is not None
        self._seq += 1
        slots = self._slots(self._seq & 1, part.dtype, part.numel())
        slots[self.rank].copy_(part)
        self._counters[self.rank] = self._seq
        self._wait(self._seq)
        self._add(slots[0], slots[1], out=part)
        for other in slots[2:]:
            part.add_(other)

    def _wait(self, seq: int) -> None:
        counters, aborted = self._counters, self._abort_word
        assert counters is not None
        assert aborted is not None
        polls = 0
        began = 0.0
        while counters.min() < seq:
            if aborted[0] != self._seen:
                if counters.min() >= seq:
                    return  # every rank came before the abort: this sum is whole
                raise SumAborted("another rank's forward failed (shared-memory all-reduce aborted)")
            polls += 1
            if polls < _SPINS:
                continue
            now = time.monotonic()
            if not began:
                began = now
            elif now - began > self.timeout_s:
                late = [r for r in range(self.world) if int(counters[r]) < seq]
                raise RuntimeError(
                    f"shared-memory all-reduce: rank(s) {late} did not arrive within {self.timeout_s:.0f}s"
                )
            if now - began < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(50e-6)


class _TPDist:
    """`torch.distributed` as transformers' TP layers see it: `all_reduce`
    of a CPU tensor over the whole group goes through the arena; everything
    else is torch's own."""

    def __init__(self, arena: Arena) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._arena = arena
        self._whole: dict[Any, bool] = {}

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        dist = self._dist
        op = dist.ReduceOp.SUM if op is None else op
        if not async_op and op == dist.ReduceOp.SUM and self._fits(tensor, group):
            self._arena.all_reduce_(tensor)
            return None
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def _fits(self, tensor: torch.Tensor, group: Any) -> bool:
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.is_floating_point():
            return False
        return spans_world(self._dist, group, self._whole)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


def spans_world(dist: Any, group: Any, known: dict[Any, bool]) -> bool:
    """Whether `group` (None: the default one) is every rank of the world,
    as transformers' TP groups are; remembered in `known`."""
    whole = known.get(group)
    if whole is None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        whole = known[group] = ranks == list(range(dist.get_world_size()))
    return whole


def transformers_tp() -> Any:
    """transformers' tensor-parallel module, whose `dist` its TP layers sum
    through and which a stand-in may replace; None where it has no such
    module, or its `dist` is not torch's (replaced already)."""
    import torch.distributed as dist

    try:
        from transformers.distributed import tensor_parallel
    except ImportError:
        return None
    return tensor_parallel if getattr(tensor_parallel, "dist", None) is dist else None


def install(arena: Arena, timeout_s: float) -> bool:
    """Route transformers' TP all-reduces of this rank through `arena`
    (after the group is joined). False where transformers has no such
    module any more (the group then stays on gloo, which is only slower)."""
    import torch.distributed as dist

    tensor_parallel = transformers_tp()
    if tensor_parallel is None:
        return False
    arena.attach(dist.get_rank(), timeout_s)
    tensor_parallel.dist = _TPDist(arena)  # type: ignore[assignment]
    return True
