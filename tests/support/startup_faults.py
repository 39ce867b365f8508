"""A tensor-reader factory that fails on rank 1 while the group starts, to
test all-or-nothing start (``--tensor-reader tests.support.startup_faults:make_reader``)."""

from __future__ import annotations

from scheduler_svc.reader import SharedMemoryReader


def make_reader(*, rank: int, prefix: str, max_bytes: int) -> SharedMemoryReader:
    if rank == 1:
        raise RuntimeError("injected start-up failure on rank 1")
    return SharedMemoryReader(rank=rank, prefix=prefix, max_bytes=max_bytes)
