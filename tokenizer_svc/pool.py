"""The CPU process pool and its supervisor (DESIGN.md §5).

- Workers start by forkserver with `tokenizer_svc.preprocess` preloaded (never
  plain fork: the gRPC server and torch threads already exist).
- `submit` can block when workers die, so it runs off the event loop.
- A broken pool is replaced once per generation: whichever request sees
  generation g broken replaces it under the lock; others that saw g find
  g+1 already there. The old pool shuts down off the event loop.
- A task interrupted by a pool break is retried once on the new pool; a
  second break under it is PreprocessWorkerCrashed.
- A task whose caller stopped waiting (PREPROCESS_TIMEOUT, cancel) is
  cancelled if it has not reached a worker yet, and costs nothing more. One
  already running cannot be interrupted: it keeps its worker (that capacity
  is spent) until it finishes, and a callback then releases its result's
  segment, so abandoned work never leaks shared memory.
- Admission: a request takes one of 2 x W admission slots before it
  submits, so each worker has its next task queued when it finishes one
  (without that, each worker idled ~2 ms per task waiting on a round trip
  through this process: `bench/preprocess.py`). Workers take tasks in the
  order they were submitted, so the k-th task of a pool (from 0) starts once
  k - W + 1 of those before it have ended (`_Order`); its preprocessing
  timeout starts only then, so it measures the worker's time, never a queue
  behind other requests. Waiting for admission, and then for a worker, are
  each bounded by `queue_timeout_s` (else OVERLOADED, retriable). An
  admission slot comes back when its task ends — for an abandoned task,
  when the worker is done with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from tokenizer_svc.errors import Overloaded, PreprocessTimeout, PreprocessWorkerCrashed
from tokenizer_svc.preprocess import ItemResult, Job, init_worker, preprocess, stage_input, warm_up

log = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 10.0
PRELOAD = ["tokenizer_svc.preprocess", "transformers", "PIL.Image", "numpy"]


def _release_orphan(fut: concurrent.futures.Future[Any], prefix: str) -> None:
    """Done-callback of a task nobody waits for any more."""
    if fut.cancelled() or fut.exception() is not None:
        return
    result = fut.result()
    if isinstance(result, ItemResult):
        result.abandon(prefix)
        log.info("released the tensors of abandoned preprocessing task")


def _submit(
    pool: concurrent.futures.ProcessPoolExecutor, order: _Order, job: Job, workers: int
) -> tuple[concurrent.futures.Future[ItemResult], int]:
    """Submit `job`, its bytes in a slab slice where it can (`stage_input`),
    held until the task ends however it ends (a result, a crash, or a
    caller that stopped waiting); the future and its ticket (`_Order`).
    At most 2 x W tasks hold an admission slot, so with inputs of at most a
    quarter of the slab / (2 x W) each, inputs never take more than a
    quarter of it (an abandoned task keeps its slot until it ends)."""
    limit = job.slab.max_slice // (2 * workers) if job.slab is not None else 0
    staged, held = stage_input(job, limit)
    try:
        cfut, ticket = order.submit(pool, preprocess, staged)
    except BaseException:
        if held is not None:
            held.close()
        raise
    if held is not None:
        cfut.add_done_callback(lambda _: held.close())
    return cfut, ticket


def _abandon(fut: concurrent.futures.Future[Any], prefix: str) -> None:
    """Nobody waits for `fut` any more: drop it if it has not started, else
    release what it produces when it finishes."""
    if not fut.cancel():
        fut.add_done_callback(functools.partial(_release_orphan, prefix=prefix))


class _Slot:
    """An admission slot held by one request: released when the request is
    done with it, or handed to a task that keeps running after its caller left."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots = slots
        self._held = True

    def hand_to(self, fut: concurrent.futures.Future[Any]) -> None:
        loop = asyncio.get_running_loop()
        self._held = False
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()


class _Order:
    """Where the tasks of one executor stand: its workers take them in the
    order they were submitted, so ticket k (the k-th task, from 0) starts
    once k - W + 1 tasks have ended, whichever they were. Submission takes
    a lock so that the tickets and the executor's queue agree."""

    def __init__(self, workers: int, loop: asyncio.AbstractEventLoop) -> None:
        self._workers = workers
        self._loop = loop
        self._lock = threading.Lock()
        self._submitted = 0
        self._ended = 0  # on the event loop's thread only
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    def submit(
        self, pool: concurrent.futures.ProcessPoolExecutor, fn: Callable[..., Any], *args: Any
    ) -> tuple[concurrent.futures.Future[Any], int]:
        """(Any thread.) Submit, and the task's ticket."""
        with self._lock:
            cfut = pool.submit(fn, *args)
            ticket = self._submitted
            self._submitted += 1
        cfut.add_done_callback(self._ended_soon)
        return cfut, ticket

    def _ended_soon(self, _: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._end)

    def _end(self) -> None:
        self._ended += 1
        still = []
        for ticket, fut in self._waiting:
            if self._started(ticket):
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((ticket, fut))
        self._waiting = still

    def _started(self, ticket: int) -> bool:
        return ticket < self._ended + self._workers

    def started(self, ticket: int) -> asyncio.Future[None]:
        """Done once a worker has (or is about to have) taken ticket `ticket`."""
        fut = self._loop.create_future()
        if self._started(ticket):
            fut.set_result(None)
        else:
            self._waiting.append((ticket, fut))
        return fut


class CpuPool:
    def __init__(self, model_dir: str, workers: int, *, worker_hook: str = "", queue_timeout_s: float = 30.0) -> None:
        self.model_dir = model_dir
        self.worker_hook = worker_hook
        self.workers = workers
        self.queue_timeout_s = queue_timeout_s
        self.generation = 0
        self.replacements = 0
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._admitted = asyncio.Semaphore(2 * workers)
        self._order: _Order | None = None  # of `_pool`

    @property
    def ready(self) -> bool:
        return self._pool is not None

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=ctx,
            initializer=init_worker,
            initargs=(self.model_dir, os.getpid(), self.worker_hook),
        )
        # Start every worker now, so the first requests do not pay for it
        # (and a failing initializer shows here, not in a request).
        try:
            for fut in [pool.submit(warm_up) for _ in range(self.workers)]:
                fut.result(timeout=120)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        return pool

    async def start(self) -> None:
        await self._create()

    async def _replace(self, seen_generation: int) -> None:
        async with self._lock:
            if self.generation != seen_generation:
                return  # someone else replaced it already
            old, self._pool = self._pool, None
            self.generation += 1
            if old is not None:
                asyncio.get_running_loop().run_in_executor(None, lambda: old.shutdown(wait=True, cancel_futures=True))
            await self._create()
            if self._pool is not None:
                self.replacements += 1
                log.warning("CPU pool replaced (generation %d)", self.generation)

    async def _create(self) -> None:
        """Create the pool; on failure leave none (readiness NOT_SERVING) for
        `ensure` to retry."""
        try:
            pool = await asyncio.to_thread(self._new_pool)
            self._pool, self._order = pool, _Order(self.workers, asyncio.get_running_loop())
        except Exception:
            log.exception("creating the CPU pool failed; NOT_SERVING until a retry succeeds")
            return
        log.info("CPU pool started with %d forkserver workers", self.workers)

    async def ensure(self) -> bool:
        """Create the pool if there is none (after a failed creation), and
        replace it if it broke while idle (a worker that dies with no task
        breaks the pool silently; the next request would pay for the
        replacement). The caller decides how often; returns whether a pool
        exists."""
        generation, pool = self.generation, self._pool
        if pool is None:
            async with self._lock:
                if self._pool is None:
                    await self._create()
        else:
            try:
                # submit raises at once on a broken pool; the no-op itself is
                # not awaited (it is counted in the pool's order: it takes a worker too).
                order = self._order
                submit = pool.submit if order is None else functools.partial(order.submit, pool)
                await asyncio.to_thread(submit, warm_up)
            except (BrokenProcessPool, RuntimeError):
                log.warning("CPU pool found broken while idle")
                await self._replace(generation)
        return self._pool is not None

    async def preprocess(self, job: Job, *, timeout_s: float, request_id: str) -> ItemResult:
        """Run one image or video through a worker; typed errors only."""
        try:
            if self._admitted.locked():
                await asyncio.wait_for(self._admitted.acquire(), self.queue_timeout_s)
            else:
                await self._admitted.acquire()  # free, nobody ahead: returns at once
        except TimeoutError as exc:
            raise Overloaded(
                f"all {self.workers} preprocessing workers stayed busy for {self.queue_timeout_s:g}s; retry later"
            ) from exc
        slot = _Slot(self._admitted)
        try:
            return await self._attempts(job, timeout_s, request_id, slot)
        finally:
            slot.release()

    async def _start(self, order: _Order, ticket: int, afut: asyncio.Future[ItemResult]) -> None:
        """Return once a worker takes the task (`_Order`), or it has ended
        meanwhile; OVERLOADED after `queue_timeout_s`."""
        started = order.started(ticket)
        if started.done():
            return
        either: set[asyncio.Future[Any]] = {started, afut}
        try:
            await asyncio.wait(either, timeout=self.queue_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()  # a no-op once it is done
        if started.cancelled() and not afut.done():
            raise Overloaded(
                f"a preprocessing task waited {self.queue_timeout_s:g}s for one of {self.workers} busy workers;"
                " retry later"
            )

    async def _attempts(self, job: Job, timeout_s: float, request_id: str, slot: _Slot) -> ItemResult:
        for attempt in (1, 2):
            if self._pool is None and self._lock.locked():
                async with self._lock:  # a replacement is under way: wait for it, not fail
                    pass
            generation, pool, order = self.generation, self._pool, self._order
            if pool is None or order is None:
                raise PreprocessWorkerCrashed("no CPU pool is available right now")
            try:
                return await self._run(pool, order, job, timeout_s, slot)
            except BrokenProcessPool as exc:
                log.warning("request %s: worker pool broke (attempt %d)", request_id, attempt)
                await self._replace(generation)
                if attempt == 2:
                    raise PreprocessWorkerCrashed(
                        "a preprocessing worker died twice while handling this request's media"
                    ) from exc
        raise AssertionError("unreachable")

    async def _run(
        self, pool: concurrent.futures.ProcessPoolExecutor, order: _Order, job: Job, timeout_s: float, slot: _Slot
    ) -> ItemResult:
        try:
            cfut, ticket = await asyncio.wait_for(
                asyncio.to_thread(_submit, pool, order, job, self.workers), SUBMIT_TIMEOUT_S
            )
        except RuntimeError as exc:  # submitted while that pool was being shut down
            raise BrokenProcessPool(str(exc)) from exc
        except TimeoutError as exc:
            # A submit that does not return means a wedged pool: treat it as
            # broken. (The thread stuck in it is abandoned, not reclaimed.)
            raise BrokenProcessPool(f"submit did not return within {SUBMIT_TIMEOUT_S}s") from exc
        afut = asyncio.wrap_future(cfut)
        try:
            await self._start(order, ticket, afut)
            return await asyncio.wait_for(asyncio.shield(afut), timeout_s)
        except TimeoutError as exc:
            slot.hand_to(cfut)  # the worker stays busy until the task ends
            _abandon(cfut, job.shm_prefix)
            raise PreprocessTimeout(f"preprocessing took longer than {timeout_s:.1f}s") from exc
        except (Overloaded, asyncio.CancelledError):  # the task may run yet
            slot.hand_to(cfut)
            _abandon(cfut, job.shm_prefix)
            raise

    async def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
