"""The tests' zygote (tests/support/zygote.py) behaves as `subprocess.Popen`
of `python -m mmsplit_cli` would, for what `ServiceProcess` uses of it."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import ENV, SERVICE_TMP
from tests.support.zygote import Zygote


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"), ENV)
    yield z
    z.close()
    assert z.proc.returncode == 0


def _env(**extra: str) -> dict[str, str]:
    import os

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
    # A tokenizer whose scheduler never answers: it runs until stopped.
    args = ["tokenizer", "--model", str(tiny_model), "--scheduler", "127.0.0.1:9", "--port", "0", "--http-port", "0"]
    proc = zygote.start(args, _env(TMPDIR=str(SERVICE_TMP)))
    assert proc.stderr.readline(), "the service wrote nothing"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL
    proc.stderr.close()
    proc.kill()  # after the exit: nothing, and never another process
