"""Running a benchmark script of `bench/` as people do (`python bench/X.py`
from the project's root, with the tests' environment), except that the
script and the services it starts are forks of the suite's zygote, not new
interpreters: their imports were most of these tests' CPU. The script runs
as `__main__` (`runpy`), as the interpreter runs it; `bench/harness.py`
installs the services' launcher when the environment names the zygote.
What the forks inherit that a new interpreter would not: the imports
themselves, and OpenMP's spin count as `mmsplit` sets it (libgomp reads it
once, when the zygote imported torch). Without a zygote
(MMSPLIT_TEST_ZYGOTE=0) the script is a new interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from tests.support.services import ENV, ROOT, forked_script, zygote_for_subprocesses
from tests.support.zygote import ForkedProcess


def run_bench(
    script: str, args: Sequence[str], timeout: float = 240, models: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python bench/<script> ARGS`: its exit status and what it printed.
    `models`: a directory where the benchmarks keep the models they build
    and reuse them (bench/harness.py, MMSPLIT_BENCH_MODELS)."""
    kept = {"MMSPLIT_BENCH_MODELS": str(models)} if models is not None else {}
    env = {**os.environ, **ENV, **kept, **zygote_for_subprocesses()}
    path = ROOT / "bench" / script
    forked = forked_script(path, args, env)
    if forked is None:
        return subprocess.run(
            [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    return completed(forked, [sys.executable, str(path), *args], timeout)


def completed(
    proc: ForkedProcess | subprocess.Popen[str], argv: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """What `subprocess.run(capture_output=True, timeout=...)` gives: both
    outputs read to their ends meanwhile, the script killed at the timeout."""
    assert proc.stdout is not None
    read: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda name=name, f=f: read.setdefault(name, f.read()), daemon=True)
        for name, f in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for reader in readers:
            reader.join(30)
        proc.stdout.close()
        proc.stderr.close()
    return subprocess.CompletedProcess(argv, code, read.get("stdout", ""), read.get("stderr", ""))
