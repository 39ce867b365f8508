"""Run a command in a new mount namespace with its own /dev/shm (root only),
as a pod whose containers do not share the host's /dev/shm would:
``python -m tests.support.mountns SIZE CMD [ARG ...]``.

The namespace's mounts are made private (nothing propagates back), a fresh
tmpfs of SIZE (e.g. ``64m``, Kubernetes' default for /dev/shm) is mounted on
/dev/shm, and the command is exec'd in place of this process (same pid), so a
test stops it like any service process and can look at its /dev/shm through
``/proc/<pid>/root/dev/shm``. The namespace goes with its last process. The suite's zygote calls
`own_dev_shm` itself for a service it forks under this wrapper.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


def own_dev_shm(size: str) -> None:
    """Move this process into a new mount namespace with a /dev/shm of its
    own of `size` (raises SystemExit with the reason where it cannot)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise SystemExit(f"{what} failed: {os.strerror(ctypes.get_errno())}")

    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size},mode=1777".encode()), "mounting /dev/shm")


def join(pid: int) -> None:
    """Move this (single-threaded) process into the mount namespace of
    process `pid`, where that is not already its own, keeping its working
    directory (by path)."""
    theirs, ours = f"/proc/{pid}/ns/mnt", "/proc/self/ns/mnt"
    if os.stat(theirs).st_ino == os.stat(ours).st_ino:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    cwd = os.getcwd()
    fd = os.open(theirs, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNS) != 0:
            raise SystemExit(f"setns(CLONE_NEWNS) into {theirs} failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    os.chdir(cwd)  # setns put it at the namespace's root


def main() -> None:
    size, command = sys.argv[1], sys.argv[2:]
    own_dev_shm(size)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
