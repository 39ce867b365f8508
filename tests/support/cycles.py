"""What only the cyclic garbage collector would free: reference cycles a
piece of code leaves behind (reference counting frees everything else at
once, without waiting for a collection)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from google.protobuf.message import Message


@contextlib.contextmanager
def uncollected() -> Iterator[list[str]]:
    """Within the block the collector is off; after it, the list holds the
    type names of the exceptions, frames and protobuf messages (a request's
    bytes) that are left in reference cycles (the block's garbage, found by
    one collection and not kept).
    Collect while the event loop still runs, if there is one: its own
    objects are not garbage then."""
    found: list[str] = []
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(
            type(o).__name__
            for o in gc.garbage
            if isinstance(o, BaseException | Message) or type(o).__name__ == "frame"
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
