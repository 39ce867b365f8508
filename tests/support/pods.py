"""Network namespaces joined by veth links, standing in for pods on a
cluster network (root only): ``with pods(["r0", "r1"], [("r0", "r1")]) as net``.
(`tests.support.netns` makes a single namespace; this makes several, linked.)

Every namespace gets its loopback up; each link is a veth pair with one end
in each namespace and a /24 of its own (10.77.<link>.1 on the first side,
.2 on the second). Nothing touches the host's interfaces, so traffic stays
inside the namespaces the test made. On exit the namespaces are deleted,
which removes their veths; a process still inside one keeps it alive only
until it exits (the caller stops its processes first)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Link:
    """One veth pair: its interface and address on each side."""

    ends: dict[str, tuple[str, str]] = field(default_factory=dict)  # pod -> (interface, address)

    def address(self, pod: str) -> str:
        return self.ends[pod][1]

    def interface(self, pod: str) -> str:
        return self.ends[pod][0]


@dataclass
class Pods:
    namespaces: dict[str, str]  # pod -> namespace name
    links: list[Link]

    def wrapper(self, pod: str, *, shm_size: str = "") -> list[str]:
        """A command prefix that runs a command inside `pod`'s network
        namespace (and, with `shm_size`, on a /dev/shm of its own). Both
        steps exec, so the command keeps the pid the caller started."""
        command = ["ip", "netns", "exec", self.namespaces[pod]]
        if shm_size:
            command += [sys.executable, "-m", "tests.support.mountns", shm_size]
        return command

    def client(
        self, pod: str, address: str, specs: list[dict[str, Any]], *, keepalive_s: float | None = None
    ) -> subprocess.Popen[str]:
        """`start_client` inside `pod`."""
        return start_client(address, specs, keepalive_s=keepalive_s, wrapper=self.wrapper(pod))

    def pids(self, pod: str) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[pod]], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        return [int(p) for p in out.split()]

    def link(self, a: str, b: str) -> Link:
        return next(link for link in self.links if set(link.ends) == {a, b})


def start_client(
    address: str, specs: list[dict[str, Any]], *, keepalive_s: float | None = None, wrapper: Sequence[str] = ()
) -> subprocess.Popen[str]:
    """`tests.support.pod_client` sending these requests to `address` (run
    under `wrapper`, such as a pod's); its JSON lines on stdout."""
    from tests.support.services import ENV, ROOT

    command = [*wrapper, sys.executable, "-m", "tests.support.pod_client", address, json.dumps(specs)]
    if keepalive_s is not None:
        command.append(str(keepalive_s))
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **ENV})


@contextlib.contextmanager
def pods(names: Sequence[str], links: Sequence[tuple[str, str]]) -> Iterator[Pods]:
    tag = uuid.uuid4().hex[:4]
    namespaces = {name: f"mms-{tag}-{name}" for name in names}
    made: list[str] = []
    try:
        for ns in namespaces.values():
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        result = []
        for i, (a, b) in enumerate(links, start=1):
            # Interface names are at most 15 characters.
            end_a, end_b = f"v{tag}{i}a", f"v{tag}{i}b"
            ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
            link = Link()
            for pod, end, host in ((a, end_a, 1), (b, end_b, 2)):
                ns = namespaces[pod]
                ip("link", "set", end, "netns", ns)
                ip("-n", ns, "addr", "add", f"10.77.{i}.{host}/24", "dev", end)
                ip("-n", ns, "link", "set", end, "up")
                link.ends[pod] = (end, f"10.77.{i}.{host}")
            result.append(link)
        yield Pods(namespaces, result)
    finally:
        for ns in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", ns)
