"""What a test may not leave behind: project segments in /dev/shm, child processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")


def _prefix() -> str:
    """The segment prefix of this test process and every service it starts
    (through the environment: MMSPLIT_SHM_PREFIX is both services' fallback).
    Each pytest-xdist worker has its own, so one worker's leak checks and
    janitors never see another's segments."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    prefix = "mmsplit" + "".join(c for c in worker if c.isalnum())
    os.environ["MMSPLIT_SHM_PREFIX"] = prefix
    return prefix


PROJECT_PREFIX = _prefix()


def project_segments() -> list[str]:
    # The test processes' own prefixes start with it too (tests/shared).
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PROJECT_PREFIX))


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
