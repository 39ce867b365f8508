"""Failure injection by substitution: a tensor reader that fails on one
rank, and an engine hook that fails a prefill.

The scheduler under test is started with
``--tensor-reader tests.support.faults:make_reader``. A request whose id
contains ``inject-read-failure-rank<N>`` fails its tensor read on rank N only
(as if that rank could not open the segment); one whose id contains
``wedge-the-step`` blocks its read forever (a wedged step); every other read
is real.

With ``--engine-hook tests.support.faults`` too: a request whose id contains
``inject-prefill-failure-rank<N>`` raises while rank N prepares its prefill
(after the reads' agreement: as positions or an encoder of one rank might),
and one whose id contains ``inject-short-encoder-output`` gets an encoder
output one row short of its placeholders on every rank. A prefill forward
(or a chunk of one) that holds a request whose id contains
``inject-forward-failure-rank<N>`` raises on rank N inside the model, before its second decoder layer (after
the first layer's TP sums, while the other ranks go on to the next). A
decode forward that holds a request whose id contains
``inject-decode-failure`` raises on every rank, before the model; one whose
id contains ``inject-decode-failure-rank<N>`` raises on rank N only, inside
the model as above. Keeping the prefix-cache blocks of a request whose id
contains ``inject-keep-failure-rank<N>`` raises on rank N only (as an
out-of-memory there might): that rank's store is spoiled.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator

import torch

from mmsplit_server.handoff.reference import TensorSpec, TensorTransportFailed
from scheduler_svc.plan import NewRequest
from scheduler_svc.reader import SharedMemoryReader

MARKER = re.compile(r"inject-read-failure-rank(\d+)")
WEDGE = "wedge-the-step"


class FaultyReader(SharedMemoryReader):
    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        m = MARKER.search(request_id)
        if m is not None and int(m.group(1)) == self.rank:
            raise TensorTransportFailed(f"injected read failure on rank {self.rank}")
        if WEDGE in request_id:
            threading.Event().wait()  # a read that never returns: only the step watchdog ends it
        return super().read(request_id, spec)


def make_reader(*, rank: int, prefix: str, max_bytes: int) -> FaultyReader:
    return FaultyReader(rank=rank, prefix=prefix, max_bytes=max_bytes)


def failing_request_id(rank: int, suffix: str) -> str:
    return f"inject-read-failure-rank{rank}-{suffix}"


PREFILL_MARKER = re.compile(r"inject-prefill-failure-rank(\d+)")
SHORT = "inject-short-encoder-output"


def before_prefill(rank: int, request: NewRequest) -> None:
    m = PREFILL_MARKER.search(request.request_id)
    if m is not None and int(m.group(1)) == rank:
        raise RuntimeError(f"injected prefill failure on rank {rank}")


FORWARD_MARKER = re.compile(r"inject-forward-failure-rank(\d+)")


@contextlib.contextmanager
def in_prefill_forward(rank: int, requests: list[NewRequest], model: torch.nn.Module) -> Iterator[None]:
    if any((m := FORWARD_MARKER.search(r.request_id)) and int(m.group(1)) == rank for r in requests):
        with _raising_in_layer_1(model, f"injected into the prefill forward on rank {rank}"):
            yield
    else:
        yield


DECODE_MARKER = "inject-decode-failure"
DECODE_RANK_MARKER = re.compile(r"inject-decode-failure-rank(\d+)")


@contextlib.contextmanager
def in_decode_forward(rank: int, requests: list[NewRequest], model: torch.nn.Module) -> Iterator[None]:
    ids = [r.request_id for r in requests]
    if any(DECODE_MARKER in rid and not DECODE_RANK_MARKER.search(rid) for rid in ids):
        raise RuntimeError(f"injected into a decode forward on rank {rank}")
    if any((m := DECODE_RANK_MARKER.search(rid)) and int(m.group(1)) == rank for rid in ids):
        with _raising_in_layer_1(model, f"injected into a decode forward on rank {rank} only"):
            yield
    else:
        yield


@contextlib.contextmanager
def _raising_in_layer_1(model: torch.nn.Module, message: str) -> Iterator[None]:
    """The model raises before its second decoder layer (after the first
    layer's TP sums: the other ranks go on to the next)."""
    layer = model.get_decoder().layers[1]  # type: ignore[operator,index]

    def fail(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError(message)

    handle = layer.register_forward_pre_hook(fail)
    try:
        yield
    finally:
        handle.remove()


def on_encoded(rank: int, request: NewRequest, index: int, output: torch.Tensor) -> torch.Tensor:
    return output[:-1] if SHORT in request.request_id else output


KEEP_MARKER = re.compile(r"inject-keep-failure-rank(\d+)")


def before_keep(rank: int, request: NewRequest) -> None:
    m = KEEP_MARKER.search(request.request_id)
    if m is not None and int(m.group(1)) == rank:
        raise RuntimeError(f"injected into keeping the prefix-cache blocks on rank {rank}")
