"""The forkserver the CPU pool's workers are forked from (`tokenizer_svc.pool`).

It preloads `tokenizer_svc.preprocess` (transformers, torch, PIL), ~5 s of
imports here, so each worker and each replacement starts without them.
`start` launches it before the tokenizer imports those same modules itself:
the two imports then run side by side on two cores instead of one after the
other. Measured here: a tokenizer served in ~9 s, and ~4.5 s when its
forkserver started first (`mmsplit_cli.main`).

This module imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.context
import multiprocessing.forkserver

log = logging.getLogger(__name__)

PRELOAD = ["tokenizer_svc.preprocess", "tokenizer_svc.worker", "transformers", "PIL.Image", "numpy"]


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
