"""Service pairs for tests: `mmsplit_cli.launch` with the repository on
PYTHONPATH, so the services can import the test hooks in `tests.support`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mmsplit_cli.launch import (
    SCHEDULER_SERVICE,
    TOKENIZER_SERVICE,
    Pair,
    ServiceProcess,
    scheduler_args,
    tokenizer_args,
)
from mmsplit_cli.launch import (
    running_pair as _running_pair,
)
from tests.support.leaks import SERVICE_TMP

__all__ = ["ROOT", "SCHEDULER_SERVICE", "TOKENIZER_SERVICE", "Pair", "running_pair"]

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "TMPDIR": str(SERVICE_TMP)}


def start_scheduler(model: Path, log: Path, *, tp: int = 2, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("scheduler", scheduler_args(model, tp=tp, extra=extra), log, env=ENV)


def start_tokenizer(model: Path, scheduler: str, log: Path, *, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("tokenizer", tokenizer_args(model, scheduler, extra=extra), log, env=ENV)


@contextmanager
def running_pair(
    model: Path,
    logs: Path,
    *,
    scheduler_extra: Sequence[str] = (),
    tokenizer_extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> Iterator[Pair]:
    environment = {**ENV, **(env or {})}
    with _running_pair(
        model, logs, scheduler_extra=scheduler_extra, tokenizer_extra=tokenizer_extra, env=environment, wrapper=wrapper
    ) as pair:
        yield pair


def stop_all(processes: Sequence[ServiceProcess]) -> None:
    """SIGTERM each (the last started first), then wait for each to end."""
    for proc in reversed(processes):
        proc.terminate()
    for proc in reversed(processes):
        proc.stop()
