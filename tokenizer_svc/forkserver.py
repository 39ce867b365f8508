"""The forkserver the CPU pool's workers are forked from (`tokenizer_svc.pool`).

It preloads `tokenizer_svc.preprocess` (transformers, torch, PIL), ~5 s of
imports here, so each worker and each replacement starts without them.
`start` launches it before the tokenizer imports those same modules itself:
the two imports then run side by side on two cores instead of one after the
other. Measured here: a tokenizer served in ~9 s, and ~4.5 s when its
forkserver started first (`mmsplit_cli.main`).

The forkserver leaves when the tokenizer is gone (its end of a pipe
closes). It leaves without the interpreter's teardown of what it preloaded
(`_leave_at_once`): that teardown cost ~1.2 s of CPU here after every
tokenizer's exit, on the cores the next process starts on. Nothing of the
forkserver's needs it: it holds no buffered output and no state that outlives
it, and its workers are processes of their own that end by `os._exit`.

This module imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.context
import multiprocessing.forkserver
import os
import sys
import types

log = logging.getLogger(__name__)

# This module last: its exit hook is then the last registered, and runs first.
PRELOAD = ["tokenizer_svc.preprocess", "tokenizer_svc.worker", "transformers", "PIL.Image", "numpy", __name__]


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with its preload set (it applies when the
    forkserver next starts: now, or again after it died)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the forkserver now, if it is not running. Call it once the
    process's environment and limits are what the workers should inherit
    (the open-file limit, OMP settings). A failure here is only logged: the
    pool's first worker tries again, and reports what stops it."""
    context()
    try:
        multiprocessing.forkserver.ensure_running()
    except OSError as exc:
        log.warning("could not start the CPU pool's forkserver early: %s", exc)


def _preloaded_by_forkserver() -> bool:
    """Whether this import is the forkserver's preload (`PRELOAD`), made
    from multiprocessing's forkserver loop, and not any other process's."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _leave_at_once() -> None:
    """The forkserver's exit, once its loop has ended: skip the teardown of
    torch and transformers' modules."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


# True in the forkserver and the workers forked from it (which end by
# `os._exit` and never run exit hooks); False in any other process.
LEAVES_AT_ONCE = _preloaded_by_forkserver()
if LEAVES_AT_ONCE:
    atexit.register(_leave_at_once)
