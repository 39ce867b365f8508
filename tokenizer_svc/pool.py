"""The CPU process pool and its supervisor (DESIGN.md §5).

Our own pool, not `concurrent.futures.ProcessPoolExecutor`:

- Workers start by forkserver with `tokenizer_svc.preprocess` preloaded (never
  plain fork: the gRPC server and torch threads already exist), each with a
  socket of its own to this process (`tokenizer_svc.worker`). The event loop
  writes a worker its tasks and reads its answers through that socket,
  without blocking and without a thread in between: the executor moved
  each task through a thread of ours (its `submit` may block), its feeder
  thread and its manager thread, about 1.8 ms of this process's CPU per
  image, taken from the workers' cores (`bench/preprocess.py`).
- A worker that dies costs only what it had: the task it was running is
  retried once, on another worker; a second death under the same task is
  PreprocessWorkerCrashed. A task it had queued but not started goes back
  to the front of the queue. The dead worker alone is replaced ("CPU pool
  replaced a worker"), off the event loop; the others keep working (the
  executor broke as a whole, and every task in it failed over).
- A task whose caller stopped waiting (PREPROCESS_TIMEOUT, cancel,
  OVERLOADED) is dropped if no worker has it yet, and costs nothing more.
  One a worker has cannot be interrupted: it keeps its worker (that capacity
  is spent) until it finishes, and its result's segments and slices are
  then released, so abandoned work never leaks shared memory.
- Admission: a request takes one of 2 x W admission slots before it queues,
  so each worker has its next task written to it when it finishes one
  (without that, each worker idled ~2 ms per task waiting on a round trip
  through this process). A task starts when it is the first of its
  worker's; its preprocessing timeout starts only then, so it measures the
  worker's time, never a queue behind other requests. Waiting for
  admission, and then for a worker, are each bounded by `queue_timeout_s`
  (else OVERLOADED, retriable). An admission slot comes back when its task
  ends — for an abandoned task, when the worker is done with it.
- Readiness: the pool serves while one worker lives, or while replacements
  start. Once the workers last started all failed and none lives, it does
  not; with none alive and none starting, requests fail at once
  (PREPROCESS_WORKER_CRASHED), and `ensure` keeps trying to start them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing.connection
import os
from typing import Any

from tokenizer_svc import forkserver
from tokenizer_svc.errors import Overloaded, PreprocessTimeout, PreprocessWorkerCrashed
from tokenizer_svc.preprocess import ItemResult, Job, stage_input
from tokenizer_svc.worker import WorkerLink, reap, serve

log = logging.getLogger(__name__)

# How long a new worker may take to load the image processor.
START_TIMEOUT_S = 120.0
# A replacement that fails to start is tried this many times, the pauses
# growing by this much, before the pool waits for `ensure` (every 2 s).
REPLACE_TRIES = 3
REPLACE_RETRY_S = 0.2
# Tasks written to one worker at a time: the one it runs and its next.
PER_WORKER = 2


class _WorkerLost(Exception):
    """The worker running a task died under it."""


class _Task:
    """One preprocessing task: its job (media staged in the slab where it
    could be), the staged slice it holds until it ends, and its outcome."""

    def __init__(self, job: Job, held: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.held = held
        self.started: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[ItemResult] = loop.create_future()
        self.abandoned = False

    def end(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.close()


class _Worker:
    """A worker as the pool sees it: its link, the tasks written to it (the
    first runs), and its word that it is ready (its pid) or failed."""

    def __init__(self, pool: CpuPool, process: Any, conn: multiprocessing.connection.Connection) -> None:
        self.tasks: collections.deque[_Task] = collections.deque()
        self.ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.link = WorkerLink(
            process,
            conn,
            on_message=lambda _, message: pool._message(self, message),
            on_lost=lambda _: pool._lost(self),
        )


class _Slot:
    """An admission slot held by one request: released when the request is
    done with it, or handed to a task that keeps running after its caller left."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots = slots
        self._held = True

    def hand_to(self, fut: asyncio.Future[Any]) -> None:
        self._held = False
        fut.add_done_callback(lambda _: self._slots.release())

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()


class CpuPool:
    def __init__(
        self,
        model_dir: str,
        workers: int,
        *,
        worker_hook: str = "",
        queue_timeout_s: float = 30.0,
        memory_bytes: int = 0,
    ) -> None:
        self.model_dir = model_dir
        self.worker_hook = worker_hook
        # Address space each worker may add to what it holds once started (0: no limit).
        self.memory_bytes = memory_bytes
        self.workers = workers
        self.queue_timeout_s = queue_timeout_s
        self.replacements = 0
        self._live: list[_Worker] = []
        self._starting = 0
        self._failing = False  # the last workers started all failed, and none is alive
        self._queue: collections.deque[_Task] = collections.deque()
        self._admitted = asyncio.Semaphore(2 * workers)
        self._closed = False
        self._ctx = forkserver.context()
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def ready(self) -> bool:
        """Serving: a worker is alive, or replacements are starting and the
        last did not fail (a moment with every worker dead and their
        replacements on the way is not worth a readiness flap)."""
        return bool(self._live) or (self._starting > 0 and not self._failing)

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.link.pid for w in self._live]

    async def start(self) -> None:
        await self._fill(replacing=False)

    async def ensure(self) -> bool:
        """Start the workers missing (after a failed start or replacement);
        the caller decides how often. Returns whether any worker is alive."""
        if not self._closed and len(self._live) + self._starting < self.workers:
            await self._fill(replacing=bool(self._live) or self.replacements > 0)
        return self.ready

    async def _fill(self, *, replacing: bool) -> None:
        """Start workers until there are W (those starting counted)."""
        await self._started(self._reserve(), replacing=replacing)

    def _reserve(self) -> int:
        """Count the workers missing as starting, at once (so that nobody
        meanwhile takes the pool for one with no worker coming); how many."""
        missing = 0 if self._closed else max(0, self.workers - len(self._live) - self._starting)
        self._starting += missing
        return missing

    async def _started(self, missing: int, *, replacing: bool, tries: int = 1) -> None:
        """Start `missing` workers reserved by `_reserve`, each tried up to
        `tries` times."""
        if not missing:
            return
        try:
            got = await asyncio.gather(*(self._spawn_tried(tries) for _ in range(missing)), return_exceptions=True)
        finally:
            self._starting -= missing
        self._failing = not self._live and all(isinstance(outcome, BaseException) for outcome in got)
        for outcome in got:
            if isinstance(outcome, BaseException):
                log.error("starting a CPU worker failed: %s", outcome)
            elif replacing:
                self.replacements += 1
                log.warning("CPU pool replaced a worker (pid %d; %d replaced so far)", outcome, self.replacements)
        if self._live:
            log.info("CPU pool has %d of %d forkserver workers", len(self._live), self.workers)
            self._dispatch()
        elif not self._starting:  # none alive, none coming: fail what waits, at once
            log.error("no CPU worker could be started; NOT_SERVING until one starts")
            self._fail_queued()

    async def _spawn_tried(self, tries: int) -> int:
        """`_spawn`, tried again after a short pause when it fails (a
        replacement killed as it started, say), up to `tries` times."""
        for attempt in range(1, tries + 1):
            try:
                return await self._spawn()
            except Exception as exc:
                if attempt == tries or self._closed:
                    raise
                log.warning("starting a CPU worker failed (%s); trying again", exc)
                await asyncio.sleep(REPLACE_RETRY_S * attempt)
        raise AssertionError("unreachable")

    async def _spawn(self) -> int:
        """One worker, started and initialized; its pid."""
        forkserver.context()  # its preload, should the forkserver have to start again
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=serve,
            args=(child, self.model_dir, os.getpid(), self.worker_hook, self.memory_bytes),
            name="mmsplit-cpu",
            daemon=True,
        )
        try:
            await asyncio.to_thread(process.start)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        worker = _Worker(self, process, parent)
        try:
            pid = await asyncio.wait_for(asyncio.shield(worker.ready), START_TIMEOUT_S)
            if self._closed or not worker.link.open:  # shut down, or it died just after it said it was ready
                raise RuntimeError("the pool was shut down" if self._closed else "the worker died as it started")
        except BaseException:
            worker.link.close()
            await asyncio.to_thread(reap, process)
            raise
        self._live.append(worker)
        return pid

    # -- what workers say (event loop only) ------------------------------------

    def _message(self, worker: _Worker, message: tuple[str, Any]) -> None:
        kind, value = message
        if kind == "ready":
            if not worker.ready.done():
                worker.ready.set_result(value)
            return
        if kind == "failed":
            if not worker.ready.done():
                worker.ready.set_exception(RuntimeError(value))
            return
        if not worker.tasks:
            log.error("a CPU worker answered a task it was never given; ignored")
            return
        task = worker.tasks.popleft()
        self._settle(task, value if kind == "ok" else None, value if kind == "error" else None)
        if worker.tasks and not worker.tasks[0].started.done():
            worker.tasks[0].started.set_result(None)
        self._dispatch()

    def _settle(self, task: _Task, result: ItemResult | None, error: BaseException | None) -> None:
        """A task has ended (with a result, an error, or neither when its
        worker is gone and nobody waits): its staged input goes, and its
        caller learns, or an abandoned one's result is released."""
        task.end()
        if task.abandoned:
            if result is not None:
                result.abandon(task.job.shm_prefix)
                log.info("released the tensors of abandoned preprocessing task")
            if not task.done.done():
                task.done.cancel()  # gives its admission slot back
            return
        if task.done.done():
            return
        if error is not None:
            task.done.set_exception(error)
        else:
            task.done.set_result(result)  # type: ignore[arg-type]

    def _lost(self, worker: _Worker) -> None:
        """A worker's socket closed: it died (or stopped). Its running task
        fails over to its caller's retry; those it had not started go back
        to the front of the queue; a replacement starts."""
        if not worker.link.open:
            return
        worker.link.close()
        if not worker.ready.done():
            code = worker.link.process.exitcode
            worker.ready.set_exception(RuntimeError(f"the worker exited while starting (code {code})"))
            return
        if worker not in self._live:  # ready, not yet joined: its `_spawn` sees it died
            return
        self._live.remove(worker)
        tasks = list(worker.tasks)
        worker.tasks.clear()
        if tasks:
            self._settle(tasks[0], None, _WorkerLost())  # it was running: its caller retries
            for task in reversed(tasks[1:]):
                if task.abandoned:
                    self._settle(task, None, None)
                else:
                    self._queue.appendleft(task)
        reaper = asyncio.ensure_future(asyncio.to_thread(reap, worker.link.process))
        self._keep(reaper)
        if not self._closed:
            self._keep(asyncio.ensure_future(self._started(self._reserve(), replacing=True, tries=REPLACE_TRIES)))
        self._dispatch()

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._background.discard)

    def _dispatch(self) -> None:
        """Give queued tasks to workers with room, the idlest first."""
        while self._queue:
            room = [w for w in self._live if w.link.open and len(w.tasks) < PER_WORKER]
            if not room:
                break
            worker = min(room, key=lambda w: len(w.tasks))
            task = self._queue.popleft()
            worker.tasks.append(task)
            if len(worker.tasks) == 1:
                task.started.set_result(None)
            worker.link.send(task.job)
        if self._queue and not self._live and not self._starting:
            self._fail_queued()

    def _fail_queued(self) -> None:
        while self._queue:
            self._settle(self._queue.popleft(), None, _WorkerLost())

    # -- requests --------------------------------------------------------------

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

    async def _attempts(self, job: Job, timeout_s: float, request_id: str, slot: _Slot) -> ItemResult:
        for attempt in (1, 2):
            if not self._live and not self._starting:
                raise PreprocessWorkerCrashed("no CPU pool is available right now")
            try:
                return await self._run(job, timeout_s, slot)
            except _WorkerLost as exc:
                if not self._live and not self._starting:
                    raise PreprocessWorkerCrashed("no CPU pool is available right now") from exc
                log.warning("request %s: a preprocessing worker died under it (attempt %d)", request_id, attempt)
                if attempt == 2:
                    raise PreprocessWorkerCrashed(
                        "a preprocessing worker died twice while handling this request's media"
                    ) from exc
        raise AssertionError("unreachable")

    async def _run(self, job: Job, timeout_s: float, slot: _Slot) -> ItemResult:
        # Media bytes go in a slab slice where there is room (never waits):
        # at most 2 x W tasks hold an admission slot, so with inputs of at
        # most a quarter of the slab / (2 x W) each, inputs never take more
        # than a quarter of it.
        limit = job.slab.max_slice // (2 * self.workers) if job.slab is not None else 0
        staged, held = stage_input(job, limit)
        task = _Task(staged, held, asyncio.get_running_loop())
        self._queue.append(task)
        self._dispatch()
        try:
            await self._start(task)
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(task.done)
        except TimeoutError as exc:
            slot.hand_to(task.done)  # the worker stays busy until the task ends
            self._abandon(task)
            raise PreprocessTimeout(f"preprocessing took longer than {timeout_s:.1f}s") from exc
        except (Overloaded, asyncio.CancelledError):  # a worker may have it yet
            slot.hand_to(task.done)
            self._abandon(task)
            raise
        finally:
            # A worker's failure (an image it could not decode) raised from
            # here holds this frame, whose `task` holds that failure in its
            # future: a reference cycle that kept every frame of the request
            # alive, with its locals, until a full collection (as did
            # `asyncio.wait_for`'s own frame, holding the failed future).
            del task

    async def _start(self, task: _Task) -> None:
        """Return once a worker starts the task, or it has ended meanwhile;
        OVERLOADED after `queue_timeout_s`."""
        if task.started.done():
            return
        either: set[asyncio.Future[Any]] = {task.started, task.done}
        await asyncio.wait(either, timeout=self.queue_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not task.started.done() and not task.done.done():
            raise Overloaded(
                f"a preprocessing task waited {self.queue_timeout_s:g}s for one of {self.workers} busy workers;"
                " retry later"
            )

    def _abandon(self, task: _Task) -> None:
        """Nobody waits for `task` any more: drop it if no worker has it, else
        release what it produces when it ends."""
        task.abandoned = True
        if task in self._queue:
            self._queue.remove(task)
            task.end()
            task.done.cancel()
        elif task.done.done() and not task.done.cancelled() and task.done.exception() is None:
            task.done.result().abandon(task.job.shm_prefix)

    async def shutdown(self) -> None:
        self._closed = True
        self._fail_queued()
        workers, self._live = self._live, []
        for worker in workers:
            worker.link.close()  # its end closes: the worker's recv ends, and so does it
            for task in worker.tasks:
                self._settle(task, None, _WorkerLost())
        await asyncio.gather(*(asyncio.to_thread(reap, w.link.process) for w in workers))
        for pending in list(self._background):
            pending.cancel()
        # Their outcomes (cancellations) are gathered, not raised; our own
        # cancellation, if it comes, is not swallowed.
        await asyncio.gather(*self._background, return_exceptions=True)
