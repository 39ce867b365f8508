"""The slab-slice transport: a tensor in a slice of the tokenizer's slab
(one pre-allocated segment; its leases are byte-range locks, `ranges`).

Placed by its writer (`place`: a slice allocated, the bytes copied in
through this process's mapping, the slice held under a read lock), taken
over by each next holder (`ranges.take`), lent to a rank's step in place
(`lend`: the bytes in this process's mapping, no copy, under the rank's own
lock), and freed when its last holder lets go (`ranges.Held.release`): a
slab is never unlinked by a release.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from mmsplit_server.handoff import files, ranges


def place(
    name: str, prefix: str, data: memoryview, *, wait_s: float, on_written: Callable[[], None] | None = None
) -> ranges.Held:
    """Allocate a slice of slab `name`, copy `data` into it through this
    process's mapping and return it held under a read lock. Waits up to
    `wait_s` for room; raises SlabFull. `on_written` runs while the slice is
    still write-locked (a test hook)."""
    data = data.cast("B")

    def fill(fd: int, ino: int, offset: int) -> None:
        view = ranges.mapping(fd, name, write=True, ino=ino)
        try:
            view[offset : offset + data.nbytes] = data
        finally:
            view.release()
        if on_written is not None:
            on_written()

    return ranges.lease(name, prefix, data.nbytes, fill, wait_s=wait_s)


def lend(piece: files.Slice, prefix: str) -> tuple[memoryview, ranges.Held]:
    """The slice's bytes in place, read-only, under a lock of the caller's
    own (`ranges.take`): the view is valid until the lock is released."""
    held = ranges.take(piece, prefix)
    try:
        return held.view(), held
    except BaseException:
        held.close()
        raise


def view(piece: files.Slice, prefix: str) -> memoryview:
    """A read-only view of a slab slice in this process's mapping of the
    slab: the bytes in place, no copy. Valid to read while the slice is
    held (`ranges.take`); the view keeps the mapping alive, never the slice."""
    files.parse_name(piece.segment, prefix)
    whole = ranges.cached_mapping(piece.segment)
    if whole is None:
        fd = files.open_segment(piece.segment, prefix)
        try:
            whole = ranges.mapping(fd, piece.segment, write=False)
        finally:
            os.close(fd)
    try:
        if piece.offset < 0 or piece.offset + piece.nbytes > whole.nbytes:
            raise files.SegmentBounds(f"slice [{piece.offset}, {piece.offset + piece.nbytes}) lies outside the slab")
        # A writer's own mapping is writable: the view never is.
        return whole[piece.offset : piece.offset + piece.nbytes].toreadonly()
    finally:
        whole.release()


def read_into(piece: files.Slice, prefix: str, out: memoryview) -> None:
    """Copy a slab slice into `out` (exactly `piece.nbytes`) through this
    process's mapping of the slab. The caller holds the slice (`ranges.take`),
    or another holder does until every reader is done (the agreement)."""
    out = out.cast("B")
    if out.nbytes != piece.nbytes:
        raise files.SegmentBounds(f"destination holds {out.nbytes} bytes, slice has {piece.nbytes}")
    part = view(piece, prefix)
    try:
        out[:] = part
    finally:
        part.release()
