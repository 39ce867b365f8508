"""Fixtures shared by every test.

- `no_leaks` (autouse) fails any test that leaves a project segment in
  /dev/shm, a child process alive or a file in the services' temporary
  directory (TMPDIR of every service the tests start; what is released
  asynchronously gets a bounded grace period; what remains is removed and
  the test fails).
- `service_launcher` (autouse): services the tests start without a wrapper
  are forked by a preloaded zygote, not new interpreters
  (`tests/support/zygote.py`).
- `tiny_model`: one tiny random-weight LLaVA per session.
- `services`: one scheduler (2 ranks, fault-injecting tensor reader) and one
  tokenizer per session, real processes on 127.0.0.1.
- Every error message the tests' clients decode (`RemoteError.from_rpc_error`)
  is kept, and the session fails if any shows a segment name, the boot id or
  stack text (`tests/support/messages.py`).
- Torch runs one OpenMP thread in every process of the suite (see below).
- Under pytest-xdist (`make test` runs three workers, a file to a worker) each
  worker has its own segment prefix (`tests/support/leaks.py`), so leak
  checks and janitors never touch another worker's segments.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import messages
from tests.support.leaks import RUNTIME_DIR, SERVICE_TMP, children, project_segments, service_temp_leftovers, wait_until
from tests.support.services import (
    ROOT,
    SCHEDULER_SERVICE,
    TOKENIZER_SERVICE,
    FreePort,
    Pair,
    installed_launcher,
    running_pair,
    zygote_pid,
)

__all__ = ["ROOT", "SCHEDULER_SERVICE", "TOKENIZER_SERVICE", "Services"]

# One OpenMP thread in every process of the suite (this one and the
# services, forkservers and benchmarks it starts; torch is not imported
# yet): three pytest workers and their services share two cores, and
# OpenMP threads oversubscribed that way spin against each other. Four
# engine-heavy files took 28-31 % less CPU and wall time on one thread,
# with the same results. The services' own default (every core) is what
# the benchmarks measure. An OMP_NUM_THREADS the caller sets wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files that take longest, first: the suite runs a file to a worker
# (`-n 3 --dist loadfile --no-loadscope-reorder`: without that option xdist
# orders files by their number of tests, which sent these, few and long,
# last), in collection order, and a long file taken last keeps one worker
# busy while the others have nothing left. Longest first by their total
# time in a run of the whole suite (2026-12-07: the families' 88 s ... the
# zygote's 10 s; `pytest --junitxml` gives each test's time, summed by file).
SLOW_FILES = (
    "e2e/test_families.py",
    "test_bench.py",
    "e2e/test_http_api.py",
    "e2e/test_lifecycle.py",
    "e2e/test_pool.py",
    "e2e/test_startup_checks.py",
    "e2e/test_chaos.py",
    "e2e/test_keepalive.py",
    "e2e/test_engine.py",
    "e2e/test_conversation.py",
    "test_packaging.py",
    "e2e/test_serve.py",
    "e2e/test_slab.py",
    "tokenizer/test_pool_queue.py",
    "scheduler/test_shm_allreduce.py",
    "e2e/test_generate.py",
    "e2e/test_replicas.py",
    "e2e/test_bad_media.py",
    "e2e/test_scheduler_direct.py",
    "e2e/test_pairing.py",
    "scheduler/test_prefix_cache.py",
    "tokenizer/test_video_bounds.py",
    "scheduler/test_engine.py",
    "e2e/test_scheduling.py",
    "e2e/test_ownership.py",
    "e2e/test_conformance.py",
    "tokenizer/test_forkserver.py",
    "e2e/test_inline.py",
    "e2e/test_prefix_cache.py",
    "test_zygote.py",
)


# The test processes' heap out of the garbage collector's reach, as the
# services freeze theirs (`mmsplit_server.gcheap`): once the tests are
# collected (torch, transformers and every test module imported), and again
# after each file (what its module fixtures loaded: models, tokenizers).
# Every collection the tests' own work triggers (a tokenizer load makes
# ~120,000 containers, a reference `generate` many more) then walks only
# what is new instead of the whole heap: 13 % less CPU over four files of
# tokenizer and end-to-end tests. Garbage is collected before each freeze;
# frozen objects still die by reference counting.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)  # after the file's module fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(SLOW_FILES) if path.endswith(f"tests/{name}")), len(SLOW_FILES))

    items.sort(key=rank)  # stable: the order within a file, and of the other files, stays


@pytest.fixture(scope="session", autouse=True)
def record_error_messages() -> Iterator[None]:
    """Observe (not alter) what clients are told: every decoded error message."""
    from mmsplit.errors import RemoteError

    original = RemoteError.from_rpc_error.__func__  # type: ignore[attr-defined]

    def recording(cls, exc, **kwargs):  # type: ignore[no-untyped-def]
        error = original(cls, exc, **kwargs)
        messages.seen.append(error.message)
        return error

    RemoteError.from_rpc_error = classmethod(recording)  # type: ignore[method-assign,assignment]
    yield
    RemoteError.from_rpc_error = classmethod(original)  # type: ignore[method-assign,assignment]
    # At the end of this process's session (each xdist worker has its own):
    # an error at teardown fails the run wherever it happens.
    leaked = messages.leaks(messages.seen)
    if leaked:
        pytest.fail(
            f"{len(leaked)} error message(s) told a client internals (of {len(messages.seen)} seen): {leaked[:5]}"
        )


@pytest.fixture(scope="session", autouse=True)
def service_launcher() -> Iterator[None]:
    """Services the tests start without a wrapper are forked by a preloaded
    zygote (`tests/support/zygote.py`). Set up before, and so torn down
    after, every other session fixture: the session's services stop first."""
    with installed_launcher():
        yield


@pytest.fixture(scope="session", autouse=True)
def no_unread_task_errors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No service log of the session (each lies under this process's base
    temporary directory) says "Task exception was never retrieved": a
    failure that nobody handled, which a client-caused path (a deadline, a
    cancel) once produced."""
    yield
    found = [
        str(path)
        for path in tmp_path_factory.getbasetemp().rglob("*.log")
        if "Task exception was never retrieved" in path.read_text(errors="replace")
    ]
    if found:
        pytest.fail(f"service logs with an unread task exception: {found}")


@pytest.fixture(scope="session", autouse=True)
def service_temp_dir() -> Iterator[None]:
    """The services' temporary directory lives as long as the session. A
    file left in it by a test's services fails that test (`no_leaks`); one
    left by the session's services (stopped after the last test) fails here."""
    SERVICE_TMP.mkdir(mode=0o700, exist_ok=True)
    RUNTIME_DIR.mkdir(mode=0o700, exist_ok=True)
    yield
    shutil.rmtree(RUNTIME_DIR, ignore_errors=True)
    wait_until(lambda: not service_temp_leftovers(), timeout=10)
    left = service_temp_leftovers()
    shutil.rmtree(SERVICE_TMP, ignore_errors=True)
    if left:
        pytest.fail(f"files left in the services' temporary directory by the session's services: {left}")


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = children()
    yield
    problems = []
    if not wait_until(lambda: not service_temp_leftovers(), timeout=10):
        left = service_temp_leftovers()
        for name in left:
            shutil.rmtree(SERVICE_TMP / name, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                (SERVICE_TMP / name).unlink()
        problems.append(f"files left in the services' temporary directory: {left}")
    if not wait_until(lambda: not project_segments(), timeout=10):
        left = project_segments()
        for name in left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        problems.append(f"shared-memory segments left behind: {left}")
    if not wait_until(lambda: not _new_children(before), timeout=10):
        stray = _new_children(before)
        for pid in stray:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        problems.append(f"child processes left alive: {sorted(stray)}")
    if problems:
        pytest.fail("; ".join(problems))


def _new_children(before: set[int]) -> set[int]:
    """Processes that appeared during the test, except the zygote (the
    session's, started by whichever test first needed it) and those under a
    process that was already there (a longer-lived fixture's service that
    replaced its own workers: that service owns them, not the test). The
    zygote is the parent of every service it forked, so it does not count
    as such a process."""
    zygote = zygote_pid()
    new = set()
    for pid in children() - before - {zygote}:
        with contextlib.suppress(psutil.NoSuchProcess):
            if not any(parent.pid in before and parent.pid != zygote for parent in psutil.Process(pid).parents()):
                new.add(pid)
    return new


def shared_model(factory: pytest.TempPathFactory, name: str, **options: object) -> Path:
    """A tiny model (`mmsplit_cli.tiny_model.build` with `options`) built
    once per test run and shared by the xdist workers, which otherwise each
    built their own (~10 s a model here). Tests copy a model before changing it."""
    from mmsplit_cli.tiny_model import build_once

    base = factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    return build_once(shared / name, cache_dir=ROOT / ".cache", **options)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA without a chat template: its prompts are used as
    written, so the references (tests/support/reference.py) run the same
    text. `chat_models` has the families with their templates."""
    return shared_model(tmp_path_factory, "tiny-llava", chat_template=False)


# The long request of `long_context_model`: far more tokens than any test
# waits for (~700 a second on this host), so it holds its row until cancelled.
HOLDING_TOKENS = 30_000


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model` with a context of 32,768 positions: a request of
    HOLDING_TOKENS holds the scheduler's row until it is cancelled (in the
    1,024 of `tiny_model` one ends by itself in ~1.5 s). Its services need
    `--max-tokens-limit` of HOLDING_TOKENS or more (`HOLDING_LIMIT`)."""
    return shared_model(tmp_path_factory, "tiny-llava-32k", chat_template=False, max_positions=32_768)


HOLDING_LIMIT = ["--max-tokens-limit", str(HOLDING_TOKENS)]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Callable[[str], Path]:
    """family name -> a tiny model of that family, built once per session on
    first use; the LLaVA families without a chat template (as `tiny_model`),
    the Qwen ones with theirs (they have no other form)."""
    built: dict[str, Path] = {"llava": tiny_model}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = shared_model(tmp_path_factory, f"tiny-{family}", family=family, chat_template=False)
        return built[family]

    return get


@pytest.fixture(scope="session")
def chat_models(
    tmp_path_factory: pytest.TempPathFactory, family_models: Callable[[str], Path]
) -> Callable[[str], Path]:
    """family name -> a tiny model of that family with the chat template its
    public checkpoints ship (what `mmsplit tiny-model` writes by default)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        from tests.support.family_kit import ships_template

        if ships_template(family):
            return family_models(family)
        if family not in built:
            built[family] = shared_model(tmp_path_factory, f"chat-{family}", family=family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmsplit_cli import samples

    d = tmp_path_factory.mktemp("media")
    (d / "cat.jpg").write_bytes(samples.good_jpeg(seed=3))
    return d


Services = Pair


@pytest.fixture(scope="session")
def services(tiny_model: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The shared pair: 2 ranks, a tensor reader and an engine hook that
    fail on request (tests/support/faults.py), a 0.1 s batch window (so
    simultaneous requests share a step), the fake GPU as its CUDA-IPC
    backend, the LM head stored column after column; the tokenizer logs
    JSON lines; both serve /metrics."""
    logs = tmp_path_factory.mktemp("logs")
    scheduler = ["--tensor-reader", "tests.support.faults:make_reader", "--batch-window-s", "0.1"]
    scheduler += ["--engine-hook", "tests.support.faults"]
    # Opens handles of the fake GPU (tests/e2e/test_cuda_ipc.py); the shared
    # tokenizer has no GPU pool, so it sends by shared memory all the same.
    scheduler += ["--cuda-ipc-backend", "tests.support.fake_device:make"]
    # Each rank's rows of the LM head column after column (what `auto` picks
    # for a wide head on a CPU; the tiny model's narrow one stays as stored).
    scheduler += ["--lm-head-layout", "columns"]
    tokenizer = ["--allowed-media-dir", str(media_dir), "--log-format", "json"]
    with running_pair(
        tiny_model,
        logs,
        scheduler_extra=[*scheduler, "--metrics-port", FreePort()],
        tokenizer_extra=[*tokenizer, "--metrics-port", FreePort()],
    ) as pair:
        yield pair
        pair.tokenizer.terminate()
        pair.scheduler.terminate()
        codes = {"tokenizer": pair.tokenizer.stop(), "scheduler": pair.scheduler.stop()}
    assert codes == {"tokenizer": 0, "scheduler": 0}, f"services exited with {codes}"
