"""A child process that takes something (a lock) and holds it until it is
SIGKILLed: what a holder that dies looks like to everyone else."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def killed_after(statement: str) -> Iterator[None]:
    """Run `statement` in a new Python process; inside the block it holds
    whatever the statement took; on leaving, it is SIGKILLed and reaped."""
    code = f"import sys; {statement}; print('held', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held", "the child failed before it held anything"
        yield
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
