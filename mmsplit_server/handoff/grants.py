"""Grants: what makes a tensor reference a capability rather than a name.

A shared-memory slice, a one-off segment or a CUDA-IPC range is named by
things anyone on the host can learn (segment names are listed in /dev/shm;
slab slices start on 64 KiB pages). Naming one must not be enough to read
it. So the tokenizer that hands a tensor over by reference also *grants* it
to that one request: it writes an entry into its grant table — a segment of
its own, readable only by the services' user — holding a fresh random tag
and a digest of the exact location (segment, offset, byte count), and the
reference carries the entry's index and the tag. Every scheduler rank, before
it uses a byte (before it even takes a lock on the slice), reads the entry
and compares both; anything else is refused, all alike:

- **forged**: the caller does not know the tag (128 random bits), which
  exists only in the tokenizer, its table and the internal call;
- **stale or replayed**: the tokenizer clears a request's entries as soon as
  the scheduler no longer needs to read (its first token, or the end of the
  call, whichever comes first: by the first token every rank has read its
  tensors), so a reference of a finished request, or of one that was
  cancelled, names an empty or reissued entry;
- **moved**: an entry granted for one location does not verify for another
  (the digest), so a tag cannot be carried to a neighbour's page.

A refusal happens before any lock, and says the same whatever the slice's
state, so a caller learns nothing from it (no "this page is busy" oracle)
and pins nobody's slice. Entries are per request, not per slice: the
preprocessing cache hands the same slice to many requests, each with an
entry of its own, and clearing one does not disturb the others.

While an entry is valid its slice is held by the chain the hand-over keeps
unbroken (the writer, then the tokenizer, then the scheduler's rank 0 from
Accepted through the step that reads it), so its bytes are the ones granted.

Layout: `ENTRY` bytes per entry, tag (16) then location digest (16), the
rest zero; a free entry has an all-zero tag. The table is created at a fixed
size and never truncated. The owner writes the digest before the tag and
clears the tag first, so a reader never sees a tag beside another
location's digest.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

from mmsplit_server.handoff import files

ENTRY = 64
TAG_BYTES = 16
_ZERO_TAG = bytes(TAG_BYTES)


class GrantRefused(files.SegmentError):
    """The reference is not one its sender granted for this location (or the
    grant has ended). One message for every cause, by design."""

    def __init__(self) -> None:
        super().__init__("the reference is not granted by its sender (forged, or its request has ended)")


class TableFull(files.SegmentError):
    """Every entry of the grant table is in use."""


@dataclass(frozen=True)
class Grant:
    table: str  # the grant table's segment name
    index: int
    tag: bytes


def location_digest(segment: str, offset: int, nbytes: int) -> bytes:
    return hashlib.blake2b(f"{segment}\x00{offset}\x00{nbytes}".encode(), digest_size=16).digest()


class GrantTable:
    """The owner's table (the tokenizer process): created with `entries`
    entries, held under a shared flock (janitors keep away) until `close`,
    which removes it. `issue` and `revoke` are thread-safe."""

    def __init__(self, prefix: str, owner_pid: int, entries: int) -> None:
        if entries < 1:
            raise ValueError("a grant table needs at least one entry")
        self.entries = entries
        self.name = files.new_name(prefix, owner_pid, grants=True)
        fd = files.create_segment(self.name, entries * ENTRY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self._map = mmap.mmap(fd, entries * ENTRY, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            files.unlink(self.name)
            raise
        self._fd: int | None = fd
        self._free = list(range(entries - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self.entries - len(self._free)

    def issue(self, segment: str, offset: int, nbytes: int) -> Grant:
        """A new entry for exactly this location; TableFull when none is free."""
        with self._lock:
            if self._fd is None:
                raise TableFull("the grant table is closed")
            if not self._free:
                raise TableFull(f"all {self.entries} grants are in use")
            index = self._free.pop()
        tag = secrets.token_bytes(TAG_BYTES)
        while tag == _ZERO_TAG:  # pragma: no cover (one chance in 2**128)
            tag = secrets.token_bytes(TAG_BYTES)
        at = index * ENTRY
        self._map[at + TAG_BYTES : at + 2 * TAG_BYTES] = location_digest(segment, offset, nbytes)
        self._map[at : at + TAG_BYTES] = tag
        return Grant(self.name, index, tag)

    def revoke(self, grant: Grant) -> None:
        """End a grant (idempotent for a grant of this table whose entry has
        not been reissued since; callers revoke each grant once)."""
        with self._lock:
            if self._fd is None or grant.table != self.name:
                return
            at = grant.index * ENTRY
            if self._map[at : at + TAG_BYTES] != grant.tag:
                return
            self._map[at : at + ENTRY] = bytes(ENTRY)
            self._free.append(grant.index)

    def close(self) -> None:
        """Remove the table (idempotent): every grant ends."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            self._map[:] = bytes(len(self._map))
            self._map.close()
            files.unlink(self.name)
            os.close(fd)


class _Tables:
    """A reader's mappings of the grant tables it has verified against, one
    per table, made on first use; a table that was removed (its tokenizer
    stopped) is forgotten on a later use, at most once a second."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()
        self._checked = 0.0

    def entry(self, table: str, index: int, prefix: str) -> bytes:
        with self._lock:
            self._forget_removed()
            got = self._maps.get(table)
        if got is None:
            fd, st = files.open_stat(table, prefix)
            try:
                mapping = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if st.st_size else None
            finally:
                os.close(fd)
            if mapping is None:
                raise GrantRefused()
            got = (st.st_ino, mapping)
            with self._lock:
                self._maps.setdefault(table, got)
        mapping = got[1]
        at = index * ENTRY
        if at + ENTRY > len(mapping):
            raise GrantRefused()
        return mapping[at : at + 2 * TAG_BYTES]

    def _forget_removed(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        for name, (ino, _) in list(self._maps.items()):
            try:
                current = os.stat(f"{files.SHM_DIR}/{name}").st_ino
            except FileNotFoundError:
                current = None
            if current != ino:
                del self._maps[name]


_tables = _Tables()


def verify(grant: Grant | None, segment: str, offset: int, nbytes: int, prefix: str) -> None:
    """Raise GrantRefused unless `grant` is a live entry of its table for
    exactly this location. Whatever is wrong (no grant, a table that is not
    there or not ours, an index out of range, another tag or location), the
    refusal is the same."""
    if grant is None or len(grant.tag) != TAG_BYTES or grant.tag == _ZERO_TAG:
        raise GrantRefused()
    try:
        stored = _tables.entry(grant.table, grant.index, prefix)
    except files.NoDescriptors:
        raise  # this server's condition (OVERLOADED), not the reference's
    except (files.SegmentError, OSError, ValueError) as exc:
        raise GrantRefused() from exc
    expected = grant.tag + location_digest(segment, offset, nbytes)
    if not hmac.compare_digest(stored, expected):
        raise GrantRefused()
