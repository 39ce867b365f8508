"""The one-off segment transport: a tensor in a shared-memory segment of its
own, for a tensor over a quarter of the slab or a tokenizer run without one.

Placed by its writer (`place`: a new segment holding exactly the tensor),
owned by whoever holds a `Claim` on it (a shared flock through an open
descriptor: DESIGN.md §3, "receiver locks, then says Accepted, then the
sender lets go"), read by copying (`read_into`, pread: no mapping), and
removed by its owner's `Claim.release`. A lock vanishes with its process
however it dies, so a janitor (`files.sweep`) that gets an exclusive flock
without waiting knows nobody owns the segment.
"""

from __future__ import annotations

import fcntl
import os

from mmsplit_server.handoff.files import (
    BadSegmentName,
    SegmentBounds,
    SegmentMissing,
    Slice,
    create_segment,
    is_slab,
    new_name,
    open_file,
    parse_name,
    unlink,
)


def place(prefix: str, owner_pid: int, data: memoryview) -> Slice:
    """A new segment holding exactly `data` (C-contiguous bytes)."""
    data = data.cast("B")
    nbytes = data.nbytes
    if nbytes == 0:
        raise ValueError("refusing to create an empty segment")
    name = new_name(prefix, owner_pid)
    fd = create_segment(name, nbytes)
    try:
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
    """Copy a validated slice of a one-off segment into `out` (writable,
    exactly `piece.nbytes`). A slab's slice is not a segment's: it is read
    through the slab's mapping (`mmsplit_server.handoff.slab`)."""
    parse_name(piece.segment, prefix)
    if is_slab(piece.segment):
        raise BadSegmentName("a slab's slice is read through the slab, not as a segment")
    out = out.cast("B")
    if out.nbytes != piece.nbytes:
        raise SegmentBounds(f"destination holds {out.nbytes} bytes, slice has {piece.nbytes}")
    fd, st = open_file(piece.segment)
    try:
        size = st.st_size
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


class Claim:
    """A hold on one segment: a shared flock through an open descriptor,
    until `release` or `disown` (or until this process dies). Shared, so the
    sender and the receiver both hold it during the hand-over."""

    def __init__(self, name: str, prefix: str) -> None:
        parse_name(name, prefix)
        self.name = name
        self._fd: int | None = open_file(name)[0]
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:  # a janitor holds it exclusively: it is being swept
            os.close(self._fd)
            self._fd = None
            raise SegmentMissing("the segment is being removed") from exc

    def release(self) -> None:
        """Done with it, as its owner: the segment is removed, then the lock
        dropped (idempotent, never raises)."""
        if self._fd is not None:
            unlink(self.name)
        self.disown()

    def disown(self) -> None:
        """Another holder owns it now (or never stopped owning it): drop the
        lock only, the segment stays (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
