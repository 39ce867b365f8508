"""A scheduler on loopback with default settings admits only its own user
(`mmsplit.localauth`): its local token lives in a directory only that user
may enter, the tokenizer (and `mmsplit info`) of the same user find it, and a
process of another uid is refused UNAUTHENTICATED (health aside)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mmsplit import localauth
from mmsplit_cli.launch import SCHEDULER_SERVICE
from tests.conftest import Services
from tests.e2e.helpers import health_status, scheduler_info
from tests.support.leaks import RUNTIME_DIR, wait_until
from tests.support.services import ROOT, start_scheduler

pytestmark = pytest.mark.e2e
NOBODY = 65534


def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    """`command` run as uid and gid 65534, with an environment of its own
    (its runtime directory is its own: /tmp/mmsplit-65534)."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/tmp"}
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_another_user_cannot_call_a_loopback_scheduler(services: Services) -> None:
    port = int(services.scheduler_address.rsplit(":", 1)[1])
    token = localauth.token_path(RUNTIME_DIR, port)
    assert stat.S_IMODE(os.stat(RUNTIME_DIR).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    # Its user's clients find the token: the tokenizer serves, the helpers read.
    assert scheduler_info(services.scheduler_address).tp_size == 2
    assert health_status(services.tokenizer_address, "") == "SERVING"
    assert as_nobody("cat", str(token)).returncode != 0, "another user read the token"
    called = as_nobody(sys.executable, "-m", "tests.support.call_scheduler", services.scheduler_address, "--local")
    assert called.returncode == 0, called.stderr[-2000:]
    got = json.loads(called.stdout.strip().splitlines()[-1])
    assert got == {
        "info": "UNAUTHENTICATED",
        "generate": "UNAUTHENTICATED",
        "health": "SERVING",
        "reason": got["reason"],
    }
    assert got["reason"] == "UNAUTHENTICATED"
    # Its own user's call with the token works (what the tokenizer does).
    mine = subprocess.run(
        [sys.executable, "-m", "tests.support.call_scheduler", services.scheduler_address, "--local"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert json.loads(mine.stdout.strip().splitlines()[-1])["generate"] == "OK", mine.stderr[-2000:]


def test_the_token_goes_with_its_scheduler_and_a_shared_directory_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    sched = start_scheduler(tiny_model, tmp_path / "scheduler.log", tp=1, extra=["--runtime-dir", str(runtime)])
    try:
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        token = localauth.token_path(runtime, sched.port)
        assert token.exists()
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    finally:
        assert sched.stop() == 0
    assert wait_until(lambda: not token.exists(), timeout=10), "the token outlived its scheduler"

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    refused = start_scheduler(tiny_model, tmp_path / "refused.log", tp=1, extra=["--runtime-dir", str(shared)])
    code = refused.proc.wait(timeout=120)
    lines = [line for line in (tmp_path / "refused.log").read_text().splitlines() if line.strip()]
    assert code != 0
    assert any("--runtime-dir" in line and "mode 755" in line for line in lines), lines[-5:]
    assert not any("Traceback" in line for line in lines), lines[-20:]


def test_a_tokenizer_without_the_token_says_why_it_gets_no_scheduler(tiny_model: Path, tmp_path: Path) -> None:
    """A tokenizer looking for the local token in another runtime directory
    than its scheduler's (another user, another container) is refused: it
    says so once, naming what to do, and stays NOT_SERVING."""
    from mmsplit_cli.launch import TOKENIZER_SERVICE
    from tests.support.services import start_tokenizer

    sched = start_scheduler(tiny_model, tmp_path / "scheduler.log", tp=1, extra=["--runtime-dir", str(tmp_path / "a")])
    tok = None
    try:
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        elsewhere = tmp_path / "b"
        elsewhere.mkdir(mode=0o700)
        tok = start_tokenizer(
            tiny_model, sched.address, tmp_path / "tokenizer.log", extra=["--runtime-dir", str(elsewhere)]
        )
        tok.wait_logged("refuses this tokenizer's credentials", 180)
        assert health_status(tok.address, TOKENIZER_SERVICE) == "NOT_SERVING"
        assert (tmp_path / "tokenizer.log").read_text().count("refuses this tokenizer's credentials") == 1
    finally:
        if tok is not None:
            assert tok.stop() == 0
        assert sched.stop() == 0
