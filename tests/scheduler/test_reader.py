"""The rank's tensor reader lends slab slices in place (`scheduler_svc.reader`):
no copy, a lock of the rank's own that outlives the sender's, let go when
the step ends; a reference nobody holds is refused and leaves nothing held."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import files, ranges, slab
from mmsplit_server.handoff.grants import GrantTable
from mmsplit_server.handoff.reference import TensorSpec, TensorTransportFailed
from scheduler_svc.reader import SharedMemoryReader
from tests.support.granting import grant_table, granted
from tests.support.leaks import PROJECT_PREFIX, own_slab

PREFIX = PROJECT_PREFIX + "reader"
MIB = 1 << 20
SHAPE = (3, 64, 64)


@pytest.fixture
def owned() -> Iterator[ranges.Slab]:
    with own_slab(PREFIX, 4 * MIB) as s:
        yield s


@pytest.fixture
def table() -> Iterator[GrantTable]:
    with grant_table(PREFIX) as t:
        yield t


@pytest.fixture
def reader() -> SharedMemoryReader:
    return SharedMemoryReader(rank=1, prefix=PREFIX, max_bytes=MIB)


def sent(owned: ranges.Slab, seed: int, table: GrantTable) -> tuple[np.ndarray, ranges.Held, TensorSpec]:
    """A tensor written into the slab, granted, and held by its sender
    (the scheduler's rank 0 after Accepted, in service)."""
    data = np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)
    writer = slab.place(owned.name, PREFIX, memoryview(data), wait_s=0)  # type: ignore[arg-type]
    sender = ranges.take(writer.slice, PREFIX)
    writer.release()
    return data, sender, granted(TensorSpec(common_pb2.DTYPE_FLOAT32, SHAPE, shm=writer.slice), table)


def in_slab(owned: ranges.Slab, tensor: torch.Tensor) -> bool:
    mapping = slab.view(files.Slice(owned.name, 0, owned.size), PREFIX)
    try:
        start = address(mapping)
        return start <= tensor.data_ptr() < start + owned.size
    finally:
        mapping.release()


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_slab_slice_is_lent_in_place_and_held_until_the_step_ends(
    owned: ranges.Slab, reader: SharedMemoryReader, table: GrantTable
) -> None:
    data, sender, spec = sent(owned, 1, table)
    got = reader.read("r1", spec)
    assert torch.equal(got, torch.from_numpy(data))
    assert in_slab(owned, got), "read in place, through the slab's mapping"
    sender.release()  # rank 0 lets go after the step: the other ranks hold on
    assert owned.used_bytes() > 0, "the reading rank holds the slice while its step uses it"
    assert torch.equal(got, torch.from_numpy(data))
    reader.end_step()
    assert owned.used_bytes() == 0
    reader.end_step()  # nothing more to let go


def test_a_slice_nobody_holds_is_refused_and_nothing_stays_held(
    owned: ranges.Slab, reader: SharedMemoryReader, table: GrantTable
) -> None:
    _, sender, spec = sent(owned, 2, table)
    sender.release()
    with pytest.raises(TensorTransportFailed):
        reader.read("r2", spec)
    assert owned.used_bytes() == 0
    reader.end_step()


def test_inline_bytes_are_lent_as_they_arrived(reader: SharedMemoryReader) -> None:
    data = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    spec = TensorSpec(common_pb2.DTYPE_FLOAT32, SHAPE, inline=data.tobytes())
    got = reader.read("r3", spec)
    assert torch.equal(got, torch.from_numpy(data))
    assert spec.inline is not None
    assert got.data_ptr() == address(memoryview(spec.inline)), "no copy of the bytes that arrived"
    reader.end_step()


def test_the_step_ends_even_when_a_release_fails(
    owned: ranges.Slab, reader: SharedMemoryReader, table: GrantTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent_ = [sent(owned, seed, table) for seed in (5, 6)]
    for _, _, spec in sent_:
        reader.read("r", spec)
    for _, sender, _ in sent_:
        sender.release()

    def broken(self: ranges.Held) -> None:
        raise OSError("injected")

    monkeypatch.setattr(ranges.Held, "release", broken)
    reader.end_step()  # logs, never raises
    assert owned.used_bytes() == 0, "every lent slice let go of all the same"


@pytest.mark.parametrize(
    ("wire", "dtype"),
    [
        (common_pb2.DTYPE_FLOAT32, torch.float32),
        (common_pb2.DTYPE_FLOAT16, torch.float16),
        (common_pb2.DTYPE_BFLOAT16, torch.bfloat16),
        (common_pb2.DTYPE_UINT8, torch.uint8),
        (common_pb2.DTYPE_INT64, torch.int64),
    ],
)
def test_every_dtype_is_lent_in_place_with_its_values(
    reader: SharedMemoryReader, wire: int, dtype: torch.dtype
) -> None:
    # bfloat16, which numpy lacks, is lent as its bits and viewed back.
    want = (torch.arange(int(np.prod(SHAPE))) % 251 * 0.5).to(dtype).reshape(SHAPE)
    raw = want.view(torch.uint8).numpy().tobytes()
    spec = TensorSpec(wire, SHAPE, inline=raw)
    got = reader.read("r4", spec)
    assert got.dtype == dtype
    assert got.shape == SHAPE
    assert torch.equal(got, want)
    assert got.data_ptr() == address(memoryview(raw)), "lent, not copied"
    reader.end_step()
