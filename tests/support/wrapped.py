"""The wrappers the tests run services under, taken as steps by the suite's
zygote in the service it forks, instead of exec'ing the wrapper and a new
interpreter (~10 s of CPU for a tokenizer's imports, ~5 s for a
scheduler's, per start).

`steps` reads a wrapper command; it knows exactly the forms the tests build
(`limits.started_low`, `NetNs.wrapper`, `Pods.wrapper`, `mountns`, `pidns`,
and their chains) and returns None for anything else, which then runs as
the command it is. `take` runs in the forked child before the service
starts and does what each wrapper would have done before its exec: the
same system calls, so the service runs under the same limits and in the
same namespaces. What it does not do: the mount namespace `ip netns exec`
makes to remount /sys (no service reads /sys/class/net). One step no
wrapper makes: `mounts_of PID`, the mount namespace of a process a test
started (a benchmark with a /dev/shm of its own asking for its services).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

from tests.support import mountns, netns, pidns

PYTHON_M = [sys.executable, "-m"]


def steps(wrapper: Sequence[str]) -> list[list[str]] | None:
    """`wrapper` as steps for `take`, in its order, or None where it is not
    (only) made of the wrappers this module knows."""
    rest, out = list(wrapper), []
    while rest:
        if rest[:3] == ["ip", "netns", "exec"] and len(rest) > 3:
            out.append(["netns", rest[3]])
            rest = rest[4:]
        elif rest[:1] == ["prlimit"] and len(rest) > 2 and rest[1].startswith("--nofile=") and rest[2] == "--":
            out.append(["nofile", rest[1].removeprefix("--nofile=")])
            rest = rest[3:]
        elif rest[:3] == [*PYTHON_M, "tests.support.mountns"] and len(rest) > 3:
            out.append(["mountns", rest[3]])
            rest = rest[4:]
        elif rest[:3] == [*PYTHON_M, "tests.support.pidns"]:
            out.append(["pidns"])
            rest = rest[3:]
        else:
            return None
    return out


def take(taken: Sequence[Sequence[str]]) -> None:
    """Take `steps` in this process (a pidns step returns in the new
    namespace's PID 1; this process stays behind as its launcher)."""
    for kind, *args in taken:
        if kind == "netns":
            netns.join(args[0])
        elif kind == "nofile":
            soft, hard = (resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in args[0].split(":"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        elif kind == "mountns":
            mountns.own_dev_shm(args[0])
        elif kind == "mounts_of":
            mountns.join(int(args[0]))
        elif kind == "pidns":
            pidns.become_pid_1()
        else:
            raise ValueError(f"no such step: {kind}")
