"""The CUDA-IPC transport's protocol on CPU, with the fake device
(`tests/support/fake_device.py`): the pool and its lease map, references
and their checks, the release, the transport choice, the handle codec."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import cuda_ipc, files, ranges
from mmsplit_server.handoff.grants import GrantTable
from mmsplit_server.handoff.reference import CudaRef, InvalidTensorRef, TensorSpec, TensorTransportFailed
from tests.support import fake_device
from tests.support.granting import grant_table, granted
from tests.support.holder import killed_after
from tests.support.leaks import PROJECT_PREFIX
from tokenizer_svc.downstream import choose_transport

PREFIX = PROJECT_PREFIX  # the fake device writes under the test process's prefix
T = common_pb2


@pytest.fixture
def pool() -> Iterator[cuda_ipc.DevicePool]:
    cuda_ipc.configure("tests.support.fake_device:make")
    p = cuda_ipc.DevicePool(cuda_ipc.current(), PREFIX, os.getpid(), 1 << 20)
    yield p
    p.close()
    cuda_ipc.imported.tidy(every_s=0)  # what this process opened of it goes with it
    assert cuda_ipc.imported.count() == 0
    cuda_ipc.configure("")


@pytest.fixture
def table() -> Iterator[GrantTable]:
    with grant_table(PREFIX) as t:
        yield t


def spec_of(p: cuda_ipc.DevicePool, held: ranges.Held, shape: tuple[int, ...], table: GrantTable) -> TensorSpec:
    return granted(TensorSpec(T.DTYPE_UINT8, shape, cuda=CudaRef(p.handle, p.uuid, held.slice)), table)


def test_staged_bytes_reach_the_reader_and_the_range_is_freed_after(
    pool: cuda_ipc.DevicePool, table: GrantTable
) -> None:
    data = np.random.default_rng(1).integers(0, 255, 300_000, dtype=np.uint8)
    writer = pool.put(memoryview(data), wait_s=0)
    assert pool.used_bytes() == 5 * ranges.PAGE
    wire = spec_of(pool, writer, (300_000,), table).to_pb().SerializeToString()
    spec = TensorSpec.from_pb(
        T.TensorRef.FromString(wire), prefix=PREFIX, max_bytes=1 << 30, cuda_uuids=[fake_device.uuid()]
    )
    rank0 = spec.take(PREFIX)  # before Accepted
    writer.release()  # the tokenizer lets go once it hears Accepted
    lent = spec.lend(PREFIX, max_bytes=1 << 30, like=torch.device("cpu"))
    assert lent.claim is None  # a copy
    assert isinstance(lent.data, torch.Tensor)
    assert np.array_equal(lent.data.numpy(), data)
    assert pool.used_bytes() == 5 * ranges.PAGE  # rank 0 holds it ...
    assert rank0 is not None
    rank0.release()  # ... and its range is free once its last holder lets go
    assert pool.used_bytes() == 0


def test_a_full_pool_says_so(pool: cuda_ipc.DevicePool) -> None:
    held = [pool.put(memoryview(np.zeros(500_000, np.uint8)), wait_s=0) for _ in range(2)]
    with pytest.raises(ranges.SlabFull):
        pool.put(memoryview(np.zeros(500_000, np.uint8)), wait_s=0.01)
    for h in held:
        h.release()
    assert pool.used_bytes() == 0


def test_an_importer_killed_holding_a_range_frees_it(pool: cuda_ipc.DevicePool) -> None:
    writer = pool.put(memoryview(np.ones(1000, np.uint8)), wait_s=0)
    piece = writer.slice
    args = f"{piece.segment!r}, {piece.offset}, {piece.nbytes}"
    take = f"from mmsplit_server.handoff import files, ranges; ranges.take(files.Slice({args}), {PREFIX!r})"
    with killed_after(take):
        writer.release()
        assert pool.used_bytes() == ranges.PAGE, "the importer holds it"
    assert pool.used_bytes() == 0


def test_references_are_checked(pool: cuda_ipc.DevicePool, table: GrantTable) -> None:
    writer = pool.put(memoryview(np.ones(64, np.uint8)), wait_s=0)
    try:
        good = spec_of(pool, writer, (64,), table).to_pb()
        with pytest.raises(InvalidTensorRef, match="not offered"):
            TensorSpec.from_pb(good, prefix=PREFIX, max_bytes=1 << 20)
        with pytest.raises(InvalidTensorRef, match="cannot open"):
            TensorSpec.from_pb(good, prefix=PREFIX, max_bytes=1 << 20, cuda_uuids=["GPU-other"])
        bad_lease = T.TensorRef()
        bad_lease.CopyFrom(good)
        bad_lease.cuda_ipc.lease = files.new_name(PREFIX, 1)  # a segment's name, not a lease map's
        with pytest.raises(InvalidTensorRef, match="lease"):
            TensorSpec.from_pb(bad_lease, prefix=PREFIX, max_bytes=1 << 20, cuda_uuids=[pool.uuid])
        wrong_size = T.TensorRef()
        wrong_size.CopyFrom(good)
        wrong_size.cuda_ipc.nbytes = 65
        with pytest.raises(InvalidTensorRef, match="nbytes"):
            TensorSpec.from_pb(wrong_size, prefix=PREFIX, max_bytes=1 << 20, cuda_uuids=[pool.uuid])
        freed = TensorSpec.from_pb(good, prefix=PREFIX, max_bytes=1 << 20, cuda_uuids=[pool.uuid])
    finally:
        writer.release()
    # Nobody holds the range any more: the reference cannot be taken.
    with pytest.raises(TensorTransportFailed, match="not held"):
        freed.take(PREFIX)


def test_cuda_ipc_is_chosen_only_for_the_same_gpu_and_dev_shm() -> None:
    def info(uuids: list[str], namespace: str = "ns", transports: tuple[int, ...] = (2, 1, 3)) -> T.ServerInfo:
        return T.ServerInfo(transports=transports, cuda_device_uuids=uuids, shm_namespace=namespace, shm_prefix="p")

    assert choose_transport(info(["G"]), "ns", "p", "G") == T.TRANSPORT_CUDA_IPC
    assert choose_transport(info(["H"]), "ns", "p", "G") == T.TRANSPORT_SHM
    assert choose_transport(info(["G"]), "ns", "p", "") == T.TRANSPORT_SHM
    assert choose_transport(info(["G"], transports=(1, 3)), "ns", "p", "G") == T.TRANSPORT_SHM
    assert choose_transport(info(["G"], namespace="other"), "ns", "p", "G") == T.TRANSPORT_INLINE


def test_handles_are_plain_fields_never_pickles() -> None:
    fields = (0, b"\x01\x02", 4096, 0, b"ref", 8, b"", False)
    assert cuda_ipc._decode(cuda_ipc._encode(fields)) == fields
    for bad in (b"\x80\x04K\x01.", b'[{"x": 1}]', b"[[1]]", b"[" + b"1," * 3000 + b"1]"):
        with pytest.raises(ValueError, match="not a CUDA IPC handle"):
            cuda_ipc._decode(bad)


def test_a_tokenizer_restarted_20_times_leaves_at_most_the_cap_open() -> None:
    """An importer opens each exporter's pool once and keeps it for the
    next read; 20 exporters in turn (a tokenizer restarted 20 times, none of
    them stopping cleanly) leave at most the cap open, and once their lease
    maps are gone (their tokenizer stopped, or the janitor swept after it)
    every one is closed, its memory let go."""
    cuda_ipc.configure("tests.support.fake_device:make")
    backend = cuda_ipc.current()
    importer = cuda_ipc.Imported(max_pools=3)
    already = fake_device.FakeOpened.live
    pools = []
    try:
        for i in range(20):
            pool = cuda_ipc.DevicePool(backend, PREFIX, os.getpid(), 1 << 20)
            pools.append(pool)
            data = np.full(1000, i, np.uint8)
            held = pool.put(memoryview(data), wait_s=0)
            piece = held.slice
            got = importer.read(backend, pool.handle, pool.leases.name, piece.offset, piece.nbytes, torch.device("cpu"))
            assert np.array_equal(got.numpy(), data)
            held.release()
            assert importer.count() == min(i + 1, 3)
            assert fake_device.FakeOpened.live - already == importer.count()
        # The last three are open; their exporters stop.
        for pool in pools[-3:]:
            pool.close()
        assert importer.tidy(every_s=0) == 3
        assert importer.count() == 0
        assert fake_device.FakeOpened.live == already
        # A read of a gone exporter's pool is refused, and opens nothing.
        with pytest.raises(cuda_ipc.DeviceError):
            importer.read(backend, pools[-1].handle, pools[-1].leases.name, 0, 1000, torch.device("cpu"))
        assert importer.count() == 0
    finally:
        importer.close_all()
        for pool in pools[:-3]:
            pool.close()
        cuda_ipc.configure("")
    assert not [n for n in files.list_segments(PREFIX) if n.split("-")[1] == str(os.getpid())]
