"""12 s of `bench/chaos.py` as people run it, but for its services being
forks of the suite's zygote (tests/support/bench.py) (many faults at once under
mixed load: CPU workers, the forkserver, rank 1 of a group and whole groups
SIGKILLed and restarted, ranks frozen, the run's own /dev/shm filled to
its limit; the caches off): nothing lost, no untyped error, every failure
typed and retriable or the request's own bad input, nothing left in
/dev/shm or in the slab, every service's descriptors and resident memory
back where they were (the bench's exit status says all of it)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.bench import run_bench
from tests.support.leaks import PROJECT_PREFIX

pytestmark = pytest.mark.e2e


def test_twelve_seconds_of_chaos_lose_nothing(family_models: Callable[[str], Path], tmp_path: Path) -> None:
    """The tiny Qwen2-VL (images and videos), as the bench runs by default,
    in a mount namespace with a 512 MiB /dev/shm of its own."""
    (tmp_path / "model-qwen2-vl").symlink_to(family_models("qwen2-vl"))
    args = ["--minutes", "0.2", "--concurrency", "6", "--seed", "7", "--fault-every-s", "1.5"]
    args += ["--prefix", f"{PROJECT_PREFIX}ch", "--shm-size", "512m", "--caches", "off", "--workdir", str(tmp_path)]
    result = run_bench("chaos.py", args, timeout=300)
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert "a /dev/shm of its own (512 MiB)" in result.stdout, report
    ok = re.search(r"^ok\s+(\d+)$", result.stdout, re.M)
    assert ok is not None, report
    assert int(ok[1]) > 20, report
    kinds = re.search(r"^by kind: (\{.*?\})$", result.stdout, re.M)
    assert kinds is not None, report
    served = ast.literal_eval(kinds[1])
    assert all(served.get(kind, 0) > 0 for kind in ("scored", "echo", "conversation", "http", "image")), served
    faults = re.search(r"^faults: (\{.*?\}); retries", result.stdout, re.M)
    assert faults is not None, report
    hit = {k: v for k, v in ast.literal_eval(faults[1]).items() if k != "restarts" and "none to hit" not in k}
    assert sum(hit.values()) >= 5, report
