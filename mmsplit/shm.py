"""Shared-memory segments: naming, creation, validated reading, release, sweeping.

The one module that touches /dev/shm (DESIGN.md §3). Segments are plain files
under /dev/shm used through file descriptors, not `multiprocessing.shared_memory`:
Python 3.11's resource_tracker unlinks segments behind our back when a process
that merely attached exits, and warns about segments another process unlinked.

Names are ``<prefix>-<owner pid>-<16 hex>``. The owner is the *service* process
that answers for the segment (the tokenizer), not the pool worker that wrote
it, so a replaced worker does not make its live segments look orphaned.
Segments are created O_CREAT|O_EXCL with mode 0600 and their size reserved
with posix_fallocate, so a full /dev/shm is an error at creation rather than a
SIGBUS at first touch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "mmsplit"
_PREFIX = r"[A-Za-z][A-Za-z0-9_]{0,31}"
_PREFIX_RE = re.compile(rf"^{_PREFIX}$")
_NAME_RE = re.compile(rf"^(?P<prefix>{_PREFIX})-(?P<pid>[0-9]{{1,10}})-(?P<rand>[0-9a-f]{{16}})$")


class SegmentError(Exception):
    """Base of the errors of this module; callers translate them to ErrorCodes."""


class BadSegmentName(SegmentError):
    """The name is not one of ours (pattern, prefix, path characters)."""


class SegmentMissing(SegmentError):
    """No segment of that name exists (released already, or never created)."""


class SegmentBounds(SegmentError):
    """The requested slice does not lie inside the segment."""


class ShmFull(SegmentError):
    """/dev/shm has no room for a new segment."""


@dataclass(frozen=True)
class Slice:
    segment: str
    offset: int
    nbytes: int


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"invalid shared-memory prefix {prefix!r}: want {_PREFIX}")
    return prefix


def parse_name(name: str, prefix: str) -> int:
    """Validate a segment name of `prefix`; return its owner pid."""
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


def new_name(prefix: str, owner_pid: int) -> str:
    return f"{prefix}-{owner_pid}-{secrets.token_hex(8)}"


def write_segment(prefix: str, owner_pid: int, data: memoryview) -> Slice:
    """Create a new segment holding exactly `data` (C-contiguous bytes)."""
    data = data.cast("B")
    nbytes = data.nbytes
    if nbytes == 0:
        raise ValueError("refusing to create an empty segment")
    name = new_name(prefix, owner_pid)
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise ShmFull(f"cannot reserve {nbytes} bytes in {SHM_DIR}: {exc.strerror}") from exc
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, data[written:], written)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    return Slice(name, 0, nbytes)


def read_into(piece: Slice, prefix: str, out: memoryview, *, max_segment_bytes: int) -> None:
    """Copy a validated slice into `out` (writable, exactly `piece.nbytes`)."""
    parse_name(piece.segment, prefix)
    out = out.cast("B")
    if out.nbytes != piece.nbytes:
        raise SegmentBounds(f"destination holds {out.nbytes} bytes, slice has {piece.nbytes}")
    try:
        fd = os.open(SHM_DIR / piece.segment, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise SegmentMissing("the segment does not exist (released already, or never created)") from exc
    try:
        size = os.fstat(fd).st_size
        if size > max_segment_bytes:
            raise SegmentBounds(f"the segment has {size} bytes, over the cap {max_segment_bytes}")
        if piece.offset + piece.nbytes > size:
            raise SegmentBounds(
                f"slice [{piece.offset}, {piece.offset + piece.nbytes}) lies outside the segment of {size} bytes"
            )
        done = 0
        while done < piece.nbytes:
            n = os.preadv(fd, [out[done:]], piece.offset + done)
            if n == 0:
                raise SegmentBounds("the segment shrank while being read")
            done += n
    finally:
        os.close(fd)


def unlink(name: str) -> bool:
    """Remove a segment; True if it existed. Idempotent by design: both sides
    may release the same segment when ownership was in doubt."""
    if "/" in name or "\x00" in name or name in ("", ".", ".."):
        raise BadSegmentName(f"refusing to unlink {name!r}")
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True


def list_segments(prefix: str) -> list[str]:
    """Names in /dev/shm that are segments of `prefix`."""
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


def sweep(
    prefix: str,
    *,
    lease_s: float | None = None,
    check_owner: bool = True,
    keep: Collection[str] = (),
    now: float | None = None,
) -> list[str]:
    """Remove segments of `prefix` whose owner pid is dead (`check_owner`),
    and (with `lease_s`) those older than the lease; never those in `keep`
    (still in use by the caller). Returns what was removed.

    The dead-owner rule is only sound where the owner's pid namespace is ours
    (the tokenizer sweeping its own prefix); elsewhere, use the lease alone."""
    now = time.time() if now is None else now
    removed = []
    for name in list_segments(prefix):
        if name in keep:
            continue
        pid = parse_name(name, prefix)
        try:
            age = now - os.stat(SHM_DIR / name).st_mtime
        except FileNotFoundError:
            continue
        expired = (check_owner and not pid_alive(pid)) or (lease_s is not None and age > lease_s)
        if expired and unlink(name):
            removed.append(name)
    if removed:
        log.warning("janitor removed %d orphaned segment(s) of prefix %s: %s", len(removed), prefix, removed[:8])
    return removed
