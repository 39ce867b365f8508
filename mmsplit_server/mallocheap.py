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
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters, and the values `keep` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 128 << 20
HEAP_TRIM_THRESHOLD = 128 << 20


# glibc's own environment for these thresholds: where one is set, it is left to glibc.
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


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
