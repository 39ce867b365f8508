"""The CPU pool's forkserver (`tokenizer_svc.forkserver`): it leaves without
the interpreter's teardown of torch and transformers (~1.2 s of CPU here),
and no other process is made to."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from tests.support.leaks import wait_until
from tokenizer_svc import forkserver

ROOT = Path(__file__).resolve().parents[2]

# A tokenizer's part in this: start the forkserver, fork a worker from it,
# then exit. Prints what the worker and this process say, and the
# forkserver's pid.
SCRIPT = textwrap.dedent(
    """
    import multiprocessing.forkserver
    from tests.support import forkserver_probe
    from tokenizer_svc import forkserver

    forkserver.start()
    ctx = forkserver.context()
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=forkserver_probe.report, args=(theirs,))
    worker.start()
    said = ours.recv()
    worker.join()
    print(said, forkserver.LEAVES_AT_ONCE, multiprocessing.forkserver._forkserver._forkserver_pid)
    """
)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_only_the_forkserver_leaves_without_teardown_and_it_does_leave() -> None:
    assert not forkserver.LEAVES_AT_ONCE, "a process that imports the module must exit as usual"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    in_worker, in_parent, server = done.stdout.split()
    assert in_worker == "True", "the forkserver did not take its exit hook"
    assert in_parent == "False", "the tokenizer's own process took the forkserver's exit hook"
    assert wait_until(lambda: gone(int(server)), timeout=10), "the forkserver outlived its tokenizer"
