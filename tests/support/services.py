"""Service pairs for tests: `mmsplit_cli.launch` with the repository on
PYTHONPATH, so the services can import the test hooks in `tests.support`.

Services are forked by a preloaded zygote (`tests/support/zygote.py`,
started on first use, one per test process), under a wrapper too where it
is one of those `tests/support/wrapped.py` knows (namespaces, the open-file
limit): `installed_launcher` sets it up for the session. Within
`new_interpreters()` a test starts its services as new interpreters, for
what depends on the real start-up (its imports' timing); so does every
test with MMSPLIT_TEST_ZYGOTE=0 (slower; what production does).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mmsplit_cli.launch import (
    SCHEDULER_SERVICE,
    TOKENIZER_SERVICE,
    Arg,
    FreePort,
    Pair,
    ServiceProcess,
    scheduler_args,
    set_launcher,
    started,
    tokenizer_args,
)
from mmsplit_cli.launch import (
    running_pair as _running_pair,
)
from tests.support.leaks import SERVICE_TMP
from tests.support.zygote import ZYGOTE_AT, ForkedProcess, Zygote, fork_under

__all__ = ["ROOT", "SCHEDULER_SERVICE", "TOKENIZER_SERVICE", "Arg", "FreePort", "Pair", "running_pair"]

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "TMPDIR": str(SERVICE_TMP)}


class LazyZygote:
    """The launcher the suite installs: a zygote started on the first
    service start (a test process that starts none pays nothing)."""

    def __init__(self) -> None:
        self._zygote: Zygote | None = None
        self._workdir: str | None = None
        self.fresh = False  # `new_interpreters`

    def __call__(
        self, argv: Sequence[str], env: dict[str, str], new_session: bool, wrapper: Sequence[str]
    ) -> ForkedProcess | None:
        if self.fresh:
            return None  # a new interpreter, under the wrapper
        return fork_under(self.address, argv, env, new_session, wrapper)

    def address(self) -> str:
        """Its socket (started now if it was not)."""
        if self._zygote is None:
            self._workdir = tempfile.mkdtemp(prefix="mmsplit-zygote-")
            self._zygote = Zygote(Path(self._workdir), ENV)
        return self._zygote.address

    @property
    def pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None else None

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


_zygote = LazyZygote()


def zygote_pid() -> int | None:
    """The zygote's pid, once started (it and only it may outlive a test)."""
    return _zygote.pid


@contextmanager
def new_interpreters() -> Iterator[None]:
    """Services started within are new interpreters, not zygote forks."""
    _zygote.fresh = True
    try:
        yield
    finally:
        _zygote.fresh = False


def forked_script(
    script: Path, args: Sequence[str], env: dict[str, str], *, new_session: bool = False
) -> ForkedProcess | None:
    """`python SCRIPT ARGS` from the project's root, forked by this
    session's zygote (its imports spared), its standard output and error
    piped back (`new_session`: as Popen's `start_new_session`); None where
    the suite has no zygote (run it yourself)."""
    if not _zygote_wanted():
        return None
    return ForkedProcess(_zygote.address(), list(args), env, new_session, script=str(script), cwd=str(ROOT))


def zygote_for_subprocesses() -> dict[str, str]:
    """The environment that lets a process the test starts (a benchmark
    script) fork its services from this session's zygote too
    (`tests.support.zygote.fork_from_the_suite_s_zygote`), or {} where
    the suite has none."""
    return {ZYGOTE_AT: _zygote.address()} if _zygote_wanted() else {}


def _zygote_wanted() -> bool:
    return os.environ.get("MMSPLIT_TEST_ZYGOTE", "1") != "0"


@contextmanager
def installed_launcher() -> Iterator[None]:
    """For the session: services come from the zygote."""
    if not _zygote_wanted():
        yield
        return
    previous = set_launcher(_zygote)
    try:
        yield
    finally:
        set_launcher(previous)
        _zygote.close()


def start_scheduler(model: Path, log: Path, *, tp: int = 2, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("scheduler", scheduler_args(model, tp=tp, extra=extra), log, env=ENV)


def start_tokenizer(model: Path, scheduler: str, log: Path, *, extra: Sequence[str] = ()) -> ServiceProcess:
    return ServiceProcess("tokenizer", tokenizer_args(model, scheduler, extra=extra), log, env=ENV)


def started_tokenizer(
    model: Path,
    scheduler: str,
    log: Path,
    *,
    extra: Sequence[Arg] = (),
    ready: Callable[[ServiceProcess], object] | None = None,
) -> ServiceProcess:
    """A tokenizer (`start_tokenizer`) once `ready(it)` returns (by default
    once it is SERVING); a `FreePort` in `extra` is drawn again if it was
    taken before it was bound (`launch.started`). The caller stops it."""

    def serving(tok: ServiceProcess) -> None:
        tok.wait_serving(TOKENIZER_SERVICE, 180)

    return started("tokenizer", [*tokenizer_args(model, scheduler), *extra], log, ready or serving, env=ENV)


@contextmanager
def running_pair(
    model: Path,
    logs: Path,
    *,
    tp: int = 2,
    scheduler_extra: Sequence[Arg] = (),
    tokenizer_extra: Sequence[Arg] = (),
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> Iterator[Pair]:
    environment = {**ENV, **(env or {})}
    with _running_pair(
        model,
        logs,
        tp=tp,
        scheduler_extra=scheduler_extra,
        tokenizer_extra=tokenizer_extra,
        env=environment,
        wrapper=wrapper,
    ) as pair:
        yield pair


def stop_all(processes: Sequence[ServiceProcess]) -> None:
    """SIGTERM each (the last started first), then wait for each to end."""
    for proc in reversed(processes):
        proc.terminate()
    for proc in reversed(processes):
        proc.stop()
