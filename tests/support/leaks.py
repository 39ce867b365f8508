"""What a test may not leave behind: project segments in /dev/shm, child processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
PROJECT_PREFIX = "mmsplit"


def project_segments() -> list[str]:
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
