"""`mmsplit serve`'s stderr as a test reads it: every line kept, and an
event set at its ready line (or when the stream ends, so a waiter never
waits on a process that died)."""

from __future__ import annotations

import subprocess
import threading

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

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def join(self) -> None:
        self._reader.join(10)
