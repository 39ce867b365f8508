"""The forkserver the CPU pool's workers are forked from (`tokenizer_svc.pool`).

A worker must start with transformers, torch and PIL imported (~5-8 s of
imports here) and without the tokenizer's threads, so workers are forked
from a forkserver that has imported them and runs no other thread. The
tokenizer starts it as a fork of itself (`start_forked`), once its own
imports are done and before it starts any thread: the forkserver then costs
no imports at all. Started the other way, as multiprocessing does
(`start`: a new interpreter that imports `PRELOAD`), it imported the same
modules a second time: ~7 s of CPU per tokenizer start on a slow host,
about half of what a tokenizer costs to start, and on a busy node (or a
test suite that starts ~40 tokenizers) that CPU is wall time. `start` is
what runs when `start_forked` cannot fork safely (the process already runs
a Python thread), and what multiprocessing runs again if the forkserver dies.

The forkserver leaves when the tokenizer is gone (its end of a pipe
closes), without the interpreter's teardown of what it imported: that
teardown cost ~1.2 s of CPU here after every tokenizer's exit, on the cores
the next process starts on. Nothing of the forkserver's needs it: it holds
no buffered output and no state that outlives it, and its workers are
processes of their own that end by `os._exit`.

This module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import socket
import sys
import tempfile
import threading
import types
from typing import Any, NoReturn

from mmsplit_server.serving import at_exit_now, name_process

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


# What a forkserver forked from the tokenizer calls itself (its comm, as
# `ps` and `top` show it; at most 15 bytes). Its workers call themselves WORKER.
NAME = b"mmsplit-forksrv"
WORKER = b"mmsplit-cpu"
# The directory (in the temporary directory) a forked forkserver listens in.
SOCKET_DIR_PREFIX = "mmsplit-forksrv-"


def start_forked() -> None:
    """Start the forkserver as a fork of this process, if it is not running:
    call it once this process has imported what the workers need and
    before it starts any thread (forking a process that runs other threads
    can leave the child holding their locks). Falls back to `start` where
    this process already runs a Python thread, or cannot fork now. The pool finds it as
    multiprocessing's forkserver: workers are asked of it over its socket,
    and should it die, multiprocessing starts one the other way (`start`)."""
    context()
    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() > 1:
        log.warning("this process runs other threads: starting the CPU pool's forkserver as a new process")
        start()
        return
    server: Any = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        if server._forkserver_pid is not None:
            pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return  # running
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        try:
            multiprocessing.resource_tracker.ensure_running()
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = _fork()
        except OSError as exc:
            failed: OSError | None = exc
        else:
            failed = None
    if failed is not None:  # no fork now (memory, process limit): a new process, or the pool's retries
        log.warning("could not fork the CPU pool's forkserver (%s): starting it as a new process", failed)
        start()
        return
    log.info("CPU pool forkserver forked as pid %d", server._forkserver_pid)


def _fork() -> tuple[str, int, int]:
    """Fork the forkserver: (its address, the write end of its "alive"
    pipe, its pid). Its socket is in a directory of its own (mode 0700, as
    multiprocessing's), which the forkserver removes when it leaves (so a
    tokenizer that is killed leaves nothing in the temporary directory),
    and so does the tokenizer when it exits (`exit_now`: in a PID
    namespace the forkserver is killed as the tokenizer leaves). Leaves
    nothing open or made behind a failure."""
    where = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    try:
        with socket.socket(socket.AF_UNIX) as listener:
            address = os.path.join(where, "listener")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            # Every client holds the write end; the forkserver leaves at its EOF.
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(alive_r)
                os.close(alive_w)
                raise
            if pid == 0:
                _serve_forked(listener.fileno(), alive_r, where)
            os.close(alive_r)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    at_exit_now(functools.partial(shutil.rmtree, where, ignore_errors=True))
    return address, alive_w, pid


def _serve_forked(listener_fd: int, alive_r: int, socket_dir: str) -> NoReturn:
    """The forked forkserver's life: only the descriptors it serves with
    and the standard streams kept (as a new process would have), then
    multiprocessing's forkserver loop, until the tokenizer is gone; then
    its socket's directory removed."""
    global LEAVES_AT_ONCE
    code = 0
    try:
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        name_process(NAME)
        LEAVES_AT_ONCE = True
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # the tokenizer is gone
        pass
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
        _leave_at_once(code)


def _preloaded_by_forkserver() -> bool:
    """Whether this import is the forkserver's preload (`PRELOAD`), made
    from multiprocessing's forkserver loop, and not any other process's."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _leave_at_once(code: int = 0) -> NoReturn:
    """The forkserver's exit, once its loop has ended: skip the teardown of
    torch and transformers' modules."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(code)


# True in the forkserver and the workers forked from it (which end by
# `os._exit` and never run exit hooks); False in any other process.
# (`_serve_forked` sets it in a forked one.)
LEAVES_AT_ONCE = _preloaded_by_forkserver()
if LEAVES_AT_ONCE:
    atexit.register(_leave_at_once)
