"""Ranges of a shared file leased by byte-range locks: the machinery under
the slab transport (`slab`: the ranges are the tensor's bytes) and the
CUDA-IPC transport (`cuda_ipc`: a sparse lease map whose ranges stand for a
GPU pool's), which neither transport imports from the other.

The slab is one pre-allocated shared-memory segment that pixel tensors are
written into, slice by slice, instead of a new segment per tensor.

A new segment costs a page fault per page (about 1 GB/s here against tens of
GB/s for a copy into pages that exist) and grows /dev/shm without bound. The
tokenizer instead creates one slab at a fixed size, reserved and zeroed once
by posix_fallocate, and reuses it.

**Slices are leased by byte-range locks, not by a message.** Whoever holds a
slice holds an open-file-description lock (`F_OFD_SETLK`) on its byte range
through a descriptor of its own; the kernel's lock table *is* the allocation
map. Why locks rather than a release message back to the tokenizer:

- a lock vanishes with its holder however it dies, so a worker SIGKILLed
  mid-write, a tokenizer that crashed, or a scheduler rank that died never
  leaves a slice taken — nothing to time out, no janitor pass needed;
- it is the same hand-over the one-off segments use (DESIGN.md §3, turn 2:
  "receiver locks, then says Accepted, then the sender unlocks"), at byte
  granularity, and it works across pid namespaces on one tmpfs;
- no new RPC, stream or bookkeeping that both services must keep in step.

Lifecycle of one slice:

1. A worker allocates: it takes an exclusive (write) lock on a free run of
   pages; `F_OFD_GETLK` names the lock in the way, so the search jumps over
   taken ranges. It copies the tensor in through its mapping of the slab
   (no intermediate copy), then turns its lock into a shared (read) lock,
   atomically.
2. The tokenizer process checks that the writer's lock is there, then takes
   its own read lock (`take`), so the chain of holders is unbroken. The
   worker notices the other holder, between its tasks, and drops its lock
   (`HandOff`).
3. The scheduler's rank 0 does the same (`take`) before saying Accepted;
   the tokenizer then drops its lock. A reference to a range nobody holds
   is refused, so a stale reference cannot read reused pixels; and before
   any `take`, every rank checks the reference's grant
   (`mmsplit_server.handoff.grants`), so a forged one cannot read held pixels
   either (holding a range says nothing about who may read it).
4. Each scheduler rank's reader takes the slice (`take`) while it reads
   the step's tensors and lends the slice to the step in place
   (`Held.view`: no copy); when the step ends every rank lets go, rank 0
   of its hold from step 3 too, and the pages are free for the next
   allocation. "Release" is an unlock; the slab itself is never unlinked by
   a release.

Takers in one process share one lock per slice (`_Taken`): rank 0's reader
finds the slice held since Accepted and only counts itself in, and the
lock goes with the process's last holder. The other ranks, processes of
their own, lock it themselves. A holder that lets go drops its locks and
leaves its descriptor for the process's next lock (`_Local`): no open per
slice.

A writer that hands over by polling must see its taker's lock, however
briefly the taker holds it. So the writer also read-locks one marker byte
past the slab's end (`_marker`: the file is never that long, and a lock
does not need the bytes to exist), and a taker whose writer's marker is
still locked when it releases keeps its lock until the marker goes
(`Held.release`). Without it, a taker that let go between two polls left
the writer holding the slice until its hand-off timed out, a minute later
(found by `bench/preprocess.py`: the slab filled with such slices and
allocation spent most of the workers' time in fcntl).

Every holder also keeps a shared `flock` on the slab file while it holds a
slice, so a janitor (`files.sweep`, which needs an exclusive flock) never
removes a slab in use; the owning tokenizer holds one for the slab's life.
`flock` and `fcntl` locks are independent on Linux, so the two never clash.

A slab is full when no run of free pages is long enough; the writer waits a
bounded time, then the item fails OVERLOADED (retriable). Tensors over a
quarter of the slab go to a one-off segment as before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mmsplit_server.handoff import files

log = logging.getLogger(__name__)

# 64 KiB pages: a LLaVA-1.5 image (1.35 MB) is 21 pages; few locks per slab.
PAGE = 1 << 16
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (0 for OFD locks), padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")
# How long a writer's read lock waits for the tokenizer to take the slice
# over before dropping it (the tokenizer takes it within milliseconds; this
# only bounds a slice whose result nobody collects).
HANDOFF_TIMEOUT_S = 60.0
# How often a hand-off thread checks its pending slices. Nobody waits for a
# check but a writer short of room, and it checks for itself (`_allocated`);
# at 2 ms the thread woke 500 times a second and preempted a busy pool
# worker ten times per image on two cores (2.4 at 20 ms; the tokenizer's
# CPU per image fell by a third).
HANDOFF_POLL_S = 0.02


class SlabFull(files.SegmentError):
    """No run of free pages long enough for the tensor within the wait."""


class SliceLost(files.SegmentError):
    """The slice is not held by its previous holder any more: it may have
    been reused, so its bytes cannot be trusted."""


@dataclass(frozen=True)
class Range:
    start: int
    length: int  # 0: to the end of the file (as the kernel reports it)

    @property
    def end(self) -> int:
        return self.start + self.length if self.length else 1 << 62


def _lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set (or clear, with F_UNLCK) an OFD lock without waiting; False when
    another holder's lock is in the way."""
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _conflict(fd: int, start: int, length: int) -> Range | None:
    """Another holder's lock overlapping [start, start+length), if any (the
    probe asks for a write lock, so read locks of others count too; locks
    of `fd`'s own description never do)."""
    raw = fcntl.fcntl(fd, F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    kind, _, got_start, got_length, _ = _FLOCK.unpack(raw)
    return None if kind == fcntl.F_UNLCK else Range(got_start, got_length)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


# Spare descriptors kept per slab and mode (read, write): more than the
# slices a process holds at once in steady state; a burst beyond it closes.
# A process's descriptors of a slab it holds no slice of are these alone.
SPARE_DESCRIPTORS = 16


class _Local:
    """What this process keeps of each slab it uses, so that a slice costs
    neither a mapping nor an open of its own:

    - **one mapping per slab**, made once (pages mapped up front,
      MAP_POPULATE): a copy through a mapping runs at memcpy speed, where
      pread/pwrite on tmpfs went page by page at a third of it;
    - **spare descriptors**: a holder's lock is taken through an open file
      description of its own, and when the holder lets go its locks are
      dropped (one unlock of the whole file) and the description is kept
      for the next lock, instead of closed. With the caches as a worker
      leaves them after preprocessing, an open, its stat and its flock cost
      ~45 µs, a third of a 1.35 MB hand-off's cost beyond its copy. A spare
      descriptor holds no lock of any kind, not even the janitors' flock
      (`descriptor` takes it again), so it keeps nobody from a slab.

    A slab that was removed (its tokenizer stopped) is forgotten, mapping
    and spares, on a later use, at most once a second, so dead slabs are not
    kept alive long. A process made by fork forgets the spares it inherited:
    they are its parent's descriptions, and a lock through one would be the
    parent's lock.

    A mapping faults (SIGBUS) if its file is truncated under it. No service
    of ours ever truncates a slab: it is created at its full size before its
    name is known to anyone, and only ever unlinked."""

    SPARES = SPARE_DESCRIPTORS

    def __init__(self) -> None:
        # name -> (inode, mapping, writable); a process that writes maps read-write.
        self._maps: dict[str, tuple[int, mmap.mmap, bool]] = {}
        # (name, prefix, writable) -> descriptors with their stat, no lock through them.
        self._spare: dict[tuple[str, str, bool], list[tuple[int, os.stat_result]]] = {}
        self._lock = threading.Lock()
        self._checked = 0.0
        # Counts forks: a descriptor from before one is the parent's too.
        self.generation = 0

    def descriptor(self, name: str, prefix: str, *, write: bool) -> tuple[int, os.stat_result]:
        """A descriptor of slab `name` that no lock is taken through, holding
        the shared flock that keeps janitors away while it is in use, and
        the slab's stat. A spare one when there is one; give it back with
        `spare` (or close it)."""
        if not files.is_slab(name):
            raise files.BadSegmentName("the segment name is not a slab's")
        with self._lock:
            self._forget_removed()
            spares = self._spare.get((name, prefix, write))
            got = spares.pop() if spares else None
        fd, st = got if got is not None else files.open_stat(name, prefix, write=write)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:  # a janitor holds it exclusively: it is being swept
            os.close(fd)
            raise files.SegmentMissing("the slab is being removed") from exc
        return fd, st

    def spare(
        self, name: str, prefix: str, fd: int, st: os.stat_result, *, write: bool, generation: int | None = None
    ) -> None:
        """Drop every lock taken through `fd` (byte ranges and flock) and keep
        it for the next `descriptor` of the slab; closed when enough are kept
        or the unlock fails. A descriptor of an earlier `generation` (None:
        this one) is only closed: its description is shared with the parent
        process, whose locks an unlock would drop."""
        if generation is not None and generation != self.generation:
            os.close(fd)
            return
        try:
            _lock(fd, fcntl.F_UNLCK, 0, 0)  # [0, infinity): the slices and the markers past the end
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            os.close(fd)
            return
        with self._lock:
            spares = self._spare.setdefault((name, prefix, write), [])
            if len(spares) < self.SPARES:
                spares.append((fd, st))
                return
        os.close(fd)

    def view(self, fd: int, name: str, *, write: bool, ino: int | None = None) -> memoryview:
        """A view of the whole slab `fd` is open on (its inode `ino`, when
        the caller has it), mapped on first use."""
        if ino is None:
            ino = os.fstat(fd).st_ino
        with self._lock:
            self._forget_removed()
            got = self._maps.get(name)
            if got is None or got[0] != ino or (write and not got[2]):
                # Mapped through an open file description of its own (the
                # same file, reopened): a mapping keeps its description
                # alive, and with it any lock taken through it — a slice's
                # lock must go when its holder lets go.
                own = os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
                try:
                    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    got = (ino, mmap.mmap(own, 0, flags=flags, prot=prot), write)
                finally:
                    os.close(own)
                # A mapping replaced or dropped is unmapped when its last view goes.
                self._maps[name] = got
            return memoryview(got[1])

    def cached(self, name: str) -> memoryview | None:
        """The mapping of `name` if it is still the file under that name
        (one stat, where opening and checking it again costs four calls)."""
        with self._lock:
            self._forget_removed()
            got = self._maps.get(name)
        if got is None:
            return None
        try:
            if os.stat(f"{files.SHM_DIR}/{name}").st_ino != got[0]:
                return None
        except FileNotFoundError:
            return None
        return memoryview(got[1])

    def _forget_removed(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        inodes: dict[str, int | None] = {}

        def current(name: str) -> int | None:
            """The inode under `name` now (None: no file), one stat per name."""
            if name not in inodes:
                try:
                    inodes[name] = os.stat(f"{files.SHM_DIR}/{name}").st_ino
                except FileNotFoundError:
                    inodes[name] = None
            return inodes[name]

        for name, (ino, _, _) in list(self._maps.items()):
            if current(name) != ino:
                del self._maps[name]
        for (name, _, _), spares in self._spare.items():
            for fd, st in [got for got in spares if current(name) != got[1].st_ino]:
                spares.remove((fd, st))
                os.close(fd)

    def _after_fork(self) -> None:
        """In a forked child: the spares are the parent's descriptions."""
        self._lock = threading.Lock()
        self.generation += 1
        spares, self._spare = self._spare, {}
        for got in spares.values():
            for fd, _ in got:
                os.close(fd)


_local = _Local()


def mapping(fd: int, name: str, *, write: bool, ino: int | None = None) -> memoryview:
    """A view of the whole file `fd` is open on, through this process's
    mapping of it (made on first use, kept while it is the file under `name`)."""
    return _local.view(fd, name, write=write, ino=ino)


def cached_mapping(name: str) -> memoryview | None:
    """This process's mapping of `name`, if it has one and it is still the
    file under that name."""
    return _local.cached(name)


class Slab:
    """The owner's slab (the tokenizer process): created at a fixed size,
    kept under a shared flock until `close`, which removes it."""

    def __init__(self, prefix: str, owner_pid: int, nbytes: int, *, sparse: bool = False) -> None:
        """`sparse`: a lease map only — the file's bytes are never written
        (its ranges stand for memory elsewhere, `mmsplit_server.handoff.cuda_ipc`), so its
        size is set, not reserved, and costs no memory."""
        if nbytes < 4 * PAGE:
            raise ValueError(f"a slab needs at least {4 * PAGE} bytes")
        self.size = _pages(nbytes) * PAGE
        self.prefix = prefix
        self.name = files.new_name(prefix, owner_pid, slab=True)
        fd = files.create_segment(self.name, 0 if sparse else self.size)
        if sparse:
            os.ftruncate(fd, self.size)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            files.unlink(self.name)
            raise
        self._fd: int | None = fd

    @property
    def max_slice(self) -> int:
        """The largest tensor put in the slab; larger ones get a segment of their own."""
        return self.size // 4

    def used_bytes(self) -> int:
        """Bytes of the slab under some holder's lock now."""
        if self._fd is None:
            return 0
        fd = os.open(files.SHM_DIR / self.name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _used(fd, 0, self.size)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove the slab (idempotent). Holders that still have it open keep
        reading what they hold; nothing new can be written."""
        fd, self._fd = self._fd, None
        if fd is not None:
            files.unlink(self.name)
            os.close(fd)


def _used(fd: int, lo: int, hi: int) -> int:
    """Bytes in [lo, hi) under others' locks. The kernel reports any one
    conflicting lock, not the lowest, so both sides of it are probed."""
    if lo >= hi:
        return 0
    got = _conflict(fd, lo, hi - lo)
    if got is None:
        return 0
    start, end = max(lo, got.start), min(hi, got.end)
    return _used(fd, lo, start) + (end - start) + _used(fd, end, hi)


def _marker(size: int, offset: int) -> int:
    """The byte, past the end of a slab of `size` bytes, whose lock says that
    the writer of the slice at `offset` still holds it (one per page)."""
    return size + offset // PAGE


class _Taken:
    """A slice this process took over (`take`): one lock, through one
    descriptor, however many holders in this process hold the slice. Rank
    0's lock from Accepted and its reader's for the step are one lock, not
    two: a take that finds the slice here costs no system call (against
    seven for a lock of its own, taken and later released), and the lock
    goes when the last holder here lets go. The kernel sees one holder per
    process, which is all that the hand-over, the check that a reference is
    held, and the janitor ask of it."""

    __slots__ = ("after", "fd", "holders", "key", "prefix", "stat")

    def __init__(self, key: tuple[str, int, int], prefix: str, fd: int, st: os.stat_result) -> None:
        self.key = key
        self.prefix = prefix
        self.fd = fd
        self.stat = st
        self.after = _marker(st.st_size, key[1])
        self.holders = 1

    def drop(self) -> bool:
        """One holder fewer; True when it was the last (the lock is then
        no longer found by `take`, and the caller releases it)."""
        with _taken_lock:
            self.holders -= 1
            if self.holders:
                return False
            if _taken.get(self.key) is self:
                del _taken[self.key]
            return True


# Slices this process has taken, by (slab, offset, locked length).
_taken: dict[tuple[str, int, int], _Taken] = {}
_taken_lock = threading.Lock()


class Held:
    """One slice held by this process, under a lock through a descriptor of
    its own (a writer's), or shared by this process's takers of the slice
    (`_Taken`): the lock goes when the last holder releases it (or when this
    process dies), and the descriptor is kept spare (`_Local`). A writer's
    also locks its marker; a taker's knows its writer's (`after`)."""

    def __init__(
        self,
        fd: int,
        piece: files.Slice,
        *,
        prefix: str,
        stat: os.stat_result,
        write: bool,
        after: int | None = None,
        taken: _Taken | None = None,
    ) -> None:
        self._fd: int | None = fd
        self.slice = piece
        self._prefix = prefix
        self._stat = stat
        self._write = write
        self._after = after
        self._taken = taken
        self._generation = _local.generation

    @property
    def span(self) -> tuple[int, int]:
        """The locked byte range: the slice rounded up to whole pages."""
        return self.slice.offset, _pages(self.slice.nbytes) * PAGE

    def handed_over(self) -> bool:
        """Whether another holder has taken its own lock on the slice."""
        fd = self._fd
        return fd is not None and _conflict(fd, *self.span) is not None

    def writer_gone(self) -> bool:
        """Whether the writer this slice was taken from has let go of it."""
        fd = self._fd
        return fd is None or self._after is None or _conflict(fd, self._after, 1) is None

    def view(self) -> memoryview:
        """The slice's bytes in place, read-only, through this process's
        mapping of the slab (no copy); valid to read until released. The
        mapping is checked against the file this lock is on, so no lookup
        of the name is made."""
        fd = self._fd
        if fd is None:
            raise SliceLost("the slice was released")
        name, offset, nbytes = self.slice.segment, self.slice.offset, self.slice.nbytes
        whole = _local.view(fd, name, write=False, ino=self._stat.st_ino)
        try:
            # A writer's own mapping is writable: the view never is.
            return whole[offset : offset + nbytes].toreadonly()
        finally:
            whole.release()

    def _let_go(self) -> bool:
        """This holder's claim given up; True when the lock is its to release."""
        taken, self._taken = self._taken, None
        return taken is None or taken.drop()

    def release(self) -> None:
        """Let go: now, or, while the writer still holds on (it has not
        polled since we took over), once it lets go, so that it sees our
        lock (`_deferred`). Never blocks. The lock stays while other
        holders in this process hold the slice."""
        if self._fd is None:
            return
        if not self._let_go():
            self._fd = None
        elif _ready(self, Held.writer_gone):  # or cannot tell: let go now rather than keep it
            self.close()
        else:
            _deferred.wait(self, Held.writer_gone)

    def disown(self) -> None:
        """A slice is owned by its holders together: letting go as an owner
        or not is the same (`release`)."""
        self.release()

    def close(self) -> None:
        """Drop the lock now, whoever else holds the slice (in this
        process: this holder's claim only)."""
        with _taken_lock:  # two threads closing one holder: one of them spares the descriptor
            fd, self._fd = self._fd, None
        if fd is not None and self._let_go():
            _local.spare(
                self.slice.segment, self._prefix, fd, self._stat, write=self._write, generation=self._generation
            )


def lease(name: str, prefix: str, nbytes: int, fill: Callable[[int, int, int], None], *, wait_s: float) -> Held:
    """Allocate `nbytes` of slab `name` and call `fill(fd, inode, offset)`
    while the range is write-locked; return it held under a read lock. The
    slab's own bytes (`slab.place`), or memory elsewhere that a sparse lease map
    stands for (`mmsplit_server.handoff.cuda_ipc`)."""
    if nbytes <= 0:
        raise ValueError("refusing to allocate an empty range")
    fd, st = _local.descriptor(name, prefix, write=True)
    try:
        offset = _allocated(fd, st, nbytes, wait_s, fill)
        if not _lock(fd, fcntl.F_RDLCK, _marker(st.st_size, offset), 1):
            raise OSError(errno.EDEADLK, "a slice's marker is locked by another writer")
    except BaseException:  # SlabFull, mostly: the descriptor serves the next try
        _local.spare(name, prefix, fd, st, write=True)
        raise
    return Held(fd, files.Slice(name, offset, nbytes), prefix=prefix, stat=st, write=True)


def _allocated(fd: int, st: os.stat_result, nbytes: int, wait_s: float, fill: Callable[[int, int, int], None]) -> int:
    """Allocate `nbytes` of the file behind `fd` (of stat `st`), fill the
    range while it is write-locked, turn the lock into a read lock; the offset."""
    size = st.st_size
    need, total = _pages(nbytes), size // PAGE
    if need > total:
        raise SlabFull(f"{nbytes} bytes do not fit in {size}")
    deadline = time.monotonic() + wait_s
    delay = 0.001
    while (page := _allocate(fd, need, total)) is None:
        if time.monotonic() >= deadline:
            raise SlabFull(f"no room for {nbytes} more bytes of {size} now")
        # What this process handed off or released may be the room it waits
        # for: let go of what is ready now, not at the next poll of the
        # hand-off thread (or, in a pool worker, the next task).
        _deferred.poll()
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    offset = page * PAGE
    try:
        fill(fd, st.st_ino, offset)
    except BaseException:
        _lock(fd, fcntl.F_UNLCK, offset, need * PAGE)
        raise
    # Write lock → read lock on the same description: atomic, never unlocked in between.
    if not _lock(fd, fcntl.F_RDLCK, offset, need * PAGE):
        raise OSError(errno.EDEADLK, "could not downgrade a slab lock")
    return offset


def _allocate(fd: int, need: int, total: int) -> int | None:
    """Write-lock the first free run of `need` pages (first fit packs
    tightest; racing writers cost one failed attempt and a jump); its first
    page, or None when there is none."""
    pos = 0
    while pos + need <= total:
        if _lock(fd, fcntl.F_WRLCK, pos * PAGE, need * PAGE):
            return pos
        got = _conflict(fd, pos * PAGE, need * PAGE)
        if got is None:
            continue  # released meanwhile: try the same run again
        # Any run starting before the conflict's end would overlap it.
        pos = total if not got.length else max(pos + 1, _pages(got.end))
    return None


def take(piece: files.Slice, prefix: str) -> Held:
    """Take over a slice from its current holder, who keeps it until it sees
    our lock: first the check that a holder's lock covers the slice (else it
    is free, or was never allocated, and its bytes are not the ones named),
    then a read lock of our own (refused while a writer has the range). The
    check comes first because a writer handing over lets go as soon as our
    lock shows; between the two steps a holder lets go only by its hand-off
    timeout (`HANDOFF_TIMEOUT_S`), which nobody waits out. A slice this
    process holds already from a take is shared, not locked again
    (`_Taken`). Raises SliceLost, or shm's errors for a name or range that
    is not a slab's."""
    if piece.offset % PAGE or piece.nbytes <= 0:
        raise files.SegmentBounds("a slab slice starts on a page and is not empty")
    span = _pages(piece.nbytes) * PAGE
    key = (piece.segment, piece.offset, span)
    with _taken_lock:
        taken = _taken.get(key)
        if taken is not None and taken.prefix == prefix:
            taken.holders += 1
            return Held(taken.fd, piece, prefix=prefix, stat=taken.stat, write=False, after=taken.after, taken=taken)
    fd, st = _local.descriptor(piece.segment, prefix, write=False)
    try:
        if piece.offset + span > st.st_size:
            raise files.SegmentBounds(f"slice [{piece.offset}, {piece.offset + piece.nbytes}) lies outside the slab")
        got = _conflict(fd, piece.offset, span)
        if got is None or got.start > piece.offset or got.end < piece.offset + span:
            raise SliceLost("the slice is not held by its sender (released, or never allocated)")
        if not _lock(fd, fcntl.F_RDLCK, piece.offset, span):
            raise SliceLost("the slice is being written by someone else")
    except BaseException:
        _local.spare(piece.segment, prefix, fd, st, write=False)
        raise
    taken = _Taken(key, prefix, fd, st)
    with _taken_lock:
        # Another thread's take of the same slice may have won the race: this
        # lock then stays a holder of its own, released as any other.
        _taken.setdefault(key, taken)
    return Held(fd, piece, prefix=prefix, stat=st, write=False, after=taken.after, taken=taken)


class HandOff:
    """Slices this process lets go of once a condition holds, or after
    `timeout_s` in any case: a writer's slices until another holder's lock
    shows (`add`), and a taker's releases until its writer has let go
    (`wait`). Checked every HANDOFF_POLL_S by one daemon thread (started
    on first use), and by a writer waiting for room; with
    `threaded=False`, only when the owner calls `poll`: a
    pool worker polls between its tasks and while it waits for one
    (`tokenizer_svc.worker`), which spares it a thread that woke five times
    per image and took the GIL from the preprocessing each time."""

    def __init__(self, timeout_s: float = HANDOFF_TIMEOUT_S, *, threaded: bool = True) -> None:
        self._timeout_s = timeout_s
        self._threaded = threaded
        self._pending: list[tuple[Held, Callable[[Held], bool], float]] = []
        self._cond = threading.Condition()
        # One check at a time: the thread's, and those of writers waiting for
        # room (`poll`), would otherwise test and close the same slices at once.
        self._checking = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, held: Held) -> None:
        """Keep a slice this process wrote until its next holder has taken it."""
        self.wait(held, Held.handed_over)

    def wait(self, held: Held, ready: Callable[[Held], bool]) -> None:
        with self._cond:
            self._pending.append((held, ready, time.monotonic() + self._timeout_s))
            if self._threaded and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="slab-handoff", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def poll(self) -> int:
        """One check of every pending slice now, letting go of those that
        are ready (or timed out); how many are still pending."""
        self._check()
        return self.pending()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
            self._check()
            # Nobody waits for this (a taker holds its own lock already; a
            # writer short of room polls itself): a slow poll only keeps a
            # slice out of use a moment longer, and spares the CPU.
            time.sleep(HANDOFF_POLL_S)

    def _check(self) -> None:
        with self._checking:
            with self._cond:
                pending = list(self._pending)
            now = time.monotonic()
            done = [item for item in pending if item[2] <= now or _ready(item[0], item[1])]
            for held, _, _ in done:
                try:
                    held.close()
                except Exception:
                    log.exception("slab hand-off: letting a slice go failed")
            gone = {id(item) for item in done}
            with self._cond:
                self._pending = [item for item in self._pending if id(item) not in gone]


def _ready(held: Held, ready: Callable[[Held], bool]) -> bool:
    """`ready(held)`, or True when it fails: the hand-off thread is the
    only one that lets its slices go, so one slice's failure must neither
    end it (every later slice would stay held until this process exits)
    nor keep that slice forever."""
    try:
        return ready(held)
    except Exception:
        log.exception("slab hand-off: checking a slice failed; letting it go now")
        return True


# This process's hand-offs and deferred releases.
_deferred = HandOff()


def hand_off(held: Held) -> None:
    """Keep a slice this process wrote until its next holder has taken it."""
    _deferred.add(held)


def poll_hand_offs_here() -> None:
    """From now on this process's hand-offs and deferred releases wait for
    `poll_hand_offs`, not for a thread of their own. Called before any is
    pending (a pool worker, as it starts)."""
    global _deferred
    if _deferred.pending():
        raise RuntimeError("hand-offs are pending already")
    _deferred = HandOff(threaded=False)


def poll_hand_offs() -> int:
    """Check this process's hand-offs and deferred releases now (see
    `poll_hand_offs_here`); how many are still pending."""
    return _deferred.poll()


def _after_fork() -> None:
    """In a child made by fork, start this module's state afresh: what it
    inherited are its parent's holds (descriptions shared with the parent:
    an unlock through one would drop the parent's lock, a lock through one
    would outlive the child), and threads and their locks did not come
    along. Holds inherited are let go of by closing the descriptor only."""
    global _taken_lock, _deferred
    _local._after_fork()
    _taken_lock = threading.Lock()
    _taken.clear()
    _deferred = HandOff()


os.register_at_fork(after_in_child=_after_fork)
