"""The CPU pool (`tokenizer_svc.pool`): each worker has its next task
queued, a task's preprocessing budget starts when a worker takes it, the
wait for a worker is bounded, a worker that dies costs only its own tasks,
and messages larger than a socket's buffer cross whole. Real forkserver
workers, with the fault-injecting hook's SLOW images (1.5 s in the worker
each)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from mmsplit_cli import samples
from mmsplit_server import families
from mmsplit_server.handoff import ranges, slab
from tests.support.cycles import uncollected
from tests.support.leaks import PROJECT_PREFIX, wait_until
from tests.support.worker_hook import SLOW, UNSENDABLE, marked, slow_pids
from tokenizer_svc import forkserver
from tokenizer_svc import pool as pool_module
from tokenizer_svc.decode import decode_image
from tokenizer_svc.errors import InternalError, MediaUnsupported, Overloaded, PreprocessWorkerCrashed
from tokenizer_svc.pool import CpuPool
from tokenizer_svc.preprocess import STAGES, ImageJob, ItemResult, SlabRef, media_bytes, stage_input

PREFIX = PROJECT_PREFIX + "poolq"


@pytest.fixture(scope="module")
def hook_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """One forkserver for this module's pools, started before any test's
    leak check looks and stopped at its end: it preloads transformers, and
    starting one per test cost ~4 s each. Its workers read the worker
    hook's MMSPLIT_TEST_DIE_AT_START_DIR and MMSPLIT_TEST_SLOW_DIR from the
    environment it started with, so those are set first: the two
    directories yielded, the deaths empty unless a test puts deaths in it,
    the other where workers say they began a SLOW image. Each test's workers
    must still be gone after it (`owned`), since the leak check does not
    count a forkserver's children when the forkserver was there before the test."""
    where, slow = tmp_path_factory.mktemp("deaths"), tmp_path_factory.mktemp("slow")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MMSPLIT_TEST_DIE_AT_START_DIR", str(where))
        env.setenv("MMSPLIT_TEST_SLOW_DIR", str(slow))
        forkserver.start()
    try:
        yield where, slow
    finally:
        # The forkserver and the resource tracker are children of this
        # process; `_stop` is how CPython's own tests end them.
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
        multiprocessing.resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


@pytest.fixture
def deaths(hook_dirs: tuple[Path, Path]) -> Path:
    return hook_dirs[0]


@pytest.fixture
def slow_marks(hook_dirs: tuple[Path, Path]) -> Path:
    """Where this module's workers say they began a SLOW image (a file named
    by the worker's pid and the time), emptied for the test."""
    for mark in hook_dirs[1].iterdir():
        mark.unlink()
    return hook_dirs[1]


@pytest.fixture
def owned(deaths: Path) -> Iterator[ranges.Slab]:
    s = ranges.Slab(PREFIX, os.getpid(), 16 << 20)
    yield s
    s.close()
    server = psutil.Process(multiprocessing.forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]
    assert wait_until(lambda: not server.children(), timeout=10), "a pool's workers outlived the test"
    assert not list(deaths.iterdir()), "a death was left for the next test's workers"


@contextlib.asynccontextmanager
async def one_worker(
    model: Path, queue_timeout_s: float, owned: ranges.Slab, *, workers: int = 1
) -> AsyncIterator[CpuPool]:
    """A pool of one worker (or `workers`); at the end, nothing of the slab is held."""
    pool = CpuPool(str(model), workers, worker_hook="tests.support.worker_hook", queue_timeout_s=queue_timeout_s)
    await pool.start()
    assert pool.ready
    assert len(pool.pids) == workers
    try:
        yield pool
    finally:
        await pool.shutdown()
    assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


def job(data: bytes, owned: ranges.Slab) -> ImageJob:
    return ImageJob(data, 40_000_000, 50.0, PREFIX, os.getpid(), slab=SlabRef(owned.name, owned.max_slice, 1.0))


def let_go(result: ItemResult) -> None:
    """Take the result's slices over and release them, as the service does."""
    for piece in result.slab_slices:
        ranges.take(piece, PREFIX).release()


def test_a_queued_task_s_budget_starts_when_its_worker_takes_it(tiny_model: Path, owned: ranges.Slab) -> None:
    asyncio.run(_two_in_a_row(tiny_model, owned))


async def _two_in_a_row(tiny_model: Path, owned: ranges.Slab) -> None:
    # Two SLOW images on one worker with a 2.5 s budget: the second is
    # submitted at once (queued behind the first) and ends about 3 s after it
    # was submitted, yet it is within its budget: it was in a worker 1.5 s.
    async with one_worker(tiny_model, 10, owned) as pool:
        slow = marked(SLOW)
        start = time.monotonic()
        results = await asyncio.gather(
            *(pool.preprocess(job(slow, owned), timeout_s=2.5, request_id=f"q{i}") for i in range(2))
        )
        assert time.monotonic() - start > 2.9, "the two ran one after the other"
        for result in results:
            assert result.tokens > 0
            let_go(result)


def test_waiting_for_a_worker_is_bounded_and_abandoned_work_is_released(tiny_model: Path, owned: ranges.Slab) -> None:
    asyncio.run(_three_at_once(tiny_model, owned))


async def _three_at_once(tiny_model: Path, owned: ranges.Slab) -> None:
    # One worker busy with a SLOW image for 1.5 s and a 0.5 s bound on the
    # wait: the task queued behind it (submitted already) and the one that
    # found no room in the queue are both OVERLOADED, and the queued one's
    # slice, written when the worker gets to it after all, is let go.
    async with one_worker(tiny_model, 0.5, owned) as pool:
        slow = marked(SLOW)
        outcomes = await asyncio.gather(
            *(pool.preprocess(job(slow, owned), timeout_s=10, request_id=f"b{i}") for i in range(3)),
            return_exceptions=True,
        )
        # The first two are admitted; whichever was submitted first runs.
        ran = [o for o in outcomes[:2] if isinstance(o, ItemResult)]
        queued = [o for o in outcomes[:2] if not isinstance(o, ItemResult)]
        assert len(ran) == 1, outcomes
        let_go(ran[0])
        assert isinstance(queued[0], Overloaded), queued
        assert "waited 0.5s for one of 1 busy workers" in str(queued[0])
        assert isinstance(outcomes[2], Overloaded), outcomes[2]
        assert "stayed busy for 0.5s" in str(outcomes[2])
        # The next image queues behind the abandoned task (one worker, tasks
        # in order): OVERLOADED while that one runs, as a retrying client
        # sees, then served. By then the abandoned task has run, and its
        # slice, which nobody took, is let go all the same.
        again = await until_admitted(pool, job(marked((64, 48)), owned), within_s=10)
        let_go(again)
        assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


async def until_admitted(pool: CpuPool, one: ImageJob, within_s: float) -> ItemResult:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await pool.preprocess(one, timeout_s=10, request_id="again")
        except Overloaded:
            if time.monotonic() > deadline:
                raise


def test_media_bytes_travel_in_a_slab_slice_when_there_is_room(owned: ranges.Slab) -> None:
    data = os.urandom(300_000)
    staged, held = stage_input(job(data, owned), limit=1 << 20)
    assert held is not None
    assert staged.data == b""
    assert staged.source == held.slice
    assert bytes(media_bytes(staged)) == data  # what the worker reads is the bytes sent
    held.close()
    # Over the limit (the pool's: a quarter of the slab / 2 W), or no room
    # now: the bytes stay in the job (it never waits).
    assert stage_input(job(data, owned), limit=len(data) - 1) == (job(data, owned), None)
    big = job(os.urandom(owned.max_slice + 1), owned)
    assert stage_input(big, limit=1 << 30) == (big, None)
    filling = [slab.place(owned.name, PREFIX, memoryview(os.urandom(owned.max_slice)), wait_s=0) for _ in range(4)]
    try:
        assert stage_input(job(data, owned), limit=1 << 20) == (job(data, owned), None)
    finally:
        for piece in filling:
            piece.close()
    assert owned.used_bytes() == 0


def test_a_worker_that_dies_costs_only_its_own_task(tiny_model: Path, owned: ranges.Slab, slow_marks: Path) -> None:
    asyncio.run(_one_dies(tiny_model, owned, slow_marks))


async def _one_dies(tiny_model: Path, owned: ranges.Slab, marks: Path) -> None:
    # Two workers, each with a SLOW image; one is SIGKILLed. Its image is
    # retried (and served); the other worker is not touched: same process,
    # its image served once, no retry. Only the dead worker is replaced.
    async with one_worker(tiny_model, 10, owned, workers=2) as pool:
        first, second = pool.pids
        tasks = [
            asyncio.ensure_future(pool.preprocess(job(marked(SLOW), owned), timeout_s=10, request_id=f"d{i}"))
            for i in range(2)
        ]
        # Killed once both workers are in their 1.5 s (a fixed wait could
        # kill a worker that, on a busy host, had not begun its image yet).
        assert await asyncio.to_thread(wait_until, lambda: slow_pids(marks) >= {first, second}, 30), slow_pids(marks)
        os.kill(first, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        for result in results:
            assert result.tokens > 0
            let_go(result)
        assert wait_until(lambda: len(pool.pids) == 2, timeout=30)
        assert second in pool.pids, "the worker that did not die kept working"
        assert first not in pool.pids
        assert pool.replacements == 1


def test_a_replacement_killed_as_it_starts_is_tried_again(tiny_model: Path, owned: ranges.Slab, deaths: Path) -> None:
    asyncio.run(_replacement_tried_again(tiny_model, owned, deaths))
    assert not list(deaths.iterdir()), "the replacements did not die as they started"


async def _replacement_tried_again(tiny_model: Path, owned: ranges.Slab, deaths: Path) -> None:
    # The only worker dies; its first REPLACE_TRIES - 1 replacements are
    # killed as they start. The pool keeps trying (it is starting one all
    # along, so it stays ready), and a request sent meanwhile waits for the
    # last replacement and is served: never "no CPU pool".
    async with one_worker(tiny_model, 30, owned) as pool:
        (first,) = pool.pids
        for i in range(pool_module.REPLACE_TRIES - 1):
            await asyncio.to_thread((deaths / str(i)).touch)
        os.kill(first, signal.SIGKILL)
        result = await pool.preprocess(job(marked((64, 48)), owned), timeout_s=30, request_id="after")
        assert result.tokens > 0
        let_go(result)
        assert len(pool.pids) == 1
        assert first not in pool.pids
        assert pool.replacements == 1
        assert pool.ready


def test_messages_larger_than_a_socket_buffer_cross_whole(tiny_model: Path, owned: ranges.Slab) -> None:
    asyncio.run(_big_messages(tiny_model, owned))


async def _big_messages(tiny_model: Path, owned: ranges.Slab) -> None:
    # The inline transport with no slab: the media bytes go in the job (a
    # 2 MB PNG of noise) and the pixels come back in the result, both over
    # a socket that holds a few hundred KB (written and read in pieces,
    # never blocking the event loop). What comes back is what the
    # worker's own code makes of the image in this process.
    noise = np.random.default_rng(3).integers(0, 255, (800, 900, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, "PNG")
    data = buffer.getvalue()
    assert len(data) > 1 << 20
    big = ImageJob(data, 40_000_000, 50.0, PREFIX, os.getpid(), inline=True)
    async with one_worker(tiny_model, 10, owned, workers=2) as pool:
        results = await asyncio.gather(*(pool.preprocess(big, timeout_s=30, request_id=f"big{i}") for i in range(3)))
    # The same decode, processor and rows the worker runs, in this process.
    processor = AutoImageProcessor.from_pretrained(tiny_model)
    family = families.load(tiny_model, frozenset(processor.model_input_names))
    outputs = processor(images=decode_image(data, max_pixels=40_000_000), return_tensors="np")
    rows = family.item_rows({name: np.asarray(value) for name, value in outputs.items()})
    expected = {
        name: np.ascontiguousarray(array, dtype=np.float32 if families.is_encoder_input(name) else None).tobytes()
        for name, array in rows.items()
    }
    for result in results:
        assert {t.name: t.inline for t in result.tensors} == expected
    left, right = socket.socketpair()
    with left, right:
        buffered = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert sum(len(b) for b in expected.values()) > 2 * buffered, "the pixels fill the socket more than twice"


def test_a_worker_s_time_is_counted_by_stage(tiny_model: Path, owned: ranges.Slab) -> None:
    asyncio.run(_stages(tiny_model, owned))


async def _stages(tiny_model: Path, owned: ranges.Slab) -> None:
    # A 1280x720 JPEG: its bytes are staged in the slab (read), then
    # decoded, processed and written into a slice. Each stage took time,
    # and all of them together no more than the caller waited.
    data = samples.encode(samples.gradient(1280, 720, seed=1), "JPEG", quality=90)
    async with one_worker(tiny_model, 10, owned) as pool:
        let_go(await pool.preprocess(job(data, owned), timeout_s=30, request_id="warm"))
        started = time.perf_counter()
        result = await pool.preprocess(job(data, owned), timeout_s=30, request_id="timed")
        waited = time.perf_counter() - started
        let_go(result)
    spent = dict(zip(STAGES, result.stages, strict=True))
    assert set(spent) == {"read", "decode", "process", "write"}
    assert all(seconds > 0 for seconds in spent.values()), spent
    assert sum(spent.values()) <= waited, (spent, waited)


def test_a_pool_shut_down_under_load_answers_every_caller(
    tiny_model: Path, owned: ranges.Slab, slow_marks: Path
) -> None:
    asyncio.run(_shut_down_under_load(tiny_model, owned, slow_marks))


async def _shut_down_under_load(tiny_model: Path, owned: ranges.Slab, marks: Path) -> None:
    # One worker busy with a SLOW image, one task written to it behind that,
    # one waiting in the queue: a shutdown answers all three callers with a
    # typed error at once (none hangs), and the worker is gone after it.
    pool = CpuPool(str(tiny_model), 1, worker_hook="tests.support.worker_hook", queue_timeout_s=30)
    await pool.start()
    (pid,) = pool.pids
    calls = [
        asyncio.ensure_future(pool.preprocess(job(marked(SLOW), owned), timeout_s=10, request_id=f"s{i}"))
        for i in range(3)
    ]
    assert await asyncio.to_thread(wait_until, lambda: pid in slow_pids(marks), 30), (
        "the worker never began the first image"
    )
    started = time.monotonic()
    await pool.shutdown()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, PreprocessWorkerCrashed) for o in outcomes), outcomes
    assert time.monotonic() - started < 8
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert wait_until(lambda: owned.used_bytes() == 0, timeout=5)


def test_an_exception_a_worker_cannot_send_back_is_internal_and_the_worker_lives(
    tiny_model: Path, owned: ranges.Slab
) -> None:
    asyncio.run(_unsendable(tiny_model, owned))


async def _unsendable(tiny_model: Path, owned: ranges.Slab) -> None:
    async with one_worker(tiny_model, 10, owned) as pool:
        (pid,) = pool.pids
        with pytest.raises(InternalError, match="Unbuildable: injected: cannot be rebuilt"):
            await pool.preprocess(job(marked(UNSENDABLE), owned), timeout_s=10, request_id="u")
        assert pool.pids == [pid], "the worker was not taken for broken"
        assert pool.replacements == 0
        let_go(await pool.preprocess(job(marked((64, 48)), owned), timeout_s=10, request_id="after"))


def test_a_worker_s_failure_leaves_no_frame_for_the_collector(tiny_model: Path, owned: ranges.Slab) -> None:
    """An image a worker cannot decode fails its caller; raised through the
    frame that held the pool's task (and `asyncio.wait_for`'s, that held its
    future), the failure was in a reference cycle with every frame of the
    request and their locals, until a full collection."""
    asyncio.run(_undecodable(tiny_model, owned))


async def _undecodable(tiny_model: Path, owned: ranges.Slab) -> None:
    async with one_worker(tiny_model, 10, owned) as pool:

        async def caller() -> None:
            await pool.preprocess(job(b"not an image" * 100, owned), timeout_s=10, request_id="bad")

        with uncollected() as found:
            with pytest.raises(MediaUnsupported):
                await caller()
            await asyncio.sleep(0)
        assert found == [], found
