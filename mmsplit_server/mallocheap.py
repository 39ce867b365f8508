"""glibc's heap in a long-running process that handles large buffers:
freed buffers kept for the next request instead of handed back to the
kernel.

With glibc's defaults an allocation over its mmap threshold (which grows
with use to at most 32 MiB) is a mapping of its own, unmapped when freed,
so each one is page-faulted in again as it is written: `bytes()` of a
50.6 MB slab slice (a 1920x1080 Qwen image's rows of both frames in
float32) took 29.6 ms here, and 8.5-8.9 ms from a heap that keeps freed
memory (a memory copy's own time). Services meet such buffers per request:
the tokenizer copies each new item into its preprocessing cache on its
event loop (a stall for every stream it serves), receives inline items
from its workers and serializes them for a scheduler elsewhere; a rank
makes each item the model's own input; a CPU worker's processor makes and
frees the same few large arrays per image (bench/preprocess.py). Bounded:
allocations under 128 MiB come from the heap (the scheduler's default
--max-tensor-bytes: a Qwen image at its checkpoint's budget in bfloat16 is
up to ~77 MB, whose copy took 35-39 ms as a fresh mapping and 7-8 ms from
the heap here), and at most 128 MiB of free memory at its top is kept.

The top is not all of it: memory freed inside a heap, and in the heaps of
other threads (the tokenizer reads big bodies and data: URLs on threads),
stays with the process whatever the thresholds. A tokenizer answering
rounds of 48 requests with 9 MB data: URLs, 24 at a time, held 2.5 GB free
afterwards (`mallinfo2`'s fordblks, against 0.14 GB in use), 3.6 GB
resident where it starts at 0.47, more each round: in a container with a
memory limit, an out-of-memory kill made of memory nobody uses.
`Bound` bounds it: a process that checks it now and then (the tokenizer's
watch, every 2 s) gives back what its heaps hold free while that is over
FREE_HELD_AT_MOST, at most every TRIM_EVERY_S (`malloc_trim`: 3.6 -> 0.43
GB resident there), and keeps the warm heap below that. Scheduler ranks
check in their idle steps only (`scheduler_svc.loop.IdleHeap`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time

log = logging.getLogger(__name__)

# glibc's mallopt parameters, and the values `keep` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 128 << 20
HEAP_TRIM_THRESHOLD = 128 << 20


# glibc's own environment for these thresholds: where one is set, it is left to glibc.
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


# The free memory a process's heaps may hold before `Bound.check` gives it back.
FREE_HELD_AT_MOST = 256 << 20
# How often, at most, `Bound.check` gives it back.
TRIM_EVERY_S = 10.0
# While the process is busy, `Bound.check` waits for an idle moment unless
# its heaps hold more than this many times the limit free.
BUSY_FACTOR = 4


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once (each load is objects in reference cycles that
    only a collection frees); None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def free_held() -> int | None:
    """Bytes glibc's heaps hold free (`mallinfo2().fordblks`, every arena's);
    None without glibc 2.33's mallinfo2."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)


class Bound:
    """The free memory a process's heaps keep, bounded: `check`, called now
    and then, gives every heap's free memory back to the kernel while glibc
    holds more than `limit` free, at most once every `every_s` (memory
    given back still counts as free to glibc, and freed memory does not
    grow the process, so neither says whether there is anything new to give
    back: the interval bounds what asking costs). Off the event loop:
    `malloc_trim` locks each heap while it runs, ~230 ms for 2.4 GB of
    holes here, ~1 ms when there is nothing new to give back; and the
    loop's own allocations wait for the heap being trimmed (`bench/
    trim_stall.py`: ~90 ms for 1 GiB of holes in the main heap). So a
    busy process (`check(busy=True)`: requests in flight, whose streams
    would stall) waits for an idle moment, unless its heaps hold more than
    BUSY_FACTOR times the limit free."""

    def __init__(self, limit: int = FREE_HELD_AT_MOST, every_s: float = TRIM_EVERY_S) -> None:
        self.limit, self.every_s = limit, every_s
        self._last: float | None = None  # when it last trimmed (monotonic)

    def check(self, busy: bool = False) -> int:
        """Trim if due; the resident bytes that went (0: not due, or not glibc)."""
        held = free_held()
        if held is None or held <= self.limit or (busy and held <= self.limit * BUSY_FACTOR):
            return 0
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return 0
        self._last = now
        before = resident()
        _libc().malloc_trim(0)  # type: ignore[union-attr]  # (free_held found it)
        after = resident()
        log.debug(
            "the heaps held %d MiB free: %d MiB of resident memory given back", held >> 20, (before - after) >> 20
        )
        return max(0, before - after)


def resident() -> int:
    """This process's resident memory in bytes (Linux's /proc/self/statm)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def keep() -> bool:
    """Set this process's thresholds (kept by its forks); False without
    glibc, or where the environment sets either (an operator's, or a
    benchmark's baseline: bench/image_rows.py)."""
    if any(os.environ.get(name) for name in ENVIRONMENT):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False
