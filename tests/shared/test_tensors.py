from __future__ import annotations

import os

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import files, segment
from mmsplit_server.handoff.reference import InvalidTensorRef, TensorSpec, TensorTransportFailed
from tests.support.granting import grant_table, granted
from tests.support.leaks import PROJECT_PREFIX

PREFIX = PROJECT_PREFIX + "tensors"  # this file's own, in this test process's
CAP = 1 << 20


def ref(**kwargs: object) -> common_pb2.TensorRef:
    return common_pb2.TensorRef(**kwargs)  # type: ignore[arg-type]


NAME = f"{PREFIX}-{os.getpid()}-0123456789abcdef"
TABLE = f"{PREFIX}-{os.getpid()}-grant0123456789a"


def good_shm_ref(name: str, nbytes: int = 24, table: str = TABLE) -> common_pb2.TensorRef:
    return ref(
        dtype=common_pb2.DTYPE_FLOAT32,
        shape=[2, 3],
        shm=common_pb2.ShmSlice(segment=name, offset=0, nbytes=nbytes),
        grant=common_pb2.Grant(table=table, index=0, tag=b"t" * 16),
    )


def ungranted(message: common_pb2.TensorRef) -> common_pb2.TensorRef:
    message.ClearField("grant")
    return message


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (ref(dtype=99, shape=[1], inline=b"x"), "dtype"),
        (ref(dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[1], inline=b"x"), "dtype"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[], inline=b""), "shape"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[0], inline=b""), "shape"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[-4], inline=b""), "shape"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[1 << 40], inline=b""), "cap"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[4], inline=b"abc"), "inline"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[4]), "location"),
        (ref(dtype=common_pb2.DTYPE_UINT8, shape=[4], cuda_ipc=common_pb2.CudaIpcHandle()), "cuda"),
        (good_shm_ref(NAME, nbytes=25), "nbytes"),
        (good_shm_ref("../../etc/passwd"), "name"),
        (good_shm_ref(f"other-{os.getpid()}-0123456789abcdef"), "prefix"),
        (ungranted(good_shm_ref(NAME)), "no grant"),
        (good_shm_ref(NAME, table=f"other-{os.getpid()}-grant0123456789a"), "grant prefix"),
        (good_shm_ref(NAME, table=NAME), "not a grant table"),
    ],
)
def test_malformed_references_are_invalid(message: common_pb2.TensorRef, why: str) -> None:
    with pytest.raises(InvalidTensorRef):
        TensorSpec.from_pb(message, prefix=PREFIX, max_bytes=CAP)


def test_roundtrip_shm_and_inline() -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    piece = segment.place(PREFIX, os.getpid(), memoryview(data))
    try:
        with grant_table(PREFIX) as table:
            wire = granted(TensorSpec.from_pb(good_shm_ref(piece.segment), prefix=PREFIX, max_bytes=CAP), table).to_pb()
            spec = TensorSpec.from_pb(wire, prefix=PREFIX, max_bytes=CAP)
            assert TensorSpec.from_pb(spec.to_pb(), prefix=PREFIX, max_bytes=CAP) == spec
            out = np.empty_like(data)
            spec.read_into(memoryview(out), prefix=PREFIX, max_bytes=CAP)
            assert np.array_equal(out, data)
            claim = spec.take(PREFIX)
            assert claim is not None
            claim.release()  # its owner's release removes a one-off segment
            with pytest.raises(TensorTransportFailed):
                spec.read_into(memoryview(out), prefix=PREFIX, max_bytes=CAP)
    finally:
        files.unlink(piece.segment)
    inline = TensorSpec.from_pb(
        ref(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 3], inline=data.tobytes()), prefix=PREFIX, max_bytes=CAP
    )
    out = np.empty_like(data)
    inline.read_into(memoryview(out), prefix=PREFIX, max_bytes=CAP)
    assert np.array_equal(out, data)


def test_slice_past_the_end_of_a_real_segment_is_invalid() -> None:
    piece = segment.place(PREFIX, os.getpid(), memoryview(b"\0" * 24))
    try:
        with grant_table(PREFIX) as table:
            message = good_shm_ref(piece.segment)
            message.shm.offset = 16
            spec = granted(TensorSpec.from_pb(message, prefix=PREFIX, max_bytes=CAP), table)
            with pytest.raises(InvalidTensorRef):
                spec.read_into(memoryview(bytearray(24)), prefix=PREFIX, max_bytes=CAP)
    finally:
        files.unlink(piece.segment)
