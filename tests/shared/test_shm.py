from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mmsplit_server.handoff import files, reference
from mmsplit_server.handoff import segment as one_off
from tests.support.leaks import PROJECT_PREFIX
from tests.support.planted import planted as plant

PREFIX = PROJECT_PREFIX + "shm"  # this file's own, in this test process's


@pytest.fixture
def segment():  # type: ignore[no-untyped-def]
    data = np.arange(1000, dtype=np.float32)
    piece = one_off.place(PREFIX, os.getpid(), memoryview(data))
    yield piece, data
    files.unlink(piece.segment)


def test_roundtrip_and_mode(segment) -> None:  # type: ignore[no-untyped-def]
    piece, data = segment
    assert piece.nbytes == data.nbytes
    assert os.stat(files.SHM_DIR / piece.segment).st_mode & 0o777 == 0o600
    out = np.empty_like(data)
    one_off.read_into(piece, PREFIX, memoryview(out), max_segment_bytes=1 << 20)
    assert np.array_equal(out, data)


def test_slice_with_offset(segment) -> None:  # type: ignore[no-untyped-def]
    piece, data = segment
    out = np.empty(10, dtype=np.float32)
    one_off.read_into(files.Slice(piece.segment, 40, 40), PREFIX, memoryview(out), max_segment_bytes=1 << 20)
    assert np.array_equal(out, data[10:20])


def test_read_bytes_of_a_segment_is_capped(segment) -> None:  # type: ignore[no-untyped-def]
    piece, data = segment
    got = reference.read_bytes(files.Slice(piece.segment, 40, 40), PREFIX, max_segment_bytes=1 << 20)
    assert isinstance(got, bytes)
    assert got == data[10:20].tobytes()
    with pytest.raises(files.SegmentBounds):
        reference.read_bytes(piece, PREFIX, max_segment_bytes=8)


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "{prefix}/1-0123456789abcdef",
        "{prefix}-1-0123456789abcdef\x00",
        "other-1-0123456789abcdef",
        "{prefix}-x-0123456789abcdef",
        "{prefix}-1-0123",
        "",
    ],
)
def test_bad_names_are_refused(name: str) -> None:
    # (The prefix is filled in here: test ids must be the same in every worker.)
    with pytest.raises(files.BadSegmentName):
        files.parse_name(name.format(prefix=PREFIX), PREFIX)


def test_out_of_bounds_and_missing(segment) -> None:  # type: ignore[no-untyped-def]
    piece, _ = segment
    out = bytearray(16)
    with pytest.raises(files.SegmentBounds):
        one_off.read_into(
            files.Slice(piece.segment, piece.nbytes - 8, 16), PREFIX, memoryview(out), max_segment_bytes=1 << 20
        )
    with pytest.raises(files.SegmentBounds):
        one_off.read_into(files.Slice(piece.segment, 0, 16), PREFIX, memoryview(out), max_segment_bytes=8)
    missing = files.new_name(PREFIX, os.getpid())
    with pytest.raises(files.SegmentMissing):
        one_off.read_into(files.Slice(missing, 0, 16), PREFIX, memoryview(out), max_segment_bytes=1 << 20)


def test_unlink_is_idempotent(segment) -> None:  # type: ignore[no-untyped-def]
    piece, _ = segment
    assert files.unlink(piece.segment) is True
    assert files.unlink(piece.segment) is False
    with pytest.raises(files.BadSegmentName):
        files.unlink("../x")


def later(name: str, seconds: float) -> float:
    return os.stat(files.SHM_DIR / name).st_mtime + seconds


def test_sweep_removes_only_unowned_segments_past_the_grace() -> None:
    owned = one_off.place(PREFIX, os.getpid(), memoryview(b"x" * 8))
    orphan = one_off.place(PREFIX, os.getpid(), memoryview(b"y" * 8))
    lock = one_off.Claim(owned.segment, PREFIX)
    try:
        # Young: within the grace nobody is removed (a worker's segment
        # waits there for its service to lock it).
        assert files.sweep(PREFIX, grace_s=60) == []
        assert files.sweep(PREFIX, grace_s=60, now=later(orphan.segment, 61)) == [orphan.segment]
        assert files.list_segments(PREFIX) == [owned.segment]
        lock.disown()  # the lock goes, the segment stays: the janitor may remove it
        assert files.sweep(PREFIX, grace_s=60, now=later(owned.segment, 61)) == [owned.segment]
    finally:
        lock.disown()  # the lock goes, the segment stays: the janitor may remove it
        files.unlink(owned.segment)
        files.unlink(orphan.segment)


def test_a_lock_held_by_another_process_keeps_the_segment_and_dies_with_it() -> None:
    """Ownership does not depend on pids: the owner here is another process
    (its pid is not the one in the name); when it dies, its lock goes too."""
    piece = one_off.place(PREFIX, 1, memoryview(b"z" * 8))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mmsplit_server.handoff import segment as one_off; "
            f"lock = one_off.Claim({piece.segment!r}, {PREFIX!r}); print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        assert files.sweep(PREFIX, grace_s=0, now=later(piece.segment, 1)) == []
        holder.kill()
        holder.wait(10)
        assert files.sweep(PREFIX, grace_s=0, now=later(piece.segment, 1)) == [piece.segment]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        files.unlink(piece.segment)


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[dict[str, str]]:
    with plant(PREFIX, tmp_path) as made:
        yield made


def test_what_is_not_a_segment_is_refused_and_never_blocks_or_raises_on_release(planted) -> None:  # type: ignore[no-untyped-def]
    expected = {
        "directory": files.NotASegment,
        "fifo": files.NotASegment,
        "symlink": files.NotASegment,
        "another user's file": files.ForeignSegment,
    }
    for kind, name in planted.items():
        out = bytearray(64)
        with pytest.raises(expected[kind]):
            one_off.read_into(files.Slice(name, 0, 64), PREFIX, memoryview(out), max_segment_bytes=1 << 20)
        with pytest.raises(expected[kind]):
            one_off.Claim(name, PREFIX)
    failures = files.RELEASE_FAILURES.count
    for kind, name in planted.items():
        assert files.unlink(name) is False, kind  # left alone, no exception
    assert files.RELEASE_FAILURES.count == failures + 4
    assert files.sweep(PREFIX, grace_s=0, now=10**12) == []
    assert all(os.path.lexists(files.SHM_DIR / name) for name in planted.values())


def test_namespace_id_is_stable_and_does_not_show_the_boot_id() -> None:
    assert files.namespace_id() == files.namespace_id()
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert boot_id not in files.namespace_id()
    assert len(files.namespace_id()) == 32
