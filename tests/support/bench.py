"""Running a benchmark script of `bench/` as people do (a subprocess from
the project's root, with the tests' environment), except that the services
it starts are forks of the suite's zygote, not new interpreters (their
imports were most of these tests' CPU: `bench/harness.py` installs the
launcher when the environment names the zygote)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support.services import ENV, ROOT, zygote_for_subprocesses


def run_bench(
    script: str, args: Sequence[str], timeout: float = 240, models: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python bench/<script> ARGS`: its exit status and what it printed.
    `models`: a directory where the benchmarks keep the models they build
    and reuse them (bench/harness.py, MMSPLIT_BENCH_MODELS)."""
    kept = {"MMSPLIT_BENCH_MODELS": str(models)} if models is not None else {}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV, **kept, **zygote_for_subprocesses()},
        cwd=ROOT,
    )
