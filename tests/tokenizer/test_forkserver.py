"""The CPU pool's forkserver (`tokenizer_svc.forkserver`): it leaves without
the interpreter's teardown of torch and transformers (~1.2 s of CPU here),
and no other process is made to; the tokenizer's fork of itself serves
workers as a forkserver started anew does, with none of the tokenizer's
descriptors, and leaves with it; and neither way leaves a file behind in
the temporary directory, however the tokenizer ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.support.leaks import CACHES, service_temp_leftovers, wait_until
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
    said = forkserver_probe.ask_a_worker()
    print(said, forkserver.LEAVES_AT_ONCE, multiprocessing.forkserver._forkserver._forkserver_pid)
    """
)


# The tokenizer's way (`mmsplit_cli.main`): its imports done, no thread
# started, the forkserver is a fork of it. Prints as SCRIPT does, then the
# forkserver's name, whether it holds the file this process had open when
# it forked, and whether it is this process's child; then waits to be told
# to exit.
FORKED = textwrap.dedent(
    """
    import multiprocessing.forkserver, os, sys
    import psutil
    from tests.support import forkserver_probe
    from tokenizer_svc import forkserver

    held = open(sys.executable, "rb")
    forkserver.start_forked()
    said = forkserver_probe.ask_a_worker()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    server = psutil.Process(pid)
    holds = any(f.path == sys.executable for f in server.open_files())
    print(said, forkserver.LEAVES_AT_ONCE, pid, server.name(), holds, server.ppid() == os.getpid(), flush=True)
    sys.stdin.readline()
    """
)


# The same when this process cannot fork (os.fork raising, as it does when
# out of memory or processes): a forkserver started as a new process serves
# the worker instead. Prints the worker's answer and the server's command.
UNFORKABLE = textwrap.dedent(
    """
    import errno, multiprocessing.forkserver, os
    import psutil
    from tests.support import forkserver_probe
    from tokenizer_svc import forkserver

    def no_fork():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    real_fork, os.fork = os.fork, no_fork
    forkserver.start_forked()
    os.fork = real_fork
    said = forkserver_probe.ask_a_worker()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    print(said, " ".join(psutil.Process(pid).cmdline()))
    """
)


# The exec'd forkserver listens in multiprocessing's temporary directory
# (pymp-*), which the tokenizer's `exit_now` removes as multiprocessing's
# exit hook would; a fork of the tokenizer that calls it (a rank, say) does
# not remove it. Prints whether the directory was there after the fork's
# exit, then exits as the services do.
EXITS_NOW = textwrap.dedent(
    """
    import multiprocessing.util, os
    from mmsplit_server.serving import exit_now
    from tests.support import forkserver_probe
    from tokenizer_svc import forkserver

    forkserver.start()
    forkserver_probe.ask_a_worker()
    where = multiprocessing.util.get_temp_dir()
    pid = os.fork()
    if pid == 0:
        exit_now(0)
    os.waitpid(pid, 0)
    print(os.path.isdir(where), flush=True)
    exit_now(0)
    """
)


def light(script: str) -> str:
    """`script` with a forkserver that preloads numpy and its own module
    only: what these tests check (the exit hook, the fallback, the
    directories) does not depend on what the forkserver imports, and
    transformers and torch cost ~5-8 s of CPU per interpreter here. The
    real preload is kept by the tokenizer's way, exiting (a thread that
    an import started would show there as a forkserver started anew)."""
    marker = "from tokenizer_svc import forkserver\n"
    assert marker in script
    return script.replace(marker, marker + "forkserver.PRELOAD[:] = ['numpy', 'tokenizer_svc.forkserver']\n")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_only_the_forkserver_leaves_without_teardown_and_it_does_leave() -> None:
    assert not forkserver.LEAVES_AT_ONCE, "a process that imports the module must exit as usual"
    done = subprocess.run(
        [sys.executable, "-c", light(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    in_worker, in_parent, server = done.stdout.split()
    assert in_worker == "True", "the forkserver did not take its exit hook"
    assert in_parent == "False", "the tokenizer's own process took the forkserver's exit hook"
    assert wait_until(lambda: gone(int(server)), timeout=10), "the forkserver outlived its tokenizer"


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_the_tokenizer_s_fork_of_itself_serves_workers_and_leaves_with_it(end: str, tmp_path: Path) -> None:
    """Whether the tokenizer exits or is killed, its forkserver leaves, and
    takes its socket's directory with it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with subprocess.Popen(
        [sys.executable, "-c", FORKED if end == "exits" else light(FORKED)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as script:
        assert script.stdout is not None
        assert script.stdin is not None
        try:
            line = script.stdout.readline()
            in_worker, in_parent, server, name, holds, child = line.split()
            assert in_worker == "True", "a worker of the forked forkserver does not know it"
            assert in_parent == "False", "the tokenizer's own process took the forkserver's exit hook"
            assert name == forkserver.NAME.decode(), "not the fork: a forkserver started anew"
            assert child == "True"
            assert holds == "False", "the forkserver kept a descriptor of the tokenizer's"
            assert not gone(int(server))
            (socket_dir,) = [e for e in os.listdir(tmp_path) if not e.startswith(CACHES)]
            assert socket_dir.startswith(forkserver.SOCKET_DIR_PREFIX)
            if end == "killed":
                script.send_signal(signal.SIGKILL)
                assert script.wait(60) == -signal.SIGKILL
            else:
                script.stdin.write("\n")
                script.stdin.flush()
                assert script.wait(60) == 0
        finally:
            if script.poll() is None:
                script.kill()
    assert wait_until(lambda: gone(int(server)), timeout=10), "the forkserver outlived its tokenizer"
    assert wait_until(lambda: not service_temp_leftovers(tmp_path), timeout=10), os.listdir(tmp_path)


def test_a_service_that_exits_now_leaves_no_multiprocessing_directory(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", light(EXITS_NOW)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], "a fork's exit removed its parent's directory"
    assert wait_until(lambda: not service_temp_leftovers(tmp_path), timeout=10), os.listdir(tmp_path)


def test_a_tokenizer_that_cannot_fork_starts_its_forkserver_as_a_new_process() -> None:
    done = subprocess.run(
        [sys.executable, "-c", light(UNFORKABLE)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    in_worker, command = done.stdout.split(" ", 1)
    assert in_worker == "True"
    assert "multiprocessing.forkserver import main" in command
    assert "could not fork the CPU pool's forkserver" in done.stderr
