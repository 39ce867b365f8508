"""Rank 0's step thread and the other ranks' loop.

Rank 0's `StepLoop` owns all per-request policy: admission into steps, the
token each request feeds next, finishing, aborts. Only the thread that runs
`StepLoop.run` touches its state; other threads talk to it through `inbox`.
Events go back to the gRPC side through each admission's `emit`, which must be
thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mmsplit import shm
from mmsplit.common.v1 import common_pb2
from scheduler_svc.collective import Collective
from scheduler_svc.engine import Engine
from scheduler_svc.errors import MmsplitError, Overloaded, SchedulerUnavailable, ShuttingDown, error_for_code
from scheduler_svc.plan import NewRequest, Plan
from scheduler_svc.settings import SchedulerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Token:
    token_id: int


@dataclass(frozen=True)
class Finished:
    reason: int  # common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: MmsplitError


Event = Token | Finished | Failed


@dataclass
class Admission:
    request: NewRequest
    max_tokens: int
    emit: Callable[[Event], None]
    generated: int = 0
    next_token: int | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def release(self) -> None:
        for spec in self.request.pixel_values:
            spec.release()


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class StepLoop:
    def __init__(
        self,
        engine: Engine,
        coll: Collective,
        settings: SchedulerSettings,
        *,
        eos_token_ids: frozenset[int],
        max_context: int,
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.coll = coll
        self.settings = settings
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.on_fatal = on_fatal
        self.inbox: queue.SimpleQueue[Admission | _Abort | _Stop] = queue.SimpleQueue()
        self._queued = 0  # admissions in the inbox or pending; guarded by _lock
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        # Loop-thread state.
        self._pending: deque[Admission] = deque()
        self._running: dict[str, Admission] = {}
        self._drop: list[str] = []
        self._aborted: set[str] = set()
        self._stopping = False
        self._draining = False
        # Set by the loop thread once draining and nothing is queued or running.
        self.idle = threading.Event()
        self._step = 0
        self._last_sweep = 0.0
        self.active_per_rank: list[int] = [0] * coll.world_size

    # ---- any thread ----
    def submit(self, admission: Admission) -> None:
        with self._lock:
            if self._dead is not None:
                raise SchedulerUnavailable(f"scheduler group is down: {self._dead}")
            if self._draining or self._stopping:
                raise ShuttingDown("scheduler is shutting down")
            if self._queued >= self.settings.max_queue:
                raise Overloaded(f"admission queue is full ({self.settings.max_queue} waiting)")
            self._queued += 1
            # Under the lock, so a concurrent _fail_all cannot miss it.
            self.inbox.put(admission)

    def abort(self, request_id: str) -> None:
        self.inbox.put(_Abort(request_id))

    def begin_drain(self) -> None:
        """Refuse new requests; running ones go on. `idle` is set when none is left."""
        with self._lock:
            self._draining = True

    def request_stop(self) -> None:
        """Fail whatever is still queued or running with ShuttingDown, then stop every rank."""
        with self._lock:
            self._stopping = True
        self.inbox.put(_Stop())

    # ---- the loop thread ----
    def run(self) -> None:
        try:
            while True:
                self._drain(block=not (self._pending or self._running or self._stopping))
                self._janitor()
                plan, admitted = self._plan()
                self.coll.broadcast_from_0(plan)
                outcome = self.engine.step(plan)
                self.active_per_rank = outcome.active_per_rank
                if len(set(outcome.active_per_rank)) > 1:
                    raise RuntimeError(f"ranks diverged: active requests per rank {outcome.active_per_rank}")
                for rid in self._aborted.intersection(plan.drop):
                    log.info("request %s aborted on all %d ranks", rid, self.coll.world_size)
                self._aborted.difference_update(plan.drop)
                self._settle(admitted, outcome.failed, outcome.sampled)
                if plan.stop:
                    return
                with self._lock:
                    if self._draining and self._queued == 0 and not self._running:
                        self.idle.set()
        except BaseException as exc:
            log.exception("step loop failed at step %d; the group is down", self._step)
            with self._lock:
                self._dead = exc
            self._fail_all(SchedulerUnavailable(f"scheduler group failed: {exc}"))
            self.on_fatal(exc)

    def _drain(self, *, block: bool) -> None:
        """Take everything in the inbox. When idle, wait up to a heartbeat for
        the first item, then up to a short batch window for companions, so
        requests that arrive together share a step."""
        timeout = self.settings.heartbeat_s if block else None
        window_ends: float | None = None
        while True:
            try:
                item = self.inbox.get(timeout=timeout) if timeout is not None else self.inbox.get_nowait()
            except queue.Empty:
                return
            if block and window_ends is None and isinstance(item, Admission):
                window_ends = time.monotonic() + self.settings.batch_window_s
            timeout = max(0.0, window_ends - time.monotonic()) if window_ends is not None else None
            if isinstance(item, Admission):
                self._pending.append(item)
            elif isinstance(item, _Abort):
                self._abort(item.request_id)
            else:
                self._stopping = True
                self._fail_all(ShuttingDown("scheduler is shutting down"))

    def _janitor(self) -> None:
        """Sweep segments of the prefix past their lease, except those of
        queued requests (a tokenizer killed mid-request leaves its unsent
        segments behind). Runs on the loop thread, which owns `_pending`.
        Lease only: the owners' pids may live in another pid namespace."""
        now = time.monotonic()
        if now - self._last_sweep < self.settings.janitor_interval_s:
            return
        self._last_sweep = now
        keep = {spec.shm.segment for adm in self._pending for spec in adm.request.pixel_values if spec.shm}
        shm.sweep(self.settings.shm_prefix, lease_s=self.settings.segment_lease_s, check_owner=False, keep=keep)

    def _abort(self, request_id: str) -> None:
        for adm in self._pending:
            if adm.request_id == request_id:
                self._pending.remove(adm)
                self._dequeued(1)
                adm.release()
                log.info("request %s aborted before its first step; segments released", request_id)
                return
        if self._running.pop(request_id, None) is not None:
            self._drop.append(request_id)
            self._aborted.add(request_id)

    def _plan(self) -> tuple[Plan, list[Admission]]:
        room = min(self.settings.max_new_per_step, self.settings.max_running - len(self._running))
        admitted = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
        self._dequeued(len(admitted))
        feed = tuple((rid, adm.next_token) for rid, adm in self._running.items() if adm.next_token is not None)
        self._step += 1
        plan = Plan(
            step=self._step,
            new=tuple(a.request for a in admitted),
            drop=tuple(self._drop),
            feed=feed,  # type: ignore[arg-type]
            stop=self._stopping,
        )
        self._drop = []
        if admitted:
            log.info("step %d admits %s", plan.step, [a.request_id for a in admitted])
        return plan, admitted

    def _settle(self, admitted: list[Admission], failed: dict, sampled: dict[str, int]) -> None:
        for adm in admitted:
            failure = failed.get(adm.request_id)
            if failure is None:
                self._running[adm.request_id] = adm
                continue
            ranks = ",".join(str(r) for r in failure.ranks)
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failure.messages.items()))
            log.warning("request %s failed on rank(s) %s, aborted on all ranks: %s", adm.request_id, ranks, detail)
            adm.emit(Failed(error_for_code(failure.code, detail or "tensor read failed", {"failed_ranks": ranks})))
        for rid, token in sampled.items():
            running = self._running.get(rid)
            if running is None:  # aborted while this step ran; already queued for dropping
                continue
            adm = running
            adm.generated += 1
            adm.emit(Token(token))
            reason = self._finish_reason(adm, token)
            if reason is None:
                adm.next_token = token
                continue
            prompt = len(adm.request.input_ids)
            adm.emit(Finished(reason, prompt, adm.generated))
            del self._running[rid]
            self._drop.append(rid)

    def _finish_reason(self, adm: Admission, token: int) -> int | None:
        if token in self.eos_token_ids:
            return common_pb2.FINISH_REASON_STOP
        if adm.generated >= adm.max_tokens or len(adm.request.input_ids) + adm.generated >= self.max_context:
            return common_pb2.FINISH_REASON_LENGTH
        return None

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _fail_all(self, error: MmsplitError) -> None:
        """Fail every pending and running request; release what rank 0 still owns."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Admission):
                self._pending.append(item)
        for adm in self._pending:
            adm.release()
            adm.emit(Failed(error))
        self._dequeued(len(self._pending))
        self._pending.clear()
        for rid, adm in self._running.items():
            adm.emit(Failed(error))
            self._drop.append(rid)
        self._running.clear()


def run_follower(engine: Engine, coll: Collective) -> None:
    """Ranks other than 0: run rank 0's plans until told to stop."""
    while True:
        plan: Plan = coll.broadcast_from_0(None)
        engine.step(plan)
        if plan.stop:
            return
