from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mmsplit import shm

PREFIX = "mmsplittest"


@pytest.fixture
def segment():  # type: ignore[no-untyped-def]
    data = np.arange(1000, dtype=np.float32)
    piece = shm.write_segment(PREFIX, os.getpid(), memoryview(data))
    yield piece, data
    shm.unlink(piece.segment)


def test_roundtrip_and_mode(segment) -> None:  # type: ignore[no-untyped-def]
    piece, data = segment
    assert piece.nbytes == data.nbytes
    assert os.stat(shm.SHM_DIR / piece.segment).st_mode & 0o777 == 0o600
    out = np.empty_like(data)
    shm.read_into(piece, PREFIX, memoryview(out), max_segment_bytes=1 << 20)
    assert np.array_equal(out, data)


def test_slice_with_offset(segment) -> None:  # type: ignore[no-untyped-def]
    piece, data = segment
    out = np.empty(10, dtype=np.float32)
    shm.read_into(shm.Slice(piece.segment, 40, 40), PREFIX, memoryview(out), max_segment_bytes=1 << 20)
    assert np.array_equal(out, data[10:20])


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "mmsplittest/1-0123456789abcdef",
        "mmsplittest-1-0123456789abcdef\x00",
        "other-1-0123456789abcdef",
        "mmsplittest-x-0123456789abcdef",
        "mmsplittest-1-0123",
        "",
    ],
)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(shm.BadSegmentName):
        shm.parse_name(name, PREFIX)


def test_out_of_bounds_and_missing(segment) -> None:  # type: ignore[no-untyped-def]
    piece, _ = segment
    out = bytearray(16)
    with pytest.raises(shm.SegmentBounds):
        shm.read_into(
            shm.Slice(piece.segment, piece.nbytes - 8, 16), PREFIX, memoryview(out), max_segment_bytes=1 << 20
        )
    with pytest.raises(shm.SegmentBounds):
        shm.read_into(shm.Slice(piece.segment, 0, 16), PREFIX, memoryview(out), max_segment_bytes=8)
    missing = shm.new_name(PREFIX, os.getpid())
    with pytest.raises(shm.SegmentMissing):
        shm.read_into(shm.Slice(missing, 0, 16), PREFIX, memoryview(out), max_segment_bytes=1 << 20)


def test_unlink_is_idempotent(segment) -> None:  # type: ignore[no-untyped-def]
    piece, _ = segment
    assert shm.unlink(piece.segment) is True
    assert shm.unlink(piece.segment) is False
    with pytest.raises(shm.BadSegmentName):
        shm.unlink("../x")


def test_sweep_removes_segments_of_dead_owners_and_expired_leases() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan = shm.write_segment(PREFIX, dead_pid, memoryview(b"x" * 8))
    live = shm.write_segment(PREFIX, os.getpid(), memoryview(b"y" * 8))
    try:
        assert shm.sweep(PREFIX) == [orphan.segment]
        assert shm.list_segments(PREFIX) == [live.segment]
        assert shm.sweep(PREFIX, lease_s=60) == []
        assert shm.sweep(PREFIX, lease_s=60, now=os.stat(shm.SHM_DIR / live.segment).st_mtime + 61) == [live.segment]
    finally:
        shm.unlink(orphan.segment)
        shm.unlink(live.segment)


def test_namespace_id_is_stable_and_does_not_show_the_boot_id() -> None:
    assert shm.namespace_id() == shm.namespace_id()
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert boot_id not in shm.namespace_id()
    assert len(shm.namespace_id()) == 32
