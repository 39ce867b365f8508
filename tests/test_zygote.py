"""The tests' zygote (tests/support/zygote.py) behaves as `subprocess.Popen`
of `python -m mmsplit_cli` would, for what `ServiceProcess` uses of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import limits, wrapped
from tests.support.leaks import wait_until
from tests.support.services import ENV, ROOT, SERVICE_TMP
from tests.support.zygote import Zygote


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"), ENV)
    yield z
    z.close()
    assert z.proc.returncode == 0


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def lone_tokenizer(model: Path) -> list[str]:
    """A tokenizer whose scheduler never answers: it runs until stopped."""
    return ["tokenizer", "--model", str(model), "--scheduler", "127.0.0.1:9", "--port", "0", "--http-port", "0"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENV, **extra}


def test_exit_code_and_standard_error_are_the_interpreter_s(zygote: Zygote) -> None:
    proc = zygote.start(["no-such-command"], _env())
    assert proc.wait(60) == 2
    said = proc.stderr.read()
    proc.stderr.close()
    fresh = subprocess.run(
        [sys.executable, "-m", "mmsplit_cli", "no-such-command"],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    assert fresh.returncode == 2
    assert said == fresh.stderr


def test_a_signalled_service_reports_the_signal_and_wait_times_out_first(zygote: Zygote, tiny_model: Path) -> None:
    args = lone_tokenizer(tiny_model)
    proc = zygote.start(args, _env(TMPDIR=str(SERVICE_TMP)))
    assert proc.stderr.readline(), "the service wrote nothing"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL
    proc.stderr.close()
    proc.kill()  # after the exit: nothing, and never another process


def test_the_tests_wrappers_read_as_steps_and_any_other_is_left_to_run() -> None:
    python_m = [sys.executable, "-m"]
    pod = ["ip", "netns", "exec", "mms-pod", *python_m, "tests.support.mountns", "64m"]
    assert wrapped.steps(pod) == [["netns", "mms-pod"], ["mountns", "64m"]]
    assert wrapped.steps([*limits.started_low(), *python_m, "tests.support.pidns"]) == [
        ["nofile", limits.started_low()[1].removeprefix("--nofile=")],
        ["pidns"],
    ]
    assert wrapped.steps([]) == []
    for other in (["strace", "-f"], ["ip", "netns", "exec"], [*python_m, "tests.support.other"], ["prlimit", "-n1"]):
        assert wrapped.steps(other) is None, other


def test_a_service_forked_under_wrappers_has_their_namespaces_and_limit(zygote: Zygote, tiny_model: Path) -> None:
    """pidns + the low open-file limit + a /dev/shm of its own, as steps in
    the fork: the zygote's child stays behind as the pid namespace's
    launcher, the service is PID 1 there and raised its limit itself."""
    python_m = [sys.executable, "-m"]
    steps = wrapped.steps(
        [*python_m, "tests.support.pidns", *limits.started_low(), *python_m, "tests.support.mountns", "64m"]
    )
    assert steps is not None
    args = lone_tokenizer(tiny_model)
    proc = zygote.start(args, _env(TMPDIR=str(SERVICE_TMP)), steps=steps)
    launcher = psutil.Process(proc.pid)
    try:
        # Listening: its SIGTERM handler is in place (PID 1 ignores the signal before).
        assert any("listening on" in line for line in proc.stderr), "the service ended before listening"
        (service,) = launcher.children()
        assert os.readlink(f"/proc/{service.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert Path(f"/proc/{service.pid}/root/dev/shm").stat().st_dev != Path("/dev/shm").stat().st_dev
        assert service.rlimit(psutil.RLIMIT_NOFILE) == (limits.RAISED, limits.HARD)
        proc.terminate()  # forwarded by the launcher: the service stops itself
        assert proc.wait(60) == 0
        assert not service.is_running()
    finally:
        left = launcher.children() if launcher.is_running() else []
        proc.kill()  # the service goes with its launcher (pidns: PR_SET_PDEATHSIG)
        proc.wait(60)
        proc.stderr.close()
        assert wait_until(lambda: not [p for p in left if alive(p)], timeout=30), "the service outlived its launcher"


def test_a_service_forked_for_a_process_in_a_mount_namespace_joins_it(
    zygote: Zygote, tiny_model: Path, tmp_path: Path
) -> None:
    """What a benchmark with a /dev/shm of its own (bench/chaos.py
    --shm-size) gets from the suite's zygote: services in its namespace,
    in its working directory."""
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mountns", "16m", "sleep", "600"], env=_env(), cwd=ROOT
    )
    try:
        wait_until(lambda: os.readlink(f"/proc/{holder.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"), timeout=30)
        args = lone_tokenizer(tiny_model)
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            proc = zygote.start(args, _env(TMPDIR=str(SERVICE_TMP)), steps=[["mounts_of", str(holder.pid)]])
        finally:
            os.chdir(cwd)
        try:
            assert any("listening on" in line for line in proc.stderr), "the service ended before listening"
            assert os.readlink(f"/proc/{proc.pid}/ns/mnt") == os.readlink(f"/proc/{holder.pid}/ns/mnt")
            assert Path(f"/proc/{proc.pid}/root/dev/shm").stat().st_dev != Path("/dev/shm").stat().st_dev
            assert Path(os.readlink(f"/proc/{proc.pid}/cwd")) == tmp_path
        finally:
            proc.kill()
            proc.wait(60)
            proc.stderr.close()
    finally:
        holder.kill()
        holder.wait()


SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "name", __name__, "cwd", os.getcwd(), "first", sys.path[0], "env", os.environ["MARK"])
print("to standard error", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_runs_as_the_interpreter_would_run_it_and_a_timeout_kills_it(zygote: Zygote, tmp_path: Path) -> None:
    """What `tests.support.bench.run_bench` uses: the script as __main__,
    its arguments, its directory first on the path, the project's root as
    the working directory, its outputs and exit status as
    `subprocess.run(capture_output=True)` gives them; at the timeout it is
    killed and the timeout raised."""
    from tests.support.bench import completed
    from tests.support.zygote import ForkedProcess

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = completed(
        ForkedProcess(zygote.address, ["3"], _env(MARK="m1"), script=str(script), cwd=str(ROOT)), ["x"], 60
    )
    fresh = subprocess.run(
        [sys.executable, str(script), "3"], capture_output=True, text=True, env=_env(MARK="m1"), cwd=ROOT, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, fresh.stdout, fresh.stderr)
    assert f"name __main__ cwd {ROOT} first {tmp_path} env m1" in done.stdout
    sleeper = ForkedProcess(zygote.address, ["sleep"], _env(MARK="m2"), script=str(script), cwd=str(ROOT))
    process = psutil.Process(sleeper.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        completed(sleeper, ["x"], 1)
    assert sleeper.returncode == -signal.SIGKILL
    assert wait_until(lambda: not alive(process), timeout=10)
