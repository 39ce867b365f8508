"""Starting a scheduler + tokenizer pair for a test, and ending it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args
from scheduler_svc.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_SERVICE = "mmsplit.scheduler.v1.SchedulerService"
TOKENIZER_SERVICE = "mmsplit.tokenizer.v1.TokenizerService"
ENV = {"PYTHONPATH": str(ROOT)}


@dataclass
class Pair:
    scheduler: ServiceProcess
    tokenizer: ServiceProcess
    model: Path

    @property
    def tokenizer_address(self) -> str:
        return self.tokenizer.address

    @property
    def scheduler_address(self) -> str:
        return self.scheduler.address


def start_scheduler(model: Path, log: Path, *, tp: int = 2, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("scheduler", scheduler_args(model, tp=tp, extra=extra), log, env=ENV)


def start_tokenizer(model: Path, scheduler: str, log: Path, *, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("tokenizer", tokenizer_args(model, scheduler, extra=extra), log, env=ENV)


@contextmanager
def running_pair(
    model: Path, logs: Path, *, scheduler_extra: Sequence[str] = (), tokenizer_extra: Sequence[str] = ()
) -> Iterator[Pair]:
    """A serving pair; on exit both are stopped (SIGTERM, then SIGKILL) if
    the test has not stopped them itself, including any the test put in
    their place on the pair."""
    started: list[ServiceProcess] = []
    pair: Pair | None = None
    try:
        # Both start at once: the tokenizer waits for the scheduler by itself.
        port = free_port()
        sched = start_scheduler(model, logs / "scheduler.log", extra=["--port", str(port), *scheduler_extra])
        started.append(sched)
        tok = start_tokenizer(model, f"127.0.0.1:{port}", logs / "tokenizer.log", extra=tokenizer_extra)
        started.append(tok)
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        pair = Pair(sched, tok, model)
        yield pair
    finally:
        current = [pair.tokenizer, pair.scheduler] if pair is not None else []
        for proc in [*current, *reversed(started)]:
            proc.stop()
