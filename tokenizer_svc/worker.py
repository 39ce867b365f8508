"""One CPU worker of the pool (`tokenizer_svc.pool`): the worker process's
side (`serve`), and this process's link to it (`WorkerLink`).

The two ends talk over one socket (`multiprocessing.Pipe(duplex=True)`) in
`multiprocessing.Connection`'s framing: the worker uses a `Connection`,
blocking, one message at a time; this process's event loop writes and
reads the socket without blocking and without a thread in between. What
the socket does not take at once waits in an outbox until it does; what
arrives in pieces is put together in an inbox. The pool decides what the
messages mean; the link only moves them, and says when the socket ends.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

from mmsplit_server.handoff import ranges
from mmsplit_server.serving import name_process
from tokenizer_svc import forkserver
from tokenizer_svc.errors import InternalError
from tokenizer_svc.preprocess import init_worker, preprocess

log = logging.getLogger(__name__)

# How long a stopping worker gets to exit before it is killed.
STOP_TIMEOUT_S = 5.0
# How often an idle worker checks whether the slices it wrote were taken.
HAND_OFF_POLL_S = 0.002
# multiprocessing.Connection's framing (what the worker's `recv` reads).
_SIZE = struct.Struct("!i")
_LONG = struct.Struct("!Q")


def serve(
    conn: multiprocessing.connection.Connection, model_dir: str, owner_pid: int, hook: str, memory_bytes: int = 0
) -> None:
    """A worker's life: the initializer, then its tasks in the order they
    come, each answered in turn; it ends when this process's end closes.
    Says ("ready", pid) or ("failed", why) first, then ("ok", result) or
    ("error", exception) per task."""
    name_process(forkserver.WORKER)
    try:
        init_worker(model_dir, owner_pid, hook, memory_bytes)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    ranges.poll_hand_offs_here()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            # Slices written for earlier tasks go once the tokenizer has
            # taken them: checked between tasks, and every HAND_OFF_POLL_S
            # while no task is waiting.
            while ranges.poll_hand_offs() and not conn.poll(HAND_OFF_POLL_S):
                pass
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        reply: tuple[str, Any]
        try:
            reply = ("ok", preprocess(job))
        except Exception as exc:
            reply = ("error", _portable(exc))
        try:
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:  # the reply, not the socket
                conn.send(("error", InternalError(f"a preprocessing result could not be sent back: {exc}")))
        except OSError:  # the pool closed our socket (it stopped)
            return


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling (ours do), else an InternalError that
    says what it was: an exception the tokenizer could not rebuild would
    read as garbage from a worker, which is then replaced."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return InternalError(f"preprocessing failed: {type(exc).__name__}: {exc}")
    return exc


class WorkerLink:
    """This process's end of one worker: its process and its socket, which
    the event loop watches from construction to `close`. `on_message(link,
    message)` gets each message as it arrives, `on_lost(link)` the socket's
    end (the worker died or stopped, or sent what could not be read and was
    killed for it); neither is called after `close`. Event loop only."""

    def __init__(
        self,
        process: Any,
        conn: multiprocessing.connection.Connection,
        *,
        on_message: Callable[[WorkerLink, Any], None],
        on_lost: Callable[[WorkerLink], None],
    ) -> None:
        self.process = process
        self._conn = conn
        self._fd = conn.fileno()
        self._on_message = on_message
        self._on_lost = on_lost
        self._inbox = bytearray()
        self._outbox = bytearray()
        self.open = True
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._fd, False)
        self._loop.add_reader(self._fd, self._readable)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def send(self, message: Any) -> None:
        """Write `message` to the worker, now or as soon as its socket takes
        it; never blocks. Dropped when the link is closed."""
        if not self.open:  # its descriptor is closed, and its number may be another's now
            return
        data = _frame(message)
        if not self._outbox:
            try:
                sent = os.write(self._fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:  # it died: its end reads EOF, and `on_lost` hears of it
                return
            data = data[sent:]
            if not data:
                return
            self._loop.add_writer(self._fd, self._writable)
        self._outbox += data

    def close(self) -> None:
        """Stop watching the socket and close it, once (its descriptor's
        number may belong to another worker's socket afterwards). The
        worker reads the end and exits."""
        if not self.open:
            return
        self.open = False
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._conn.close()

    def _writable(self) -> None:
        try:
            sent = os.write(self._fd, self._outbox)
        except BlockingIOError:
            return
        except OSError:
            sent = len(self._outbox)
        del self._outbox[:sent]
        if not self._outbox:
            self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        while True:
            try:
                got = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                got = b""
            if not got:
                self._on_lost(self)
                return
            self._inbox += got
        try:
            while self.open and (message := _unframe(self._inbox)) is not None:
                self._on_message(self, message)
        except Exception:  # a message that does not decode: nothing more from it can be trusted
            log.exception("a CPU worker sent what could not be read; replacing it")
            self.process.kill()
            self._on_lost(self)


def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > 0x7FFFFFFF:
        return _SIZE.pack(-1) + _LONG.pack(len(payload)) + payload
    return _SIZE.pack(len(payload)) + payload


def _unframe(inbox: bytearray) -> Any | None:
    """The first whole message in `inbox` (removed from it), or None."""
    if len(inbox) < _SIZE.size:
        return None
    (size,) = _SIZE.unpack_from(inbox)
    start = _SIZE.size
    if size == -1:
        if len(inbox) < start + _LONG.size:
            return None
        (size,) = _LONG.unpack_from(inbox, start)
        start += _LONG.size
    if len(inbox) < start + size:
        return None
    with memoryview(inbox) as whole, whole[start : start + size] as payload:
        message = pickle.loads(payload)
    del inbox[: start + size]
    return message


def reap(process: Any) -> None:
    """Wait for a worker to exit; kill it if it does not; then let go of
    the descriptors its `Process` holds (the forkserver's pipes to it),
    now rather than whenever the object is collected (a thread's call)."""
    process.join(STOP_TIMEOUT_S)
    if process.exitcode is None:
        process.kill()
        process.join(STOP_TIMEOUT_S)
    if process.exitcode is not None:
        process.close()
