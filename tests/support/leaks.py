"""What a test may not leave behind: project segments in /dev/shm, child
processes, files in the services' temporary directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from mmsplit_server.handoff import files, grants, ranges

SHM_DIR = Path("/dev/shm")


def _prefix() -> str:
    """The segment prefix of this test process and every service it starts
    (through the environment: MMSPLIT_SHM_PREFIX is both services' fallback).
    Each pytest-xdist worker has its own, so one worker's leak checks and
    janitors never see another's segments; and each session its own (the
    id of its pytest process: an xdist worker's parent), ended by "x" so
    that no session's is the start of another's: a leak check of one
    session once took another's live slab, run at the same time on the same
    host, for a leak and unlinked it ("mmsplit", a session without xdist,
    began every worker's "mmsplitgw0")."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    session = os.getppid() if worker else os.getpid()
    prefix = "mmsplit" + "".join(c for c in worker if c.isalnum()) + f"s{session}x"
    os.environ["MMSPLIT_SHM_PREFIX"] = prefix
    return prefix


PROJECT_PREFIX = _prefix()

# The temporary directory (TMPDIR) of the services the tests start
# (`tests.support.services.ENV`), one per test process (each pytest-xdist
# worker): what a service leaves in it outlived the service
# (multiprocessing's pymp-* directories did, one per tokenizer run). Named
# by this process's id, so that neither what an interrupted session left
# nor another session running at the same time is taken for this one's.
# Made and removed by the session (tests/conftest.py).
SERVICE_TMP = Path(tempfile.gettempdir()) / f"{PROJECT_PREFIX}-services-tmp-{os.getpid()}"

# The services' runtime directory (their schedulers' local tokens,
# `mmsplit.localauth`), one per test process, through the environment as the
# prefix is: made and removed by the session (tests/conftest.py), so that
# the token files of schedulers a test killed are not left in /tmp.
RUNTIME_DIR = Path(tempfile.gettempdir()) / f"{PROJECT_PREFIX}-runtime-{os.getpid()}"
os.environ["MMSPLIT_RUNTIME_DIR"] = str(RUNTIME_DIR)


# Caches by design in a temporary directory: one directory of a fixed name,
# reused by every run (torch makes its compile cache, torchinductor_<user>,
# on import).
CACHES = ("torchinductor_",)


def service_temp_leftovers(directory: Path = SERVICE_TMP) -> list[str]:
    """What is in the services' temporary directory (or `directory`) that
    no live process uses: every entry but a directory holding a socket
    that is still bound (a running service's forkserver socket, as
    /proc/net/unix lists them), and but the CACHES."""
    if not directory.exists():
        return []
    bound = _bound_unix_paths()
    left = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        inside = [str(p) for p in path.iterdir()] if path.is_dir() and not path.is_symlink() else []
        if not entry.startswith(CACHES) and not any(p in bound for p in inside):
            left.append(entry)
    return left


def _bound_unix_paths() -> set[str]:
    """Paths of the Unix sockets bound in the network namespaces of this
    process and its descendants (services run in namespaces of their own)."""
    paths: set[str] = set()
    seen: set[int] = set()
    for pid in {os.getpid(), *children()}:
        try:
            namespace = os.stat(f"/proc/{pid}/ns/net").st_ino
            if namespace in seen:
                continue
            table = Path(f"/proc/{pid}/net/unix").read_text()
        except OSError:  # it has just ended
            continue
        seen.add(namespace)
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/"):
                paths.add(fields[7])
    return paths


def project_segments() -> list[str]:
    """Segments of the project in /dev/shm that should not be there: all of
    them, except a live tokenizer's slab with no slice taken (its owner
    holds a flock on it, and nobody holds a byte-range lock), and a live
    tokenizer's grant table with no grant left (every entry cleared: a
    grant its request did not end is a leak too)."""
    # The test processes' own prefixes start with it too (tests/shared).
    names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PROJECT_PREFIX))
    if any("-slab" in n or "-grant" in n for n in names):
        locks = _locks()
        names = [
            n
            for n in names
            if not ("-slab" in n and _idle_owned(n, locks))
            and not ("-grant" in n and _idle_owned(n, locks) and not live_grants(n))
        ]
    return names


def live_grants(name: str) -> int:
    """Entries of grant table `name` that are granted now (0 when it is gone)."""
    try:
        data = (SHM_DIR / name).read_bytes()
    except FileNotFoundError:
        return 0
    entry, tag = grants.ENTRY, grants.TAG_BYTES
    return sum(1 for at in range(0, len(data), entry) if any(data[at : at + tag]))


def holders(name: str) -> list[str]:
    """Who holds what of segment `name` now: for every process of ours with
    a descriptor on it, its pid, name, descriptor and the locks taken
    through it (from /proc/<pid>/fdinfo), for a failure to say who kept a
    slice."""
    target = str(SHM_DIR / name)
    found = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != target:
                    continue
                locks = [
                    line.split(":", 1)[1].strip()
                    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                    if line.startswith("lock:")
                ]
            except OSError:
                continue
            found.append(f"pid {pid} ({comm}) fd {fd}: {'; '.join(locks) or 'no lock'}")
    return found


def slabs() -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PROJECT_PREFIX) and "-slab" in n)


def slab_locks(name: str) -> dict[str, int]:
    """Locks held on a slab now: {"FLOCK": n, "OFDLCK": n} (from /proc/locks)."""
    counts = {"FLOCK": 0, "OFDLCK": 0}
    try:
        ino = os.stat(SHM_DIR / name).st_ino
    except FileNotFoundError:
        return counts
    for kind, inode in _locks():
        if inode == ino and kind in counts:
            counts[kind] += 1
    return counts


def _idle_owned(name: str, locks: list[tuple[str, int]]) -> bool:
    try:
        ino = os.stat(SHM_DIR / name).st_ino
    except FileNotFoundError:
        return True
    kinds = [kind for kind, inode in locks if inode == ino]
    return "FLOCK" in kinds and "OFDLCK" not in kinds


def _locks() -> list[tuple[str, int]]:
    """(kind, inode) of every lock in /proc/locks (blocked waiters, "->", skipped)."""
    out = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->":
            out.append((fields[1], int(fields[5].rsplit(":", 1)[1])))
    return out


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll `predicate` until it holds or `timeout` passes; return whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


@contextlib.contextmanager
def own_slab(prefix: str, nbytes: int) -> Iterator[ranges.Slab]:
    """A slab of this test process's, removed after; fails the test if any
    segment of `prefix` is left."""
    s = ranges.Slab(prefix, os.getpid(), nbytes)
    yield s
    s.close()
    assert not files.list_segments(prefix)
