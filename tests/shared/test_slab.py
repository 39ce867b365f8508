"""The slab's leases: byte-range locks as the allocation map (`mmsplit_server.handoff.slab`)."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import files, ranges, reference, segment, slab
from mmsplit_server.handoff.reference import TensorSpec
from tests.support.granting import grant_table, granted
from tests.support.holder import killed_after
from tests.support.leaks import PROJECT_PREFIX, own_slab, wait_until

PREFIX = PROJECT_PREFIX + "slab"  # this file's own, in this test process's
MIB = 1 << 20


@pytest.fixture
def owned() -> Iterator[ranges.Slab]:
    with own_slab(PREFIX, 4 * MIB) as s:
        yield s


def tensor(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def read(piece: files.Slice) -> np.ndarray:
    out = np.empty(piece.nbytes, dtype=np.uint8)
    reference.read_slice(piece, PREFIX, memoryview(out), max_segment_bytes=1)  # a slab is never capped by its size
    return out


def test_write_take_hand_over_read_release(owned: ranges.Slab) -> None:
    data = tensor(600_000, 1)
    writer = slab.place(owned.name, PREFIX, memoryview(data), wait_s=0)
    assert writer.slice.offset % ranges.PAGE == 0
    assert owned.used_bytes() == 10 * ranges.PAGE  # whole pages
    assert not writer.handed_over()
    taker = ranges.take(writer.slice, PREFIX)
    assert writer.handed_over()
    writer.release()
    assert np.array_equal(read(taker.slice), data)
    with pytest.raises(files.BadSegmentName):  # one-off segments only: a slab is read through its mapping
        segment.read_into(
            taker.slice, PREFIX, memoryview(np.empty(taker.slice.nbytes, np.uint8)), max_segment_bytes=1 << 30
        )
    assert owned.used_bytes() == 10 * ranges.PAGE  # the taker holds it now
    copied = reference.read_bytes(taker.slice, PREFIX, max_segment_bytes=1)  # a slab is never capped by its size
    assert isinstance(copied, bytes)
    assert copied == data.tobytes()
    taker.release()
    assert owned.used_bytes() == 0


def test_the_hand_off_thread_lets_go_once_taken(owned: ranges.Slab) -> None:
    handoff = ranges.HandOff()
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 2)), wait_s=0)
    handoff.add(writer)
    time.sleep(0.05)
    assert handoff.pending() == 1, "let go before anyone took it"
    taker = ranges.take(writer.slice, PREFIX)
    assert wait_until(lambda: handoff.pending() == 0, timeout=5)
    taker.release()
    assert owned.used_bytes() == 0


def test_a_taker_that_lets_go_at_once_still_frees_its_writer(owned: ranges.Slab) -> None:
    # The writer polls for its taker's lock; a taker that released before
    # the writer's next poll used to leave the writer holding the slice
    # until its hand-off timed out. The taker now holds on until then.
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 4)), wait_s=0)
    taker = ranges.take(writer.slice, PREFIX)
    taker.release()
    assert owned.used_bytes() == ranges.PAGE, "the taker let go before its writer saw it"
    ranges.HandOff(timeout_s=60).add(writer)  # the writer looks only now
    assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


def test_a_check_that_fails_does_not_stop_the_hand_off_thread(
    owned: ranges.Slab, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread is the only one that lets its slices go: a check that
    raises lets that slice go (logged) and the thread serves the next."""
    handoff = ranges.HandOff()

    def broken(_: ranges.Held) -> bool:
        raise OSError(errno.EBADF, "Bad file descriptor")

    handoff.wait(slab.place(owned.name, PREFIX, memoryview(tensor(1000, 5)), wait_s=0), broken)
    assert wait_until(lambda: handoff.pending() == 0, timeout=5)
    assert owned.used_bytes() == 0
    assert "checking a slice failed" in caplog.text
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 6)), wait_s=0)
    handoff.add(writer)
    taker = ranges.take(writer.slice, PREFIX)
    assert wait_until(lambda: handoff.pending() == 0, timeout=5)
    taker.release()
    assert owned.used_bytes() == 0


def test_an_unthreaded_hand_off_lets_go_only_when_polled(owned: ranges.Slab) -> None:
    handoff = ranges.HandOff(threaded=False)
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 7)), wait_s=0)
    handoff.add(writer)
    assert handoff.poll() == 1, "let go before anyone took it"
    taker = ranges.take(writer.slice, PREFIX)
    time.sleep(0.05)
    assert handoff.pending() == 1, "let go without a poll: a thread is checking"
    assert handoff.poll() == 0
    assert owned.used_bytes() == ranges.PAGE  # the taker's now
    taker.release()
    assert owned.used_bytes() == 0


def test_a_writer_that_polls_frees_its_taken_slices_while_it_waits_for_room(
    owned: ranges.Slab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool worker lets go of what it handed off only when it polls: when
    the slab is full of its own slices, taken and let go of by their taker
    meanwhile, its wait for room must poll, or it waits out `wait_s` for
    room that is only its own to give."""
    monkeypatch.setattr(ranges, "_deferred", ranges.HandOff(threaded=False))
    for i in range(4):  # 4 x 1 MiB: the slab is full
        writer = slab.place(owned.name, PREFIX, memoryview(tensor(MIB, i)), wait_s=0)
        ranges.hand_off(writer)
        ranges.take(writer.slice, PREFIX).release()  # deferred: its writer has not polled
    assert owned.used_bytes() == 4 * MIB
    started = time.monotonic()
    held = slab.place(owned.name, PREFIX, memoryview(tensor(MIB, 9)), wait_s=10)
    assert time.monotonic() - started < 5
    held.release()
    assert ranges.poll_hand_offs() == 0
    assert owned.used_bytes() == 0


def test_a_hand_off_that_nobody_takes_times_out(owned: ranges.Slab) -> None:
    handoff = ranges.HandOff(timeout_s=0.1)
    handoff.add(slab.place(owned.name, PREFIX, memoryview(tensor(1000, 3)), wait_s=0))
    assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


def test_slices_never_overlap_and_a_full_slab_says_so(owned: ranges.Slab) -> None:
    held = []
    for i in range(12):
        held.append(slab.place(owned.name, PREFIX, memoryview(tensor(300_000 + i, i)), wait_s=0))
    with pytest.raises(ranges.SlabFull, match="no room"):
        slab.place(owned.name, PREFIX, memoryview(tensor(300_000, 0)), wait_s=0.01)
    spans = sorted(h.span for h in held)
    # 4 MiB of 5-page slices: 64 pages hold 12, packed first fit.
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for i, h in enumerate(held):
        assert np.array_equal(read(h.slice), tensor(300_000 + i, i))
    held.pop().release()
    again = slab.place(owned.name, PREFIX, memoryview(tensor(300_000, 0)), wait_s=0)
    for h in [*held, again]:
        h.release()
    assert owned.used_bytes() == 0


def test_a_writer_waits_for_room(owned: ranges.Slab) -> None:
    big = slab.place(owned.name, PREFIX, memoryview(tensor(3 * MIB, 4)), wait_s=0)
    threading.Timer(0.2, big.release).start()
    started = time.monotonic()
    waited = slab.place(owned.name, PREFIX, memoryview(tensor(2 * MIB, 5)), wait_s=5)
    assert time.monotonic() - started >= 0.15
    waited.release()


def test_what_nobody_holds_cannot_be_taken(owned: ranges.Slab) -> None:
    """A reference to a free range (released, never allocated, forged) is
    refused: its bytes may be another request's."""
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(100_000, 6)), wait_s=0)
    piece = writer.slice
    writer.release()
    with pytest.raises(ranges.SliceLost):
        ranges.take(piece, PREFIX)
    with pytest.raises(ranges.SliceLost):
        ranges.take(files.Slice(owned.name, owned.size - ranges.PAGE, 10), PREFIX)
    with pytest.raises(files.SegmentBounds):
        ranges.take(files.Slice(owned.name, 100, 10), PREFIX)  # not on a page
    with pytest.raises(files.SegmentBounds):
        ranges.take(files.Slice(owned.name, owned.size, 10), PREFIX)
    with pytest.raises(files.BadSegmentName):
        ranges.take(files.Slice(files.new_name(PREFIX, 1), 0, 10), PREFIX)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def descriptors_of(name: str) -> int:
    """This process's descriptors open on the file `name` of /dev/shm (or
    on what was that file, since removed)."""
    path = str(files.SHM_DIR / name)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed since
        count += target in (path, f"{path} (deleted)")
    return count


def taken_over(owned: ranges.Slab, data: np.ndarray) -> tuple[files.Slice, ranges.Held]:
    """`data` written into the slab, taken over, and let go by its writer:
    the slice, and this process's hold on it."""
    writer = slab.place(owned.name, PREFIX, memoryview(data), wait_s=0)
    held = ranges.take(writer.slice, PREFIX)
    writer.release()
    return writer.slice, held


def test_takers_in_one_process_share_one_lock_until_the_last_lets_go(owned: ranges.Slab) -> None:
    """Rank 0's lock from Accepted and its reader's for the step: the second
    take opens nothing, and the slice stays held while either holds it."""
    data = tensor(200_000, 11)
    piece, first = taken_over(owned, data)
    before = open_descriptors()
    second = ranges.take(piece, PREFIX)
    assert open_descriptors() == before, "the second take locked the slice again"
    assert np.array_equal(np.frombuffer(second.view(), dtype=np.uint8), data)
    first.release()
    assert owned.used_bytes() == 4 * ranges.PAGE, "one holder let go, the other still holds the slice"
    assert np.array_equal(np.frombuffer(second.view(), dtype=np.uint8), data)
    second.release()
    assert owned.used_bytes() == 0
    assert open_descriptors() == before, "the last holder's descriptor is kept spare, not closed"
    with pytest.raises(ranges.SliceLost):
        ranges.take(piece, PREFIX)  # nothing of this process's is found for it any more
    first.release()  # a holder that let go already: nothing happens
    second.close()
    assert owned.used_bytes() == 0


def test_closing_a_shared_hold_drops_only_that_holder(owned: ranges.Slab) -> None:
    piece, first = taken_over(owned, tensor(1000, 12))
    second = ranges.take(piece, PREFIX)
    second.close()
    with pytest.raises(ranges.SliceLost, match="released"):
        second.view()
    assert owned.used_bytes() == ranges.PAGE
    third = ranges.take(piece, PREFIX)  # still found: `first` holds it
    first.close()
    assert owned.used_bytes() == ranges.PAGE
    third.release()
    assert owned.used_bytes() == 0


def test_a_take_while_the_last_holder_waits_for_its_writer_locks_anew(owned: ranges.Slab) -> None:
    """The last holder's release waits for the writer to look (`Held.release`);
    a take meanwhile gets a lock of its own, not the one about to go."""
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 13)), wait_s=0)
    first = ranges.take(writer.slice, PREFIX)
    first.release()  # deferred: the writer has not seen it yet
    before = open_descriptors()
    second = ranges.take(writer.slice, PREFIX)
    assert open_descriptors() == before + 1
    writer.release()
    second.release()
    assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


def test_takes_racing_on_threads_all_let_go(owned: ranges.Slab) -> None:
    writer = slab.place(owned.name, PREFIX, memoryview(tensor(1000, 14)), wait_s=0)
    holders: list[ranges.Held] = []
    guard = threading.Lock()
    start = threading.Barrier(8)

    def taker() -> None:
        start.wait()
        for _ in range(50):
            got = ranges.take(writer.slice, PREFIX)
            with guard:
                holders.append(got)

    threads = [threading.Thread(target=taker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.release()
    for got in holders[:-1]:
        got.release()
    assert owned.used_bytes() == ranges.PAGE
    holders[-1].release()
    assert owned.used_bytes() == 0


def test_a_range_being_written_cannot_be_taken(owned: ranges.Slab) -> None:
    fd = os.open(files.SHM_DIR / owned.name, os.O_RDWR)
    try:
        assert ranges._lock(fd, fcntl.F_WRLCK, 0, ranges.PAGE)
        with pytest.raises(ranges.SliceLost, match="written"):
            ranges.take(files.Slice(owned.name, 0, 100), PREFIX)
    finally:
        os.close(fd)


def test_a_writer_killed_holding_a_slice_frees_it(owned: ranges.Slab) -> None:
    """Locks vanish with their process: no janitor, no timeout."""
    write = (
        "import numpy as np; from mmsplit_server.handoff import slab; "
        f"slab.place({owned.name!r}, {PREFIX!r}, memoryview(np.ones(500_000, np.uint8)), wait_s=0)"
    )
    with killed_after(write):
        assert owned.used_bytes() == 8 * ranges.PAGE
    assert owned.used_bytes() == 0


def test_a_janitor_leaves_a_held_slab_and_removes_an_abandoned_one(owned: ranges.Slab) -> None:
    s = ranges.Slab(PREFIX, os.getpid(), 1 * MIB)
    try:
        assert files.sweep(PREFIX, grace_s=0, now=time.time() + 10, keep=[owned.name]) == []
        held = slab.place(s.name, PREFIX, memoryview(tensor(1000, 7)), wait_s=0)
        owner_fd, s._fd = s._fd, None  # the owner dies (its flock goes) ...
        assert owner_fd is not None
        os.close(owner_fd)
        # ... but a holder of a slice keeps the slab from being swept.
        assert files.sweep(PREFIX, grace_s=0, now=time.time() + 10, keep=[owned.name]) == []
        holding = descriptors_of(s.name)  # the holder's, and the mapping's own
        held.release()
        # Its descriptor is kept spare for the next lock, and keeps nobody away.
        assert descriptors_of(s.name) == holding
        assert files.sweep(PREFIX, grace_s=0, now=time.time() + 10, keep=[owned.name]) == [s.name]
        # A spare of a removed slab is closed on a later use of any slab,
        # a second after the last look at most, so it keeps no memory alive.
        time.sleep(1.1)
        slab.place(owned.name, PREFIX, memoryview(tensor(1000, 8)), wait_s=0).close()
        assert descriptors_of(s.name) == 0
    finally:
        files.unlink(s.name)


def test_a_released_descriptor_serves_the_next_lock_and_holds_nothing(owned: ranges.Slab) -> None:
    """A holder that lets go keeps its descriptor spare (an open, a stat and
    a flock fewer for the next slice); every lock through it is gone."""
    _, held = taken_over(owned, tensor(100_000, 20))
    holding = descriptors_of(owned.name)
    held.release()
    kept = descriptors_of(owned.name)
    assert kept == holding, "the holder's descriptor was closed, not kept"
    for seed in range(40):
        data = tensor(100_000 + seed * 1000, seed)
        _, held = taken_over(owned, data)
        assert np.array_equal(np.frombuffer(held.view(), dtype=np.uint8), data)
        held.release()
        assert owned.used_bytes() == 0
    assert descriptors_of(owned.name) == kept, "a slice opened descriptors it did not keep for the next"
    # None of them holds a lock: another process fills the whole slab (the
    # janitors' flock is left by spares too: see the janitor's test).
    quarter = f"memoryview(np.ones({owned.max_slice}, np.uint8))"
    fill = (
        "import numpy as np; from mmsplit_server.handoff import slab; "
        f"held = [slab.place({owned.name!r}, {PREFIX!r}, {quarter}, wait_s=0) for _ in range(4)]"
    )
    with killed_after(fill):
        assert owned.used_bytes() == owned.size
    assert owned.used_bytes() == 0


def test_a_forked_child_never_shares_its_parents_descriptions(owned: ranges.Slab) -> None:
    """A child made by fork inherits its parent's descriptors, which are the
    parent's open file descriptions: a lock through one is the parent's. The
    child lets an inherited hold go without dropping the parent's lock, and
    locks what it takes through descriptions of its own, which die with it."""
    piece, held = taken_over(owned, tensor(200_000, 31))  # 4 pages, held by the parent
    _, spare = taken_over(owned, tensor(1000, 30))
    spare.release()  # the parent now has spare descriptors (a writer's, a taker's), inherited by the child
    pid = os.fork()
    if pid == 0:  # the child: only slab calls, then out without any cleanup
        code = 1
        try:
            held.close()  # an inherited hold: the parent's lock must stay
            ranges.take(piece, PREFIX)  # a hold of its own, never released: it dies with the child
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert owned.used_bytes() == 4 * ranges.PAGE, "the child's close dropped the parent's lock"
    held.release()
    assert owned.used_bytes() == 0, "the child's lock outlived it (taken through its parent's description)"


def test_releasing_a_slab_reference_unlocks_and_never_unlinks(owned: ranges.Slab) -> None:
    data = tensor(4096, 8)
    writer = slab.place(owned.name, PREFIX, memoryview(data), wait_s=0)
    with grant_table(PREFIX) as table:
        spec = granted(TensorSpec(common_pb2.DTYPE_UINT8, (4096,), shm=writer.slice), table)
        lock = spec.take(PREFIX)
        writer.release()
        out = np.empty(4096, dtype=np.uint8)
        spec.read_into(memoryview(out), prefix=PREFIX, max_bytes=1 << 20)
        assert np.array_equal(out, data)
        assert lock is not None
        lock.release()
    assert files.list_segments(PREFIX) == [owned.name]
    assert owned.used_bytes() == 0
