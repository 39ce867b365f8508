"""Rank 0's step thread and the other ranks' loop.

Rank 0's `StepLoop` owns all per-request policy: admission into the batch
(row cap, new requests per step, prefill tokens per step, the KV-cache
budget; in arrival order, or by priority under --scheduling-policy
priority), the token each request feeds next, finishing, aborts. Only the
thread that runs `StepLoop.run` touches its state; other threads talk to it
through `inbox`. Events go back to the gRPC side in one batch per step
through `post`, which runs a callable on the consumer's thread.

KV budget: the engine's cache is rectangular (rows x the longest row), so
what the running requests can come to occupy is ``rows x max(reservation)``,
where a request reserves ``prompt + max_tokens`` (capped at the context
length). A request joins only while that stays within the budget; until then
it waits in the queue, and beyond `max_queue` new requests are OVERLOADED.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mmsplit.common.v1 import common_pb2
from mmsplit_server import mallocheap
from mmsplit_server.handoff import files
from mmsplit_server.handoff.reference import Claim
from scheduler_svc.collective import Collective
from scheduler_svc.engine import Engine, twin_key
from scheduler_svc.errors import (
    InternalError,
    MmsplitError,
    Overloaded,
    SchedulerUnavailable,
    ShuttingDown,
    error_for_code,
)
from scheduler_svc.plan import NewRequest, Plan, StepOutcome
from scheduler_svc.prefix_cache import BLOCK_TOKENS, leading_text_keys
from scheduler_svc.sampler import Logprob
from scheduler_svc.settings import SchedulerSettings

log = logging.getLogger(__name__)

# How often, at most, an idle rank looks at its heaps' free memory (`IdleHeap`).
IDLE_HEAP_CHECK_S = 2.0


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: Logprob | None = None  # when the request asked (SamplingParams.logprobs)
    cached_tokens: int = 0  # first token only: the prompt tokens taken from the prefix cache
    # First token only, when the request asked (SamplingParams.prompt_logprobs).
    prompt_logprobs: tuple[Logprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    reason: int  # common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, taken from the prefix cache


@dataclass(frozen=True)
class Failed:
    error: MmsplitError


Event = Token | Finished | Failed


@dataclass
class Admission:
    request: NewRequest
    # Delivers an event; called on the consumer's thread (see StepLoop.post).
    emit: Callable[[Event], None]
    # KV-cache tokens this request may come to hold: prompt + max_tokens, capped at the context.
    reserve: int
    # Rank 0's claims on the request's tensors (taken before Accepted),
    # released after the step that reads them.
    claims: list[Claim] = field(default_factory=list)
    generated: int = 0
    next_token: int | None = None
    cached_tokens: int = 0  # prompt tokens the engine took from the prefix cache
    # The prefix-cache keys of its prompt's text before any item (made on first use).
    lead: list[bytes] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def disown(self) -> None:
        """Refused before Accepted: the tensors stay their sender's."""
        for claim in self.claims:
            claim.disown()

    def release(self) -> None:
        """Let the request's tensors go (idempotent): every rank has read
        them once its first step is over, or it never runs."""
        for claim in self.claims:
            claim.release()


@dataclass(frozen=True)
class Snapshot:
    """What GetServerInfo reports; replaced whole by the loop thread each step."""

    running: int = 0
    queued: int = 0
    kv_reserved_tokens: int = 0


class IdleHeap:
    """A rank's heaps' free memory given back to the kernel, in the steps
    it runs with nothing to do (`mallocheap.Bound`). Freed large buffers
    (an item's model input, a big prefill's activations) stay in glibc's
    heaps whatever their thresholds: a rank that prefilled rounds of
    1920x1080 Qwen images held 270-580 MiB free of its ~1.1 GB at rest.
    Giving it back locks each heap while it runs (~1 ms with nothing new to
    give back, a few hundred for GBs of holes), so only in a heartbeat (an
    empty plan, which rank 0 sends after --heartbeat-s without work) while
    this rank holds no row and no prompt on its way in: every rank decides
    alone, and nothing it gives back changes what a step computes."""

    def __init__(self, limit: int) -> None:
        self.bound = mallocheap.Bound(limit) if limit else None
        self.returned = 0  # resident bytes given back (read by rank 0's metrics)
        self._checked = 0.0  # when it last looked (monotonic)

    def after(self, plan: Plan, engine: Engine) -> None:
        if self.bound is None or plan.new or plan.drop or plan.feed or plan.stop:
            return
        if engine.rows or engine.prefilling:
            return
        now = time.monotonic()
        if now - self._checked < IDLE_HEAP_CHECK_S:
            return  # `mallinfo2` walks the heaps: not at every heartbeat of a short --heartbeat-s
        self._checked = now
        self.returned += self.bound.check()


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class _Wake:
    """Nothing to do but run the next step now, not at the next heartbeat
    (draining: so that an idle loop says so at once)."""


def _leading(keys: list[bytes], present: Callable[[bytes], bool]) -> int:
    """How many of a chain's leading `keys` are `present`, by bisection: a
    block's key names all the text up to it, so wherever a key is present
    (a prefill's chain, the store, which evicts a chain's deepest blocks
    first) so are its parents'."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if present(keys[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _twin_hint(req: NewRequest, media: bool) -> tuple[object, ...] | None:
    """The engine's `twin_key` of `req` (prompts prefilled once, the others
    copying that row) as rank 0's planner can make it before any tensor is
    read: with the tokenizer's content hashes of the items for the engine's
    own digests. Only a hint for the prefill budget and for waiting: the
    engine decides by its digests, so a wrong hint costs a prefill past the
    budget, never a wrong token. None where an item has no hash, and for a
    prompt with items unless `media` (the engine digests items: `keys_items`)."""
    if req.items and not media:
        return None
    return twin_key(req, tuple(item.content_hash for item in req.items if item.content_hash))


@dataclass
class StepCosts:
    """Rank 0's recent step costs (exponential averages of the engine's
    phases), for `StepLoop._waits`: seconds a joining prompt token costs the
    prefill forward (media encoded apart: a request that waits encodes its
    own all the same), and seconds of a decode forward. None until seen."""

    per_token: float | None = None
    decode: float | None = None
    ALPHA = 0.2  # weight of the newest

    def observe(self, plan: Plan, outcome: StepOutcome, *, chunking: bool) -> None:
        """After a step. A step that queued or ran a long prompt's chunk is
        not counted for the prompt tokens (the chunk's own phase holds
        part of them)."""
        decode = outcome.phases.get("decode")
        if decode is not None and plan.feed:
            self.decode = self._mean(self.decode, decode)
        prefill = outcome.phases.get("prefill")
        if prefill is None or chunking:
            return
        tokens = sum(len(r.input_ids) - outcome.cached.get(r.request_id, 0)
                     for r in plan.new if r.request_id not in outcome.failed)  # fmt: skip
        if tokens:
            self.per_token = self._mean(self.per_token, prefill / tokens)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)


@dataclass
class _Prefills:
    """Leading-text block keys of the running requests' prompts (`StepLoop._waits`)."""

    computing: set[bytes] = field(default_factory=set)  # prefills under way: this step's, or in chunks
    kept: set[bytes] = field(default_factory=set)  # prefilled last step: in the store before this step's matches


class StepLoop:
    def __init__(
        self,
        engine: Engine,
        coll: Collective,
        settings: SchedulerSettings,
        *,
        eos_token_ids: frozenset[int],
        max_context: int,
        kv_budget_tokens: int,
        post: Callable[[Callable[[], None]], None],
        on_fatal: Callable[[BaseException], None],
        heap: IdleHeap | None = None,
    ) -> None:
        self.engine = engine
        self.heap = heap if heap is not None else IdleHeap(settings.heap_free_limit_bytes)
        self.coll = coll
        self.settings = settings
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.kv_budget_tokens = kv_budget_tokens
        self.post = post
        self.on_fatal = on_fatal
        self.inbox: queue.SimpleQueue[Admission | _Abort | _Stop | _Wake] = queue.SimpleQueue()
        self._queued = 0  # admissions in the inbox or pending; guarded by _lock
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        # Loop-thread state.
        self._pending: deque[Admission] = deque()
        self._running: dict[str, Admission] = {}
        self._joining: list[Admission] = []  # admitted into the step that is running
        self._drop: list[str] = []
        # Of the next drops, those whose KV the prefix cache may keep.
        self._keep: dict[str, Admission] = {}
        self._aborted: set[str] = set()
        self._outbox: list[tuple[Admission, Event]] = []
        self._stopping = False
        self._draining = False
        # Set by the loop thread once draining and nothing is queued or running.
        self.idle = threading.Event()
        self._step = 0
        self._last_sweep = 0.0
        # For metrics (read from other threads; plain ints, written here only).
        self.failures_by_rank: list[int] = [0] * coll.world_size  # requests that failed agreement, by rank
        self.janitor_removed = 0
        self.waited_for_prefix = 0  # steps requests waited for a prefill of the text they start with
        self.costs = StepCosts()
        self._stats = _Stats(time.monotonic())
        self.active_per_rank: list[int] = [0] * coll.world_size
        self.snapshot = Snapshot()
        # When the step now running started (time.monotonic), None between
        # steps: the watchdog's view of progress. A plain float assignment,
        # read from another thread.
        self.step_started: float | None = None
        # Called on the loop thread after each step with (seconds, rows
        # running): the metrics' hook.
        self.on_step: Callable[[float, int], None] | None = None

    # ---- any thread ----
    def submit(self, admission: Admission) -> None:
        with self._lock:
            if self._dead is not None:
                raise SchedulerUnavailable("the scheduler group is down; retry after it restarts")
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
        self.inbox.put(_Wake())

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
                plan = self._plan()
                started = self.step_started = time.monotonic()
                self.coll.broadcast_from_0(plan)
                outcome = self.engine.step(plan)
                self.costs.observe(plan, outcome, chunking=self.engine.prefilling)
                self.active_per_rank = outcome.active_per_rank
                if len(set(outcome.active_per_rank)) > 1:
                    raise RuntimeError(f"ranks diverged: active requests per rank {outcome.active_per_rank}")
                for rid in self._aborted.intersection(plan.drop):
                    log.info("request %s aborted on all %d ranks", rid, self.coll.world_size)
                self._aborted.difference_update(plan.drop)
                for rid, cached in outcome.cached.items():
                    if (adm := self._running.get(rid) or self._joined(rid)) is not None:
                        adm.cached_tokens = cached
                self._settle(outcome)
                self._flush()
                self.step_started = None
                took = time.monotonic() - started
                self.heap.after(plan, self.engine)
                self._stats.step(took, len(self._running), len(outcome.sampled), outcome.phases)
                if self.on_step is not None:
                    self.on_step(took, len(self._running))
                self._report()
                if plan.stop:
                    return
                with self._lock:
                    if self._draining and self._queued == 0 and not self._running:
                        self.idle.set()
        except BaseException as exc:
            log.exception("step loop failed at step %d; the group is down", self._step)
            with self._lock:
                self._dead = exc
            self._fail_all(SchedulerUnavailable("the scheduler group failed; retry after it restarts"))
            self._flush()
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
                self._enqueue(item)
            elif isinstance(item, _Abort):
                self._abort(item.request_id)
            elif isinstance(item, _Wake):
                pass
            else:
                self._stopping = True
                self._fail_all(ShuttingDown("scheduler is shutting down"))

    def _enqueue(self, admission: Admission) -> None:
        """Behind every queued request of its priority or a lower value
        (all 0 under --scheduling-policy fcfs: arrival order)."""
        pending, priority = self._pending, admission.request.priority
        at = len(pending)
        while at and pending[at - 1].request.priority > priority:
            at -= 1
        pending.insert(at, admission)

    def _janitor(self) -> None:
        """Sweep the segments of the prefix that nobody holds a lock on (a
        tokenizer killed mid-request, an earlier scheduler that died with
        requests queued): queued requests' segments are locked by this
        process, so they stay."""
        now = time.monotonic()
        if now - self._last_sweep < self.settings.janitor_interval_s:
            return
        self._last_sweep = now
        try:
            removed = files.sweep(self.settings.shm_prefix, grace_s=self.settings.segment_grace_s)
        except Exception:
            # Housekeeping: a sweep that fails (no descriptor left to list
            # /dev/shm with, say) is tried again next interval; it must not
            # take the group down, as an exception in this thread would.
            log.exception("the janitor's sweep failed; trying again in %gs", self.settings.janitor_interval_s)
            return
        self.janitor_removed += len(removed)

    def _abort(self, request_id: str) -> None:
        for adm in self._pending:
            if adm.request_id == request_id:
                self._pending.remove(adm)
                self._dequeued(1)
                adm.release()
                log.info("request %s aborted before its first step; segments released", request_id)
                return
        if request_id in self._running:
            self._drop.append(request_id)
            self._keep[request_id] = self._running.pop(request_id)  # its KV is sound: later turns may use it
            self._aborted.add(request_id)

    def _plan(self) -> Plan:
        """Admit from the head of the queue (first come, first served: a
        request that does not fit yet is not overtaken) while the rows, the
        step's prefill tokens and the KV budget allow. The one exception: a
        request whose prompt starts with text that a request still being
        prefilled is computing waits for it (`_waits`), keeping its place,
        and the requests behind it may pass it meanwhile. A request whose
        whole prompt is one this step prefills, or one under way in chunks
        (`_twin_hint`: the n choices of a request, say), neither waits nor
        counts against the prefill tokens: it joins that prefill."""
        s = self.settings
        rows = len(self._running)
        longest = max((a.reserve for a in self._running.values()), default=0)
        widest = prefilled = 0
        admitted: list[Admission] = []
        waiting: list[Admission] = []
        prefilling = self._prefilling() if self._pending else None
        sharing = bool(self._pending) and self.engine.share_prefills
        twins = self._under_way() if sharing else set()
        while self._pending and len(admitted) < s.max_new_per_step and rows < s.max_running:
            head = self._pending[0]
            hint = _twin_hint(head.request, self.engine.keys_items) if sharing else None
            twin = bool(twins) and hint in twins
            if not twin and prefilling is not None and self._waits(head, prefilling):
                waiting.append(self._pending.popleft())
                if len(waiting) == s.max_new_per_step:
                    break  # a long queue of them: the plan looks no further
                continue
            prompt = len(head.request.input_ids)
            # A prefill forward is right-padded to its longest prompt; one
            # request alone is always allowed, however long. A twin of a
            # prompt prefilled with this step or under way in chunks adds
            # nothing to it: the engine copies that one's row.
            if not twin and prefilled and (prefilled + 1) * max(widest, prompt) > s.max_prefill_tokens:
                break
            if (rows + 1) * max(longest, head.reserve) > self.kv_budget_tokens:
                break
            admitted.append(self._pending.popleft())
            if prefilling is not None:
                prefilling.computing.update(self._lead(head))
            rows += 1
            longest = max(longest, head.reserve)
            if not twin:
                prefilled += 1
                widest = max(widest, prompt)
                if hint is not None:
                    twins.add(hint)
        if waiting:
            self._pending.extendleft(reversed(waiting))
            self.waited_for_prefix += len(waiting)
            log.debug("step %d: %s wait for a prefill of the text they start with", self._step + 1,
                      [a.request_id for a in waiting])  # fmt: skip
        self._dequeued(len(admitted))
        self._joining = admitted
        feed = tuple((rid, adm.next_token) for rid, adm in self._running.items() if adm.next_token is not None)
        self._step += 1
        plan = Plan(
            step=self._step,
            new=tuple(a.request for a in admitted),
            drop=tuple(self._drop),
            feed=feed,  # type: ignore[arg-type]
            stop=self._stopping,
            keep=tuple(self._keep),
        )
        self._drop, self._keep = [], {}
        if admitted:
            log.debug("step %d admits %s", plan.step, [a.request_id for a in admitted])
        return plan

    def _under_way(self) -> set[tuple[object, ...]]:
        """The twin hints of the long prompts being prefilled in chunks (no
        token yet): a request sent again meanwhile follows their chunks."""
        return {
            hint
            for adm in self._running.values()
            if adm.generated == 0 and (hint := _twin_hint(adm.request, self.engine.keys_items)) is not None
        }

    def _prefilling(self) -> _Prefills | None:
        """What the requests running now will have put in the prefix cache
        by this plan's matches, and what they are still computing; None
        when no request is to wait for them."""
        if not (self.settings.wait_for_shared_prefix and self.engine.prefix_cache.enabled):
            return None
        prefills = _Prefills()
        for adm in self._running.values():
            if adm.generated == 0:  # a long prompt, in chunks: no token yet
                prefills.computing.update(self._lead(adm))
            elif adm.generated == 1:  # prefilled last step: kept as this step starts (`Engine._keep_prefilled`)
                prefills.kept.update(self._lead(adm))
        for adm in self._keep.values():  # leaving (finished at its first token, say): kept as this step starts
            prefills.kept.update(self._lead(adm))
        return prefills

    def _waits(self, adm: Admission, prefills: _Prefills) -> bool:
        """Whether `adm` should wait a step: at least --wait-for-shared-prefix
        tokens of its prompt's leading text are being computed by a prefill
        (of this step, or in chunks), will not be in the prefix cache when
        this step's matches are made, and fit in it; and computing them
        again has lately cost more than a decode forward (about what the
        wait adds to its first token: on a small or fast model a shared
        prefix is cheaper to compute twice than to wait for). The step
        after that prefill its blocks are kept before the step's matches,
        so `adm` then takes them. (A store too small for them would have a
        burst of such requests admitted one a step, each waiting for the
        last.)"""
        if adm.request.sampling.prompt_logprobs is not None:
            return False  # it takes nothing from the cache (`Engine._match`)
        keys = self._lead(adm)
        least = -(-self.settings.wait_for_shared_prefix // BLOCK_TOKENS)
        shared = _leading(keys, prefills.computing.__contains__)
        if shared < least:
            return False
        store = self.engine.prefix_cache
        if shared * store.block_bytes > store.capacity:
            return False  # the store could not keep them all: waiting would buy nothing
        kept = _leading(keys[:shared], prefills.kept.__contains__)
        computed = shared - max(kept, _leading(keys[:shared], store.holds))
        if computed < least:
            return False
        costs = self.costs
        if costs.per_token is None or costs.decode is None:
            return True  # nothing measured yet (a burst at start-up): wait
        return computed * BLOCK_TOKENS * costs.per_token > costs.decode

    @staticmethod
    def _lead(adm: Admission) -> list[bytes]:
        if adm.lead is None:
            req = adm.request
            first = min((item.span[0] for item in req.items if item.placeholders), default=None)
            adm.lead = leading_text_keys(req.input_ids, first, req.cache_salt)
        return adm.lead

    def _settle(
        self,
        outcome: StepOutcome,
    ) -> None:
        failed, sampled, rejected, logprobs = outcome.failed, outcome.sampled, outcome.rejected, outcome.logprobs
        for adm in self._joining:
            adm.release()  # every rank has read the step's tensors
            failure = failed.get(adm.request_id)
            if failure is None:
                self._running[adm.request_id] = adm
                continue
            for rank in failure.ranks:
                self.failures_by_rank[rank] += 1
            ranks = ",".join(str(r) for r in failure.ranks)
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failure.messages.items()))
            others = [a.request_id for a in self._joining if a is not adm]
            log.warning(
                "step %d: request %s failed on rank(s) %s, aborted on all ranks (joined with %s%s): %s",
                self._step,
                adm.request_id,
                ranks,
                others[:8],
                " and more" if len(others) > 8 else "",
                detail,
            )
            error = error_for_code(failure.code, detail or "tensor read failed", {"failed_ranks": ranks})
            self._outbox.append((adm, Failed(error)))
        self._joining = []
        # Running requests that end here, on every rank (a failed decode or
        # chunk) or on rank 0 only (sampling): each fails typed and the next
        # plan drops it everywhere.
        ending = {rid: error_for_code(f.code, "; ".join(m for _, m in sorted(f.messages.items())) or "its step failed")
                  for rid, f in outcome.ended.items()}  # fmt: skip
        ending |= {rid: why if isinstance(why, MmsplitError) else InternalError(why) for rid, why in rejected.items()}
        for rid, error in ending.items():
            gone = self._running.pop(rid, None)
            if gone is None:  # aborted while this step ran; already queued for dropping
                continue
            log.warning("request %s failed and is dropped on every rank: %s", rid, error.message)
            self._outbox.append((gone, Failed(error)))
            self._drop.append(rid)
        for rid, token in sampled.items():
            running = self._running.get(rid)
            if running is None:
                continue
            adm = running
            adm.generated += 1
            cached = adm.cached_tokens if adm.generated == 1 else 0
            scores = outcome.prompt_logprobs.get(rid)
            self._outbox.append(
                (adm, Token(token, logprobs.get(rid), cached, None if scores is None else tuple(scores)))
            )
            reason = self._finish_reason(adm, token)
            if reason is None:
                adm.next_token = token
                continue
            prompt = len(adm.request.input_ids)
            self._outbox.append((adm, Finished(reason, prompt, adm.generated, adm.cached_tokens)))
            del self._running[rid]
            self._drop.append(rid)
            self._keep[rid] = adm

    def _joined(self, rid: str) -> Admission | None:
        """The admission of this step's joiner `rid` (None if it is not one)."""
        return next((adm for adm in self._joining if adm.request_id == rid), None)

    def _finish_reason(self, adm: Admission, token: int) -> int | None:
        # The sampler never draws these before min_tokens.
        sampling = adm.request.sampling
        if (token in self.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            return common_pb2.FINISH_REASON_STOP
        if adm.generated >= adm.request.sampling.max_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        if len(adm.request.input_ids) + adm.generated >= self.max_context:
            return common_pb2.FINISH_REASON_CONTEXT_LENGTH
        return None

    def _flush(self) -> None:
        """Hand this step's events to the consumer's thread in one call."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []

        def deliver() -> None:
            for adm, event in batch:
                adm.emit(event)

        self.post(deliver)

    def _report(self) -> None:
        running = len(self._running)
        longest = max((a.reserve for a in self._running.values()), default=0)
        self.snapshot = Snapshot(running=running, queued=len(self._pending), kv_reserved_tokens=running * longest)
        line = self._stats.line(time.monotonic(), self.settings.stats_interval_s)
        if line:
            s = self.snapshot
            log.info(
                "%s; running %d, queued %d, KV reserved %d of %d tokens",
                line,
                s.running,
                s.queued,
                s.kv_reserved_tokens,
                self.kv_budget_tokens,
            )

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _fail_all(self, error: MmsplitError) -> None:
        """Fail every pending, joining and running request; release what rank 0 still owns."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Admission):
                self._pending.append(item)
        for adm in self._pending:
            adm.release()
            self._outbox.append((adm, Failed(error)))
        self._dequeued(len(self._pending))
        self._pending.clear()
        # Requests of the step that failed: their segments were released by
        # the engine after the agreement, or are released here (idempotent).
        for adm in self._joining:
            adm.release()
            self._outbox.append((adm, Failed(error)))
        self._joining = []
        for rid, adm in self._running.items():
            self._outbox.append((adm, Failed(error)))
            self._drop.append(rid)
        self._running.clear()


class _Stats:
    """Step statistics, logged every `stats_interval_s` instead of a line per step."""

    def __init__(self, now: float) -> None:
        self._reset(now)

    def _reset(self, now: float) -> None:
        self._since = now
        self._steps = 0
        self._busy_s = 0.0
        self._rows = 0
        self._tokens = 0
        self._phases: dict[str, float] = {}

    def step(self, seconds: float, rows: int, tokens: int, phases: dict[str, float]) -> None:
        if tokens == 0 and rows == 0:
            return  # heartbeat
        self._steps += 1
        self._busy_s += seconds
        self._rows += rows
        self._tokens += tokens
        for phase, spent in phases.items():
            self._phases[phase] = self._phases.get(phase, 0.0) + spent

    def line(self, now: float, interval_s: float) -> str:
        elapsed = now - self._since
        if elapsed < interval_s or self._steps == 0:
            return ""
        per_step = ", ".join(f"{phase} {1000 * spent / self._steps:.1f}" for phase, spent in self._phases.items())
        text = (
            f"{self._steps / elapsed:.1f} steps/s, {self._tokens / elapsed:.0f} tokens/s, "
            f"mean batch {self._rows / self._steps:.1f}, mean step {1000 * self._busy_s / self._steps:.1f} ms "
            f"({per_step})"
        )
        self._reset(now)
        return text


def run_follower(engine: Engine, coll: Collective, heap: IdleHeap | None = None) -> None:
    """Ranks other than 0: run rank 0's plans until told to stop."""
    while True:
        plan: Plan = coll.broadcast_from_0(None)
        engine.step(plan)
        if heap is not None:
            heap.after(plan, engine)
        if plan.stop:
            return
