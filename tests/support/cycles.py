"""What only the cyclic garbage collector would free: reference cycles a
piece of code leaves behind (reference counting frees everything else at
once, without waiting for a collection)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
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


# The coroutines of a grpc.aio server's tasks for one call (its Cython
# source, grpcio 1.85): the call's server side runs until both are done.
_SERVER_CALL = frozenset({"_schedule_rpc_coro", "_handle_exceptions"})


async def server_calls_ended(timeout_s: float = 30.0) -> None:
    """Wait until no grpc.aio server call runs on this event loop: a call's
    server side ends (its done callbacks run, its state is let go) a little
    after its client has the status, on core's word that the call closed."""
    deadline = time.monotonic() + timeout_s
    while any(getattr(t.get_coro(), "__qualname__", "") in _SERVER_CALL for t in asyncio.all_tasks()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a gRPC server call still ran after {timeout_s} s")
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # the ended tasks' own done callbacks
