"""Running a benchmark script of `bench/` as people do (a subprocess from
the project's root, with the tests' environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from tests.support.services import ENV, ROOT


def run_bench(script: str, args: Sequence[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`python bench/<script> ARGS`: its exit status and what it printed."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV},
        cwd=ROOT,
    )
