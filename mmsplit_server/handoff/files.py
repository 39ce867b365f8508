"""The files every transport of the hand-off is made of: shared-memory
segments under /dev/shm, their names, creation, validated opening, removal
and sweeping, and the errors all of it raises.

Segments are plain files under /dev/shm used through file descriptors, not
`multiprocessing.shared_memory`: Python 3.11's resource_tracker unlinks
segments behind our back when a process that merely attached exits, and
warns about segments another process unlinked.

Names are ``<prefix>-<creator pid>-<16 hex>`` (a one-off segment),
``…-slab<12 hex>`` (a slab, or a CUDA-IPC pool's lease map) or
``…-grant<11 hex>`` (a grant table); the pid is informational only (pids
lie across pid namespaces). Segments are created O_CREAT|O_EXCL with mode
0600 and their size reserved with posix_fallocate, so a full /dev/shm is an
error at creation rather than a SIGBUS at first touch.

/dev/shm is shared with whoever else can write to it, so nothing found there
is trusted: a segment is opened O_NOFOLLOW|O_NONBLOCK (a symlink fails, a FIFO
cannot block the opener) and must be a regular file of this process's user.

Whoever holds a segment keeps a shared `flock` on it through an open
descriptor (`segment.Claim`, and every holder of a slab slice). Locks vanish
with their process however it dies and work across pid namespaces on one
tmpfs, so a janitor (`sweep`) that gets an exclusive lock without waiting
knows nobody holds the segment and may unlink it — after a grace period that
covers the moment between a worker writing a segment and its service
taking it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "mmsplit"
_PREFIX = r"[A-Za-z][A-Za-z0-9_]{0,31}"
_PREFIX_RE = re.compile(rf"^{_PREFIX}$")
# The random part of a slab's name (`mmsplit_server.handoff.slab`) starts with "slab".
_NAME_RE = re.compile(
    rf"^(?P<prefix>{_PREFIX})-(?P<pid>[0-9]{{1,10}})-(?P<rand>[0-9a-f]{{16}}|slab[0-9a-f]{{12}}|grant[0-9a-f]{{11}})$"
)
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class SegmentError(Exception):
    """Base of the errors of this module; callers translate them to ErrorCodes."""


class BadSegmentName(SegmentError):
    """The name is not one of ours (pattern, prefix, path characters)."""


class SegmentMissing(SegmentError):
    """No segment of that name exists (released already, or never created)."""


class NotASegment(SegmentError):
    """Something under the name is not a segment: a directory, a FIFO, a
    symlink, a device — nothing a service of ours creates."""


class ForeignSegment(SegmentError):
    """A regular file under the name belongs to another user (a deployment
    whose services run as different users, or a planted file)."""


class SegmentBounds(SegmentError):
    """The requested slice does not lie inside the segment."""


class ShmFull(SegmentError):
    """/dev/shm has no room for a new segment."""


class NoDescriptors(SegmentError):
    """This process (or the system) has no file descriptor to spare: a
    segment cannot be opened or created now. The server's condition, not
    the segment's: callers answer OVERLOADED, retriable."""


# open(2) failures that say nothing about what is under the name.
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def _no_descriptors(exc: OSError) -> NoDescriptors:
    return NoDescriptors(f"no file descriptor to spare ({exc.strerror}): raise the open-file limit")


@dataclass(frozen=True)
class Slice:
    segment: str
    offset: int
    nbytes: int


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"invalid shared-memory prefix {prefix!r}: want {_PREFIX}")
    return prefix


# Cached: a hand-over checks the same few names several times per tensor
# (a slab's name is one for the process's life). Refusals are not cached.
@functools.lru_cache(maxsize=1024)
def parse_name(name: str, prefix: str) -> int:
    """Validate a segment name of `prefix`; return the pid it names (informational)."""
    m = _NAME_RE.match(name)
    if m is None or "\x00" in name:
        raise BadSegmentName("the segment name is not of the form <prefix>-<pid>-<16 hex>")
    if m["prefix"] != prefix:
        raise BadSegmentName("the segment name does not have the accepted prefix")
    return int(m["pid"])


def namespace_id() -> str:
    """A digest of ``<boot_id>:<st_dev of /dev/shm>``: equal for two processes
    exactly when they see the same /dev/shm (same kernel boot, same tmpfs
    mount). A digest, because servers publish it and the boot id is the
    host's, not something to hand to every client."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return hashlib.sha256(f"{boot_id}:{os.stat(SHM_DIR).st_dev}".encode()).hexdigest()[:32]


def new_name(prefix: str, owner_pid: int, *, slab: bool = False, grants: bool = False) -> str:
    """A fresh name: a one-off segment's, a slab's (`slab`) or a grant table's (`grants`)."""
    if slab:
        rand = "slab" + secrets.token_hex(6)
    elif grants:
        rand = "grant" + secrets.token_hex(6)[:11]
    else:
        rand = secrets.token_hex(8)
    return f"{prefix}-{owner_pid}-{rand}"


def is_grant_table(name: str) -> bool:
    """Whether `name` is a grant table's (`mmsplit_server.handoff.grants`)."""
    m = _NAME_RE.match(name)
    return m is not None and m["rand"].startswith("grant")


@functools.lru_cache(maxsize=1024)
def is_slab(name: str) -> bool:
    """Whether `name` is a slab's: its slices are released by unlocking,
    never by unlinking the segment (`mmsplit_server.handoff.slab`)."""
    m = _NAME_RE.match(name)
    return m is not None and m["rand"].startswith("slab")


def create_segment(name: str, nbytes: int) -> int:
    """Create segment `name` with `nbytes` reserved; return a read-write
    descriptor. ShmFull when /dev/shm has no room."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    except OSError as exc:
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise _no_descriptors(exc) from exc
        raise
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        unlink(name)
        raise ShmFull(f"cannot reserve {nbytes} bytes in {SHM_DIR}: {exc.strerror}") from exc
    return fd


def open_segment(name: str, prefix: str, *, write: bool = False) -> int:
    """A descriptor of the segment of `prefix` under `name`, validated."""
    return open_stat(name, prefix, write=write)[0]


def open_stat(name: str, prefix: str, *, write: bool = False) -> tuple[int, os.stat_result]:
    """`open_segment`, and the segment's stat (taken by the validation)."""
    parse_name(name, prefix)
    return open_file(name, write=write)


def open_file(name: str, *, write: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file of ours under `name` (read-only
    unless `write`), and its stat."""
    if "/" in name or "\x00" in name or name in ("", ".", ".."):
        raise BadSegmentName("the segment name is not of the form <prefix>-<pid>-<16 hex>")
    try:
        # A string path: pathlib's parsing showed up in the hand-over's profile.
        fd = os.open(f"{SHM_DIR}/{name}", (os.O_RDWR if write else os.O_RDONLY) | _OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise SegmentMissing("the segment does not exist (released already, or never created)") from exc
    except OSError as exc:  # ELOOP: a symlink; EACCES: not ours to read
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise _no_descriptors(exc) from exc
        raise NotASegment(f"the segment cannot be opened: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotASegment("the name does not refer to a segment (not a regular file)")
        if st.st_uid != os.geteuid():
            raise ForeignSegment("the segment belongs to another user")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def unlink(name: str) -> bool:
    """Remove a segment; True if it was removed. Idempotent by design: both
    sides may release the same segment when ownership was in doubt. Never
    raises for what it finds there: something that is not a regular file, or
    that this user may not remove, is logged and left in place — a release
    must not fail a request, let alone a group."""
    if "/" in name or "\x00" in name or name in ("", ".", ".."):
        raise BadSegmentName("refusing to unlink a name that is not a segment's")
    path = SHM_DIR / name
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("not removing %s: not a regular file of this user", name)
            RELEASE_FAILURES.count += 1
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not remove segment %s: %s", name, exc.strerror)
        RELEASE_FAILURES.count += 1
        return False
    return True


@dataclass
class _Counter:
    count: int = 0


# Releases that found something they could not remove (for logs and metrics).
RELEASE_FAILURES = _Counter()


def segment_bytes(prefix: str, *, creator_pid: int | None = None) -> int:
    """Memory the prefix's segments take in /dev/shm now (of one creator
    pid, as its name says, when given): blocks allocated, not sizes, so a
    sparse lease map (`mmsplit_server.handoff.cuda_ipc`) counts for what it holds, nothing."""
    total = 0
    for name in list_segments(prefix):
        if creator_pid is None or name.split("-")[-2:-1] == [str(creator_pid)]:
            with contextlib.suppress(OSError):
                total += (SHM_DIR / name).stat().st_blocks * 512
    return total


def list_segments(prefix: str) -> list[str]:
    """Names in /dev/shm that are segments of `prefix` (by name only)."""
    names = []
    for entry in os.scandir(SHM_DIR):
        m = _NAME_RE.match(entry.name)
        if m and m["prefix"] == prefix:
            names.append(entry.name)
    return names


def pid_alive(pid: int) -> bool:
    """Whether a process of that pid exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(prefix: str, *, grace_s: float, keep: Collection[str] = (), now: float | None = None) -> list[str]:
    """Remove the segments of `prefix` that nobody owns: regular files of
    ours, older than `grace_s`, on which an exclusive lock is granted without
    waiting (no owner holds its shared lock). Never those in `keep`. Returns
    what was removed; anything else under a segment's name is left alone."""
    now = time.time() if now is None else now
    removed = []
    for name in list_segments(prefix):
        if name in keep:
            continue
        try:
            fd, _ = open_file(name)
        except SegmentError:
            continue  # gone meanwhile, or not a segment of ours: not ours to remove
        try:
            if now - os.fstat(fd).st_mtime <= grace_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # owned
            # Unlinked while holding the exclusive lock: nobody can take
            # ownership between the check and the removal.
            if unlink(name):
                removed.append(name)
        finally:
            os.close(fd)
    if removed:
        log.warning("janitor removed %d unowned segment(s) of prefix %s", len(removed), prefix)
    return removed
