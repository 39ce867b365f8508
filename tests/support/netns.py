"""A network namespace made for one test (root only): its loopback up and
one more address on it that is not a loopback address, so a service can
bind "somewhere else" while every packet stays inside the namespace."""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"  # where `ip netns add` binds a namespace's name


@dataclass(frozen=True)
class NetNs:
    name: str
    address: str

    @property
    def wrapper(self) -> list[str]:
        """Prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]


def join(name: str) -> None:
    """Move this process into the network namespace `name`: what `ip netns
    exec` does for the network (the suite's zygote calls it for a service it
    forks under `NetNs.wrapper`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise SystemExit(f"setns({name}) failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def netns(address: str = "10.213.0.1") -> Iterator[NetNs]:
    ns = NetNs(f"mmsplit-test-{secrets.token_hex(4)}", address)
    _ip("netns", "add", ns.name)
    try:
        _ip("netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", ns.name, "ip", "addr", "add", f"{address}/32", "dev", "lo")
        yield ns
    finally:
        _ip("netns", "del", ns.name)


def available() -> str:
    """Empty when namespaces can be made here, else why not."""
    try:
        with netns():
            return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a network namespace here: {exc}"
