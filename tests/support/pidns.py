"""Run a command as PID 1 of a new pid namespace (root only), as a container
runtime would: ``python -m tests.support.pidns CMD [ARG ...]``.

The launcher stays in the parent namespace, forwards SIGTERM and SIGINT to
the command, and exits with its status, so a test stops it like any service
process. /dev/shm and the network stay shared with the parent namespace.
The suite's zygote calls `become_pid_1` itself for a service it forks under
this wrapper.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1


def become_pid_1() -> None:
    """Fork a child as PID 1 of a new pid namespace and return in it. This
    process stays in the parent namespace as the launcher: it forwards
    SIGTERM and SIGINT to the child and exits with its status (it never
    returns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"unshare(CLONE_NEWPID) failed: {os.strerror(err)}")
    child = os.fork()  # the first child of the new namespace: its PID 1
    if child == 0:
        # Killed with its launcher: a test that SIGKILLs the launcher (a
        # failed test's cleanup) leaves no namespace behind.
        # (Its parent is outside the namespace: getppid() says 0, so the
        # launcher dying before this call is not seen; the window is this call.)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: os.kill(child, signum))
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal
        os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    become_pid_1()
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)


if __name__ == "__main__":
    main()
