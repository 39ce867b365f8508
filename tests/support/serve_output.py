"""`mmsplit serve`'s stderr as a test reads it: every line kept, and an
event set at its ready line (or when the stream ends, so a waiter never
waits on a process that died); and a serve's life in a test (`serving`)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

READY = "mmsplit serve: ready:"


class ServeOutput:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._proc = proc
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self.lines.append(line)
            if READY in line:
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        """True once the ready line came and the process still runs."""
        return self._ready.wait(timeout) and self._proc.poll() is None and any(READY in x for x in self.lines)

    @property
    def grpc_address(self) -> str:
        """HOST:PORT of the gRPC API, as its ready line names it (the port
        drawn, under `--port 0`)."""
        said = next(line for line in self.lines if READY in line)
        found = re.search(r"ready: gRPC (\S+?)[ ,]", said)
        assert found, said
        return found.group(1)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def join(self) -> None:
        self._reader.join(10)


@contextmanager
def serving(proc: subprocess.Popen[str]) -> Iterator[ServeOutput]:
    """`proc`, a `mmsplit serve`, once ready; then stopped as a user stops
    it (SIGINT): exit status 0 and no traceback. Killed if the body fails."""
    out = ServeOutput(proc)
    try:
        assert out.wait_ready(180), out.tail()
        yield out
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, out.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    assert "Traceback" not in out.text, out.text[-3000:]
