"""Failure injection by substitution: a tensor reader that fails on one rank.

The scheduler under test is started with
``--tensor-reader tests.support.faults:make_reader``. A request whose id
contains ``inject-read-failure-rank<N>`` fails its tensor read on rank N only
(as if that rank could not open the segment); one whose id contains
``wedge-the-step`` blocks its read forever (a wedged step); every other read
is real.
"""

from __future__ import annotations

import re
import threading

import torch

from mmsplit_server.handoff.reference import TensorSpec, TensorTransportFailed
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
