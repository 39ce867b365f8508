"""Fixtures shared by every test.

- `no_leaks` (autouse) fails any test that leaves a project segment in
  /dev/shm or a child process alive (segments released asynchronously get a
  bounded grace period; what remains is removed and the test fails).
- `tiny_model`: one tiny random-weight LLaVA per session.
- `services`: one scheduler (2 ranks, fault-injecting tensor reader) and one
  tokenizer per session, real processes on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support.leaks import children, project_segments, wait_until

ROOT = Path(__file__).resolve().parent.parent
SCHEDULER_SERVICE = "mmsplit.scheduler.v1.SchedulerService"
TOKENIZER_SERVICE = "mmsplit.tokenizer.v1.TokenizerService"


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = children()
    yield
    problems = []
    if not wait_until(lambda: not project_segments(), timeout=10):
        left = project_segments()
        for name in left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        problems.append(f"shared-memory segments left behind: {left}")
    if not wait_until(lambda: not (children() - before), timeout=10):
        stray = children() - before
        for pid in stray:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        problems.append(f"child processes left alive: {sorted(stray)}")
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmsplit_cli.tiny_model import build

    return build(tmp_path_factory.mktemp("model") / "tiny-llava", cache_dir=ROOT / ".cache")


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmsplit_cli import samples

    d = tmp_path_factory.mktemp("media")
    (d / "cat.jpg").write_bytes(samples.good_jpeg(seed=3))
    return d


@dataclass
class Services:
    scheduler: object  # mmsplit_cli.launch.ServiceProcess
    tokenizer: object
    model: Path

    @property
    def tokenizer_address(self) -> str:
        return self.tokenizer.address  # type: ignore[attr-defined]

    @property
    def scheduler_address(self) -> str:
        return self.scheduler.address  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def services(tiny_model: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args

    logs = tmp_path_factory.mktemp("logs")
    env = {"PYTHONPATH": str(ROOT)}
    sched = ServiceProcess(
        "scheduler",
        scheduler_args(
            tiny_model,
            tp=2,
            extra=["--tensor-reader", "tests.support.faults:make_reader", "--batch-window-s", "0.1"],
        ),
        logs / "scheduler.log",
        env=env,
    )
    tok = None
    try:
        sched.wait_bound(180)
        tok = ServiceProcess(
            "tokenizer",
            tokenizer_args(tiny_model, sched.address, extra=["--allowed-media-dir", str(media_dir)]),
            logs / "tokenizer.log",
            env=env,
        )
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        yield Services(sched, tok, tiny_model)
    finally:
        codes = {p.name: p.stop() for p in (tok, sched) if p is not None}
    assert codes == {"tokenizer": 0, "scheduler": 0}, f"services exited with {codes}"
