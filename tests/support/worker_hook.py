"""Fault injection inside CPU workers (tokenizer `--worker-hook tests.support.worker_hook`).

Images are marked by their size, so any encoding carries the mark:
- SLOW (61x47): the worker sleeps 1.5 s before preprocessing; SLOWER
  (59x53): 4 s (where a bound must hold with room on a busy host);
- POISON (67x43): the worker kills itself with SIGKILL;
- MID_WRITE (71x41): the worker kills itself with SIGKILL after writing the
  image's pixels into a slab slice, while it still holds the slice's write lock;
- UNSENDABLE (73x37): the worker raises an exception that pickling cannot
  rebuild (as some libraries' exceptions are);
- HOG (79x31): the worker maps 4 GiB (never touched, so it costs nothing
  where nothing limits it): over its --worker-memory-bytes, a MemoryError.
If the file named by MMSPLIT_TEST_FAIL_POOL_FILE exists, a new worker fails
in its initializer (pool creation fails) until the file is removed. For each
file in the directory named by MMSPLIT_TEST_DIE_AT_START_DIR, one starting
worker removes it and SIGKILLs itself in its initializer (a worker killed as
it starts, by the OOM killer say). If MMSPLIT_TEST_SERVING_DIR names a
directory, a worker writes a file named by its pid there once it has
decoded an image: it has started and serves (what a test that kills only
serving workers looks for, however long starting took). If
MMSPLIT_TEST_SLOW_DIR names a directory, a worker writes a file named by
its pid and the time there as it begins a SLOW sleep: it is busy with that item now
(what a test that cancels mid-preprocessing waits for).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
from PIL import Image

SLOW = (61, 47)
SLOWER = (59, 53)
POISON = (67, 43)
MID_WRITE = (71, 41)
UNSENDABLE = (73, 37)
HOG = (79, 31)
_kill_on_write = False
_said_serving = False


def on_worker_start() -> None:
    marker = os.environ.get("MMSPLIT_TEST_FAIL_POOL_FILE")
    if marker and Path(marker).exists():
        raise RuntimeError("injected pool-creation failure")
    deaths = os.environ.get("MMSPLIT_TEST_DIE_AT_START_DIR")
    for death in sorted(Path(deaths).iterdir()) if deaths else []:
        try:
            death.unlink()  # one death per file, whoever removes it first
        except FileNotFoundError:
            continue
        os.kill(os.getpid(), signal.SIGKILL)


class Unbuildable(Exception):
    """Pickled with args=(message,), rebuilt with one argument of two: fails."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def on_decoded(image: Image.Image) -> None:
    global _kill_on_write, _said_serving
    serving = os.environ.get("MMSPLIT_TEST_SERVING_DIR")
    if serving and not _said_serving:
        _said_serving = True
        (Path(serving) / str(os.getpid())).touch()
    _kill_on_write = image.size == MID_WRITE
    if image.size == SLOW:
        slowed = os.environ.get("MMSPLIT_TEST_SLOW_DIR")
        if slowed:
            (Path(slowed) / f"{os.getpid()}-{time.monotonic_ns()}").touch()
        time.sleep(1.5)
    elif image.size == SLOWER:
        time.sleep(4.0)
    elif image.size == POISON:
        os.kill(os.getpid(), signal.SIGKILL)
    elif image.size == UNSENDABLE:
        raise Unbuildable("injected", "cannot be rebuilt")
    elif image.size == HOG:
        hog = np.empty(4 << 30, dtype=np.uint8)
        del hog


def on_slice_written() -> None:
    if _kill_on_write:
        os.kill(os.getpid(), signal.SIGKILL)


def slow_pids(marks: Path) -> set[int]:
    """The workers that have begun a SLOW sleep, by the marks they left in
    MMSPLIT_TEST_SLOW_DIR (`marks`)."""
    return {int(mark.name.split("-")[0]) for mark in marks.iterdir()}


def marked(size: tuple[int, int]) -> bytes:
    from mmsplit_cli import samples

    return samples.encode(samples.gradient(*size), "PNG")
