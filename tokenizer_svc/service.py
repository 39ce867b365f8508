"""One request end to end: fetch and preprocess the images and videos, build
the prompt, call the scheduler, relay its stream as text.

Ownership of what the media were placed in (DESIGN.md §3; the hand-off's
interface is `mmsplit_server.handoff.reference`): slab slices and one-off
segments are ours — this process holds a claim on each — until the
scheduler, holding its own, sends `Accepted`; then we disown ours. Before
that, whatever ends the request (an error, a broken stream, the client's
cancel) releases them here. After it, the scheduler releases them.

Every reference to shared or GPU memory is granted to its request
(`mmsplit_server.handoff.grants`): the scheduler reads nothing a reference names
unless our grant table vouches for it, and we end the request's grants at
its first token (every rank has read its tensors by then) or its end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError, RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server import families, structured
from mmsplit_server.families import PixelBudget, TileBudget
from mmsplit_server.handoff import cuda_ipc, files, grants, ranges, reference
from mmsplit_server.handoff.reference import DTYPE_BY_NAME, CudaRef, TensorSpec
from mmsplit_server.sampling import InvalidSampling, Sampling
from mmsplit_server.serving import Handed
from tokenizer_svc import beam_search, reasoning, tool_calls
from tokenizer_svc.bad_words import token_sequences
from tokenizer_svc.cache import PreprocessCache, fingerprint
from tokenizer_svc.conversation import (
    ITEMS,
    MAX_CACHE_SALT,
    MAX_CHOICES,
    PREPARED_ONCE,
    Located,
    Parsed,
    VideoSampling,
    choice_request,
    parse,
    without,
)
from tokenizer_svc.detokenize import StopMatcher, make_decoder, stream_text
from tokenizer_svc.downstream import SchedulerLink, Schedulers
from tokenizer_svc.errors import (
    InternalError,
    InvalidRequest,
    Overloaded,
    PreprocessWorkerCrashed,
    SchedulerUnavailable,
    ShuttingDown,
)
from tokenizer_svc.media import MediaLoader
from tokenizer_svc.pool import CpuPool
from tokenizer_svc.preprocess import (
    PLAIN_ROWS,
    STAGES,
    ImageJob,
    ItemResult,
    ItemTensor,
    Job,
    RowForm,
    SlabRef,
    VideoJob,
    abandon,
    most_pixels,
    place,
    too_large,
)
from tokenizer_svc.prompt import BuiltPrompt, Media, PromptBuilder, Rendered, truncated
from tokenizer_svc.settings import TokenizerSettings
from tokenizer_svc.tool_calls import Auto, Forced

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# A call that ended with one of these before the scheduler accepted it goes
# to another backend (once).
FAILOVER_CODES = frozenset({E.ERROR_CODE_SCHEDULER_UNAVAILABLE, E.ERROR_CODE_SHUTTING_DOWN})
# A prompt (Parsed.size) that takes several milliseconds to build (~5 ms at
# 16,384 characters): built one per turn of the event loop (`_built`).
BIG_PROMPT = 16_384


@dataclass(frozen=True)
class ItemAsk:
    """How a request's images and videos are to be made: the rows' form
    its backend takes (`Assigned.form`), the request's own image budget
    (`Parsed.image_pixels`), the largest tensor the backend takes
    (ServerInfo.max_tensor_bytes; 0: unchecked, as for Tokenize), and the
    request's own video sampling."""

    form: RowForm = PLAIN_ROWS
    pixels: PixelBudget | None = None
    max_bytes: int = 0
    video: VideoSampling | None = None  # the request's own video sampling (`Parsed.video_sampling`)
    tiles: TileBudget | None = None  # the request's own bounds on an image's tiles (`Parsed.image_tiles`)


class TokenizerService:
    def __init__(
        self,
        settings: TokenizerSettings,
        family: families.Family,
        tokenizer: Any,
        media: MediaLoader,
        pool: CpuPool,
        link: Schedulers,
        *,
        chat_template: str | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.family = family
        # --reasoning-parser, for GenerateRequest.split_reasoning (the HTTP API keeps its own).
        parser = reasoning.PARSERS.get(settings.reasoning_parser)
        self.reasoning = parser(tokenizer) if parser is not None else None
        self.prompts = PromptBuilder(family, tokenizer, chat_template)
        # Big prompts are built one per turn of the event loop (`_built`).
        self._one_big_prompt_at_a_time = asyncio.Lock()
        self.cache = PreprocessCache(settings.preprocess_cache_bytes, fingerprint(settings.model_dir))
        # Counted for the metrics.
        self.preprocessed = 0
        self.preprocess_s = 0.0
        # What workers spent per stage (`preprocess.STAGES`), summed over items.
        self.worker_s = dict.fromkeys(STAGES, 0.0)
        self.janitor_removed = 0
        self.heap_returned = 0  # resident bytes the heaps gave back (`mallocheap.Bound`)
        self.media = media
        self.pool = pool
        self.link = link
        self.inflight = 0
        # Items being preprocessed, by cache key: done when the work ends,
        # for requests that want the same one; True when it was made (kept
        # in the cache, or too large for it), False when it failed.
        self._under_way: dict[bytes, asyncio.Future[bool]] = {}
        # Requests in progress by client, for --max-inflight-per-client
        # (a client with none has no entry: it holds only active clients).
        self.inflight_by_client: collections.Counter[str] = collections.Counter()
        self.refused_per_client = 0
        # Draining for shutdown: new requests are refused; `idle` is set when
        # the last running one ends; `tasks` lets the server end stragglers.
        self.draining = False
        self.idle = asyncio.Event()
        self.tasks: set[asyncio.Task[Any]] = set()
        # Segments this process owns right now (written, not yet accepted
        # downstream): the janitor must not take them for orphans.
        self.held: set[str] = set()
        self._pid = os.getpid()
        # Created on the first shared-memory request (`_slab_ref`): a
        # tokenizer whose schedulers all take bytes inline never touches /dev/shm.
        self.slab: ranges.Slab | None = None
        # The GPU staging pool of the CUDA-IPC transport (`start_device_pool`).
        self.device_pool: cuda_ipc.DevicePool | None = None
        # The slab's making, once begun: a task of its own (`_slab_ref`).
        self._slab_making: asyncio.Task[None] | None = None
        self._slab_failed = False
        # Made with the first reference to shared or GPU memory (`_grant`).
        self.grants: grants.GrantTable | None = None
        # Downstream request ids: unique to this process's life, so clients
        # that pick the same request_id never collide at the scheduler.
        self.instance = secrets.token_hex(4)
        self._ids = itertools.count(1)

    async def generate(
        self,
        request: Handed[tokenizer_pb2.GenerateRequest] | tokenizer_pb2.GenerateRequest,
        request_id: str,
        timeout_s: float | None,
        client: str = "",
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        """`request`'s responses; `client` names who sent it (what
        --max-inflight-per-client counts by; "" counts nowhere). A request
        handed over (`Handed`) is taken: once its media are prepared and
        its prompt built, the request is kept without them
        (`PREPARED_ONCE`), and the message with its media's bytes goes
        while the answer streams (a request given as is stays its giver's)."""
        given: Handed[tokenizer_pb2.GenerateRequest] = Handed.of(request)
        del request
        n = given.request.n or 1
        with self._admitted(client):
            if n > MAX_CHOICES:
                raise InvalidRequest(f"n {n} is over the limit {MAX_CHOICES}", metadata={"param": "n"})
            if given.request.HasField("beam_search"):
                source = self._beams(given, request_id, timeout_s)
            elif n == 1:
                source = self._generate(given, request_id, timeout_s)
            else:
                source = self._choices(given, request_id, timeout_s, n)
            async for response in self._run_in_own_task(source):
                yield response

    @contextlib.contextmanager
    def _admitted(self, client: str) -> Iterator[None]:
        """One request's work, counted against --max-inflight and its
        client's share, --max-inflight-per-client (refused while draining
        or at either limit); the last to end while draining says so."""
        if self.draining:
            raise ShuttingDown("this tokenizer is shutting down; retry on another replica")
        if self.inflight >= self.settings.max_inflight:
            raise Overloaded(f"{self.inflight} requests in flight, the limit is {self.settings.max_inflight}")
        per_client = self.settings.max_inflight_per_client
        if per_client and client and self.inflight_by_client[client] >= per_client:
            self.refused_per_client += 1
            raise Overloaded(
                f"this client has {self.inflight_by_client[client]} requests in flight, the limit per client is "
                f"{per_client}"
            )
        self.inflight += 1
        if client:
            self.inflight_by_client[client] += 1
        try:
            yield
        finally:
            self.inflight -= 1
            if client:
                self.inflight_by_client[client] -= 1
                if not self.inflight_by_client[client]:
                    del self.inflight_by_client[client]
            if self.draining and self.inflight == 0:
                self.idle.set()

    async def _run_in_own_task(
        self, source: AsyncGenerator[tokenizer_pb2.GenerateResponse, None]
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        """Drive `source` in a task of our own, so a forced stop can cancel
        the request's work without cancelling gRPC's handler task (which
        would end the RPC with an untyped status), and relay its responses.
        When our consumer is cancelled (client cancel, deadline), the work is
        cancelled too and its cleanup awaited."""
        # Unbounded: what one request can queue is bounded by its max_tokens.
        queue: asyncio.Queue[tokenizer_pb2.GenerateResponse | None] = asyncio.Queue()

        async def produce() -> None:
            # aclosing: a cancelled request closes its source (and with it the
            # downstream call) now, not whenever the generator is collected.
            async with contextlib.aclosing(source):
                async for response in source:
                    queue.put_nowait(response)

        task = asyncio.create_task(produce())
        # However the work ends (done, failed, cancelled), None follows its
        # last response; one await per response, nothing else per message.
        task.add_done_callback(lambda _: queue.put_nowait(None))
        self.tasks.add(task)
        try:
            ended = False
            while not ended:
                # What queued up while the last response was being written
                # goes out joined: a client that fell behind catches up a
                # message at a time, not a token at a time.
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in joined_deltas(items):
                    if item is None:
                        ended = True
                        break
                    yield item
            if task.cancelled():
                raise ShuttingDown("the tokenizer shut down while this request ran")
            task.result()  # the request's error, if it failed
        finally:
            try:
                if not task.done():
                    task.cancel()
                    await _settle([task])
                elif not task.cancelled():
                    # Our caller went away (its deadline, say) just as the work
                    # failed (the same deadline, downstream): nobody raises that
                    # failure now, and unread it would be logged as "Task
                    # exception was never retrieved" when the task is collected.
                    task.exception()
            finally:
                self.tasks.discard(task)
                # Raised from here, a failure's traceback holds this frame, and
                # the frame's `task` holds the failure: a reference cycle that
                # kept every frame of the request alive, with its locals (its
                # body, a data: URL's megabytes), until a full collection.
                del task

    async def _choices(
        self, given: Handed[tokenizer_pb2.GenerateRequest], rid: str, timeout_s: float | None, n: int
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        """n independent generations at once, each response tagged with its
        choice; the first failure ends them all (the others are cancelled
        and their cleanup awaited) and is raised (`merged`). The media are
        fetched and preprocessed once and the prompt built once: each
        choice's scheduler request gets its own copy of the media, as a
        beam search's steps do (the scheduler then prefills the prompt once
        for the choices that join one step: `Engine._prefill`)."""
        request = given.take()
        parsed = await self._checked(request)
        backend = self._backend()
        items, prompt = await self._media_once(request, parsed, rid, backend)
        request, parsed = _prepared(request, parsed)
        form = backend.row_form(self.family)
        # A list of the media for each choice, let go once its copy is made:
        # the media are not kept while the answers stream.
        shares = [list(items) for _ in range(n)]
        del items

        async def one(i: int) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
            sent = self._with_copies(choice_request(request, i), parsed, rid, timeout_s, Assigned(backend, form),
                                     shares.pop(), prompt, parsed.calls)  # fmt: skip
            async with contextlib.aclosing(sent) as responses:
                async for response in responses:
                    response.index = i
                    yield response

        async with contextlib.aclosing(merged([one(i) for i in range(n)])) as responses:
            async for response in responses:
                yield response

    async def _media_once(
        self, request: tokenizer_pb2.GenerateRequest, parsed: Parsed, rid: str, backend: SchedulerLink
    ) -> tuple[list[ItemResult], BuiltPrompt]:
        """For a request that sends several scheduler requests to `backend`
        (n choices, a beam search's steps): its media preprocessed once, as
        bytes (each scheduler request gets its own copy: `_copies`), and its
        prompt."""
        info = backend.info
        ask = _ask(backend.row_form(self.family), parsed, info)
        inline = common_pb2.TRANSPORT_INLINE
        prepared, prompt = await self._media_and_prompt(request, parsed, rid, inline, ask, info)
        _release(prepared)  # bytes: nothing shared is held
        return [p.result for p in prepared], prompt

    async def _beams(
        self, given: Handed[tokenizer_pb2.GenerateRequest], rid: str, timeout_s: float | None
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        """Beam search (GenerateRequest.beam_search; `tokenizer_svc.beam_search`
        picks the beams): the media fetched and preprocessed once, then a
        step at a time one token of every live beam asked of the scheduler,
        each with its own copy of the media; the n best beams answered as
        choices when the search ends."""
        request = given.take()
        width = request.n or 1
        penalty = beam_search.checked(request)
        parsed = self._validate(request)
        if parsed.tool_schema:
            raise InvalidRequest(
                "tool_choice required or a named function cannot go with beam search (the calls are constrained "
                "as structured output is)",
                metadata={"param": "tool_choice"},
            )
        backend = self._backend()
        info = backend.info
        if info is None or not info.default_max_tokens:
            raise SchedulerUnavailable(
                "the scheduler does not say its end-of-sequence tokens (a version before beam search); retry shortly",
                retry_after_ms=self.settings.unavailable_retry_after_ms,
            )
        max_tokens = request.sampling.max_tokens or info.default_max_tokens
        if max_tokens > info.max_tokens_limit:
            raise InvalidSampling(f"sampling.max_tokens {max_tokens} is over the limit {info.max_tokens_limit}")
        ends = frozenset(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            ends |= frozenset(info.eos_token_ids)
        items, prompt = await self._media_once(request, parsed, rid, backend)
        request, parsed = _prepared(request, parsed)
        form = backend.row_form(self.family)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        context = info.max_context_tokens
        steps = min(max_tokens, context - len(prompt.input_ids)) if context else max_tokens
        search = beam_search.Search(width, penalty, ends)
        cached = step = 0
        reason = common_pb2.FINISH_REASON_LENGTH if steps == max_tokens else common_pb2.FINISH_REASON_CONTEXT_LENGTH
        # One step at least (`last` ends the search): a prompt that fills
        # the context is the scheduler's to refuse.
        while not search.over:
            sub = beam_search.step_request(request, search.k, step)
            asks = [
                self._beam_step(sub, parsed, rid, deadline, Assigned(backend, form), prompt, items, beam)
                for beam in search.live
            ]
            tasks = [asyncio.create_task(a) for a in asks]
            try:
                answers = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await _settle(tasks)
                raise
            cached = cached or answers[0][1]
            step += 1
            search.advance([entry for entry, _ in answers], last=step >= steps, last_reason=reason)
        for i, beam in enumerate(search.best()):
            for response in self._beam_answer(request, rid, parsed, prompt, beam, cached):
                response.index = i
                yield response

    async def _beam_step(
        self,
        sub: tokenizer_pb2.GenerateRequest,
        parsed: Parsed,
        rid: str,
        deadline: float | None,
        assigned: Assigned,
        prompt: BuiltPrompt,
        items: list[ItemResult],
        beam: beam_search.Beam,
    ) -> tuple[common_pb2.TokenLogprob, int]:
        """`beam`'s next-token alternatives (and the prompt tokens the
        scheduler took from its prefix cache): one token of `sub` asked for
        the prompt followed by the beam's tokens."""
        timeout_s = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        grown = dataclasses.replace(prompt, input_ids=[*prompt.input_ids, *beam.tokens])
        entry, cached = None, 0
        sent = self._with_copies(sub, parsed, rid, timeout_s, assigned, items, grown, None, search_step=True)
        async with contextlib.aclosing(sent) as responses:
            async for response in responses:
                if response.HasField("delta") and response.delta.logprobs:
                    entry = response.delta.logprobs[0]
                elif response.HasField("finished"):
                    cached = response.finished.cached_tokens
        if entry is None:
            raise InternalError("the scheduler answered a beam's step with no log probabilities")
        return entry, cached

    async def _with_copies(
        self,
        request: tokenizer_pb2.GenerateRequest,
        parsed: Parsed,
        rid: str,
        timeout_s: float | None,
        assigned: Assigned,
        items: list[ItemResult],
        prompt: BuiltPrompt,
        calls: Forced | Auto | None,
        *,
        search_step: bool = False,
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        """One of several scheduler requests of a request whose media were
        prepared once (`_media_once`: n choices, a beam search's steps):
        `prompt` sent with its own copy of `items` (`_handed`), counted on
        its backend; the copy released at the end."""
        with self._counted(assigned):
            transport = assigned.backend.transport
            prepared = await self._copies(items, transport)
            del items  # (the caller's to keep, a beam search's for its next step)
            handed = self._handed(
                request, parsed, rid, timeout_s, assigned, transport, prepared, prompt, calls, search_step=search_step
            )
            async with contextlib.aclosing(_released_after(handed, prepared)) as responses:
                async for response in responses:
                    yield response

    async def _copies(self, items: list[ItemResult], transport: int) -> list[Prepared]:
        """`items` (preprocessed, as bytes) ready to hand over by `transport`,
        as a preprocessing cache hit is (`_one`)."""
        inline = transport != common_pb2.TRANSPORT_SHM
        slab_ref = None if inline else await self._slab_ref()
        prepared: list[Prepared] = []
        try:
            for item in items:
                if transport == common_pb2.TRANSPORT_CUDA_IPC:
                    result = await self._off_loop(self._stage, item)
                else:
                    result = await self._off_loop(self._materialize, item, inline, slab_ref)
                prepared.append(self._hold(result))
        except BaseException:
            _release(prepared)
            raise
        return prepared

    def _beam_answer(
        self,
        request: tokenizer_pb2.GenerateRequest,
        rid: str,
        parsed: Parsed,
        prompt: BuiltPrompt,
        beam: beam_search.Beam,
        cached: int,
    ) -> Iterator[tokenizer_pb2.GenerateResponse]:
        """One chosen beam as a choice's responses: its prompt's ids when
        asked, its text in one delta, its Finished (with the calls in it
        under tool_choice auto)."""
        if request.return_prompt_token_ids:
            read = tokenizer_pb2.PromptTokens(token_ids=prompt.input_ids)
            yield tokenizer_pb2.GenerateResponse(request_id=rid, prompt_tokens=read)
        decoder = make_decoder(self.tokenizer, skip_special_tokens=not request.keep_special_tokens)
        text = decoder.push(list(beam.tokens)) + decoder.flush()  # as a stream of it reads
        delta = tokenizer_pb2.TextDelta(text=text, token_ids=beam.tokens)
        if request.sampling.logprobs:
            top = request.sampling.top_logprobs
            for entry in beam.logprobs:
                ids, lps = entry.top_token_ids[:top], entry.top_logprobs[:top]
                delta.logprobs.add(logprob=entry.logprob, top_token_ids=ids, top_logprobs=lps)
        yield tokenizer_pb2.GenerateResponse(request_id=rid, delta=delta)
        done = _finished(rid, beam.finish_reason, len(prompt.input_ids), len(beam.tokens), cached)
        yield _with_calls(done, parsed.calls, text, self._thought(request, prompt.input_ids, request.sampling))

    def begin_drain(self) -> None:
        self.draining = True
        if self.inflight == 0:
            self.idle.set()

    def force_stop(self) -> list[asyncio.Task[Any]]:
        """End the requests still running after the grace period: their work
        is cancelled (releasing what it holds) and they fail SHUTTING_DOWN."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def _generate(
        self, given: Handed[tokenizer_pb2.GenerateRequest], rid: str, timeout_s: float | None
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        request = given.take()
        parsed = await self._checked(request)
        # The backend first: whether its media go by shared memory or inline
        # depends on where it is.
        backend = self._backend()
        with self._counted(Assigned(backend, backend.row_form(self.family))) as assigned:
            info, transport = backend.info, backend.transport
            ask = _ask(assigned.form, parsed, info)
            prepared, prompt = await self._media_and_prompt(request, parsed, rid, transport, ask, info)
            request, parsed = _prepared(request, parsed)
            handed = self._handed(request, parsed, rid, timeout_s, assigned, transport, prepared, prompt, parsed.calls)
            async with contextlib.aclosing(_released_after(handed, prepared)) as responses:
                async for response in responses:
                    yield response

    async def _checked(self, request: tokenizer_pb2.GenerateRequest) -> Parsed:
        """`request` validated, its structure compiled (milliseconds: not on
        the loop) and its forced tool call's schema checked."""
        await structured.ready(request.sampling)
        parsed = self._validate(request)
        if parsed.tool_schema:
            await tool_calls.check_schema(parsed.tool_schema)
        return parsed

    def _backend(self) -> SchedulerLink:
        """A ready scheduler of this model, or SCHEDULER_UNAVAILABLE."""
        backend = self.link.pick()
        if backend is None:
            differ = self.link.serving_another_model
            raise SchedulerUnavailable(
                f"no scheduler serves this tokenizer's model (theirs has another {differ})"
                if differ
                else "no scheduler is reachable; retry shortly",
                retry_after_ms=self.settings.unavailable_retry_after_ms,
            )
        return backend

    @staticmethod
    @contextlib.contextmanager
    def _counted(assigned: Assigned) -> Iterator[Assigned]:
        """One request counted on its backend while it runs (a failover moves it)."""
        assigned.backend.inflight += 1
        try:
            yield assigned
        finally:
            assigned.backend.inflight -= 1

    async def _media_and_prompt(
        self,
        request: tokenizer_pb2.GenerateRequest,
        parsed: Parsed,
        rid: str,
        transport: int,
        ask: ItemAsk,
        info: common_pb2.ServerInfo | None,
    ) -> tuple[list[Prepared], BuiltPrompt]:
        """The request's media prepared for `transport` (the caller's to hand
        over or release) and the prompt the model reads with them."""
        prepared = await self._prepare_media(parsed.media, rid, transport, ask)
        try:
            results = [p.result for p in prepared]
            self._check_sizes(parsed.media, results, ask)
            media = [Media(r.modality, r.tokens, r.times) for r in results]
            return prepared, await self._model_reads(request, parsed, media, info)
        except BaseException:
            _release(prepared)
            raise

    async def _handed(
        self,
        request: tokenizer_pb2.GenerateRequest,
        parsed: Parsed,
        rid: str,
        timeout_s: float | None,
        assigned: Assigned,
        transport: int,
        prepared: list[Prepared],
        prompt: BuiltPrompt,
        calls: Forced | Auto | None,
        *,
        search_step: bool = False,
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        """`prompt` and its `prepared` media sent to the scheduler, and its
        answer as text. What the scheduler accepts it disowns; the rest of
        `prepared` stays the caller's to release (also when this never
        starts). `search_step`: the scheduler GenerateRequest's."""
        results = [p.result for p in prepared]
        owned = [name for r in results for name in r.segments]
        self.held.update(owned)
        granted: list[grants.Grant] = []
        try:
            # Items go in prompt order (by their first placeholder).
            items = sorted(zip(prompt.runs, results, strict=True), key=lambda pair: pair[0][0][0])
            downstream = scheduler_pb2.GenerateRequest(
                request_id=self._downstream_id(rid),
                input_ids=prompt.input_ids,
                items=[self._item(r, runs, transport, granted) for runs, r in items],
                sampling=request.sampling,
                cache_salt=request.cache_salt,
                priority=request.priority,
                search_step=search_step,
            )
            if parsed.tool_schema:  # "required" or a named function: the output is the calls
                downstream.sampling.json_schema = parsed.tool_schema
            for ids in parsed.bad_words:
                downstream.bad_words.add(token_ids=ids)
            for p in prepared:
                p.sent(copied=transport != common_pb2.TRANSPORT_SHM)
            # (A beam search's one-token steps: its beams' answers split it, `_beam_choice`.)
            thought = None if search_step else self._thought(request, downstream.input_ids, downstream.sampling)
            events = self._send(Handed(downstream), timeout_s, assigned, transport)
            # The relay reads the prompt and the sampling; the items (inline:
            # the tensors' bytes) go once the scheduler has accepted them.
            relayed = self._relay(
                rid,
                without(downstream, ITEMS),
                events,
                calls,
                prompt_ids=request.return_prompt_token_ids,
                special=request.keep_special_tokens,
                thought=thought,
            )
            del downstream, items, results
            async with contextlib.aclosing(relayed) as relay:
                async for response in relay:
                    if response is None:
                        # The scheduler holds its own claims on the tensors
                        # now and releases them from here on: drop ours.
                        for p in prepared:
                            p.disown()
                        log.debug("%s: accepted downstream; its %d segment(s) are the scheduler's", rid, len(owned))
                    else:
                        # Every rank has read the tensors by the first token.
                        self._revoke(granted)
                        yield response
        finally:
            self._revoke(granted)
            self.held.difference_update(owned)

    def _check_sizes(self, media: list[Located], results: list[ItemResult], ask: ItemAsk) -> None:
        """Each item's encoder inputs within the largest tensor the backend
        takes (ServerInfo.max_tensor_bytes; unchecked where it does not say):
        MEDIA_TOO_LARGE here, naming the item and what would fit, not
        INVALID_REQUEST from the scheduler after the hand-off ("tensor of
        shape [...] is N bytes"). An image whose rows the worker counted
        from its header was refused there already (`ImageJob.max_bytes`);
        this is for the rest: videos, families that do not say, and items
        the preprocessing cache kept from a request with no cap (Tokenize)."""
        cap, pixels = ask.max_bytes, ask.pixels
        if not cap:
            return
        own = self.family.image_pixels
        for located, result in zip(media, results, strict=True):
            for t in result.tensors:
                if families.is_encoder_input(t.name) and t.nbytes > cap:
                    most = None
                    if result.modality == families.IMAGE and own is not None and t.shape and t.shape[0]:
                        row_bytes = t.nbytes // t.shape[0]
                        most = most_pixels(self.family, result.width, result.height, pixels or own, row_bytes, cap)
                    exc = too_large(result.modality, t.nbytes, cap, most)
                    exc.metadata["param"] = located.where
                    raise exc

    async def _built(self, parsed: Parsed, media: list[Media]) -> BuiltPrompt:
        """The prompt, rendered and tokenized on the event loop, which it
        holds meanwhile: ~30 ms for 100,000 characters. A big one (`Parsed.size` over
        BIG_PROMPT) is built under a lock kept until a later turn of the
        loop, so big ones take a turn each, with the loop's I/O between
        them: the 16 prompts of one completions request otherwise ran in one
        turn and held every stream and /health for their sum (~0.5 s).
        A conversation with the request's own chat template
        (--trust-request-chat-template) is rendered on a thread instead,
        the loop serving meanwhile: that template may loop as long as it
        likes (the server's own is known); it is tokenized here."""
        if parsed.turns is not None and parsed.chat_template is not None:
            rendered = await asyncio.to_thread(self._rendered, parsed, media)
            return self.prompts.tokenize_chat(rendered, media)
        if parsed.size <= BIG_PROMPT:
            return self._prompt(parsed, media)
        async with self._one_big_prompt_at_a_time:
            built = self._prompt(parsed, media)
            await asyncio.sleep(0)
        return built

    def _prompt(self, parsed: Parsed, media: list[Media]) -> BuiltPrompt:
        if parsed.token_ids is not None:
            return self.prompts.from_ids(parsed.token_ids)
        if parsed.turns is None:
            return self.prompts.build(parsed.prompt, media, as_written=parsed.as_written, special=parsed.special_tokens)
        return self.prompts.tokenize_chat(self._rendered(parsed, media), media)

    def _rendered(self, parsed: Parsed, media: list[Media]) -> Rendered:
        assert parsed.turns is not None
        return self.prompts.render_chat(
            parsed.turns,
            media,
            parsed.tools,
            continue_final=parsed.continue_final,
            generation_prompt=parsed.generation_prompt,
            template_kwargs=parsed.template_kwargs,
            documents=parsed.documents,
            template=parsed.chat_template,
        )

    async def tokenize(self, request: tokenizer_pb2.GenerateRequest, rid: str, client: str = "") -> list[int]:
        """The token ids `generate` would give the scheduler for `request`'s
        prompt or conversation, without generating: its media are fetched
        and preprocessed as for `generate` (so each counts the placeholders
        the model's processor gives it, and the preprocessing cache keeps
        them for the request that follows), then let go. It counts against
        --max-inflight and --max-inflight-per-client as a request does."""
        with self._admitted(client):
            await structured.ready(request.sampling)
            parsed = self._validate(request)
            # In the rows a backend would be sent, for the cache to keep for the request that follows.
            backend = self.link.primary
            form = PLAIN_ROWS if backend is None else backend.row_form(self.family)
            # Counted, not sent: no tensor cap.
            ask = ItemAsk(form, parsed.image_pixels, video=parsed.video_sampling, tiles=parsed.image_tiles)
            prepared = await self._prepare_media(parsed.media, rid, common_pb2.TRANSPORT_INLINE, ask)
            try:
                media = [Media(p.result.modality, p.result.tokens, p.result.times) for p in prepared]
                return (await self._model_reads(request, parsed, media, backend.info if backend else None)).input_ids
            finally:
                _release(prepared)

    async def _send(
        self,
        given: Handed[scheduler_pb2.GenerateRequest],
        timeout_s: float | None,
        assigned: Assigned,
        transport: int,
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        """The scheduler's events. A call that fails before Accepted, the
        backend being unavailable or shutting down, goes once more to another
        ready backend of the same transport (the request's tensors are made
        for it), within the request's deadline; after Accepted, never: tokens
        may have been streamed. The request is let go once accepted (its
        items, inline, are the tensors' bytes)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        tried = [assigned.backend]
        taken = given.take()
        rid, media = taken.request_id, bool(taken.items)
        downstream: scheduler_pb2.GenerateRequest | None = taken
        del taken
        while True:
            accepted = False
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            assert downstream is not None  # a failover comes before acceptance
            stream = assigned.backend.generate(Handed(downstream), timeout_s=remaining)
            try:
                async for event in stream:
                    if not accepted and event.WhichOneof("event") == "accepted":
                        accepted, downstream = True, None
                    yield event
                return
            except (SchedulerUnavailable, RemoteError) as exc:
                again = None
                if not accepted and len(tried) == 1 and exc.error_code in FAILOVER_CODES:
                    # Without media any backend will do; with them, one of
                    # the transport and row form they were made for.
                    again = self.link.pick(
                        exclude=tried, transport=transport if media else 0, form=assigned.form if media else None
                    )
                if again is None:
                    raise
                log.info(
                    "request %s: %s from %s before acceptance; sending it to %s",
                    rid,
                    exc.reason,
                    assigned.backend.target,
                    again.target,
                )
                assigned.backend.inflight -= 1
                again.inflight += 1
                assigned.backend = again
                tried.append(again)
            finally:
                await stream.aclose()

    def _thought(
        self, request: tokenizer_pb2.GenerateRequest, prompt_ids: Sequence[int], sampling: common_pb2.SamplingParams
    ) -> tuple[reasoning.Think, bool] | None:
        """With split_reasoning: the parser, and whether the prompt leaves
        the model inside its thinking (`Think.start`: a structured output
        there is INVALID_REQUEST)."""
        if not request.split_reasoning or self.reasoning is None:
            return None
        return self.reasoning, self.reasoning.start(prompt_ids, reasoning.structured(sampling))

    async def _relay(
        self,
        rid: str,
        downstream: scheduler_pb2.GenerateRequest,
        stream: AsyncGenerator[scheduler_pb2.GenerateResponse, None],
        calls: Forced | Auto | None = None,
        *,
        prompt_ids: bool = False,
        special: bool = False,
        thought: tuple[reasoning.Think, bool] | None = None,
    ) -> AsyncGenerator[tokenizer_pb2.GenerateResponse | None, None]:
        """The scheduler's stream as text: None once it has accepted, then
        (with `prompt_ids`: GenerateRequest.return_prompt_token_ids) the
        prompt's ids with its first tokens, then a delta per step (text may be empty while a character or a possible
        stop string is held back), then Finished (with `calls`, the
        request's tool_choice: the calls found in the whole text; with
        `thought`, split_reasoning's parser: the thinking apart). A stop
        string ends the stream here, and closing the call aborts the
        request downstream."""
        decoder = make_decoder(self.tokenizer, skip_special_tokens=not special)  # keep_special_tokens
        stops = StopMatcher(tuple(downstream.sampling.stop), downstream.sampling.include_stop_str_in_output)
        completion = cached = 0
        text_so_far: list[str] = []  # the whole text, for the calls in it (tool_choice only)
        scoring = downstream.sampling.HasField("prompt_logprobs")  # until the first message brings them
        try:
            async for event in stream:
                kind = event.WhichOneof("event")
                if kind == "accepted":
                    yield None
                    continue
                if prompt_ids:  # before the first of what the scheduler made
                    prompt_ids = False
                    read = tokenizer_pb2.PromptTokens(token_ids=downstream.input_ids)
                    yield tokenizer_pb2.GenerateResponse(request_id=rid, prompt_tokens=read)
                if kind == "tokens":
                    cached = cached or event.tokens.cached_tokens
                    if scoring:  # a prompt of one token has no entries, and its event all the same
                        scoring = False
                        scored = tokenizer_pb2.PromptLogprobs(
                            token_ids=downstream.input_ids, logprobs=event.tokens.prompt_logprobs
                        )
                        yield tokenizer_pb2.GenerateResponse(request_id=rid, prompt_logprobs=scored)
                    ids = list(event.tokens.token_ids)
                    text, kept = stream_text(decoder, stops, ids)
                    del ids[kept:]  # those after the token a stop string falls in are not reported
                    completion += kept
                    delta = tokenizer_pb2.TextDelta(text=text, token_ids=ids, logprobs=event.tokens.logprobs[:kept])
                    if calls is not None or thought is not None:
                        text_so_far.append(text)
                    yield tokenizer_pb2.GenerateResponse(request_id=rid, delta=delta)
                    if stops.stopped:
                        done = _finished(
                            rid, common_pb2.FINISH_REASON_STOP, len(downstream.input_ids), completion, cached
                        )
                        yield _with_calls(done, calls, "".join(text_so_far), thought)
                        return
                elif kind == "finished":
                    f = event.finished
                    tail = stops.feed(decoder.flush())
                    tail += stops.flush()
                    if tail:
                        yield tokenizer_pb2.GenerateResponse(request_id=rid, delta=tokenizer_pb2.TextDelta(text=tail))
                    reason = common_pb2.FINISH_REASON_STOP if stops.stopped else f.finish_reason
                    done = _finished(rid, reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens)
                    yield _with_calls(done, calls, "".join([*text_so_far, tail]), thought)
                    return
        finally:
            await stream.aclose()  # cancels the call downstream when it has not ended

    def _downstream_id(self, rid: str) -> str:
        """``<instance>-<n>.<client id>``: unique by its prefix; the client's
        id (cut to 64 characters) is kept only so logs on both sides can be
        matched. Responses and errors carry the client's id alone."""
        return f"{self.instance}-{next(self._ids):x}.{rid[:64]}"

    async def _model_reads(
        self,
        request: tokenizer_pb2.GenerateRequest,
        parsed: Parsed,
        media: list[Media],
        info: common_pb2.ServerInfo | None,
    ) -> BuiltPrompt:
        """The prompt the model reads: built, then cut to its last
        truncate_prompt_tokens (`info`: the backend's, for -1)."""
        prompt = await self._built(parsed, media)
        if request.truncate_prompt_tokens:
            prompt = truncated(prompt, self._kept(request, info), [m.where for m in parsed.media])
        return prompt

    @staticmethod
    def _kept(request: tokenizer_pb2.GenerateRequest, info: common_pb2.ServerInfo | None) -> int:
        """The prompt tokens truncate_prompt_tokens keeps (-1: the context's, less one to generate)."""
        if request.truncate_prompt_tokens > 0:
            return request.truncate_prompt_tokens
        context = info.max_context_tokens if info is not None else 0
        if not context:
            raise SchedulerUnavailable(
                "truncate_prompt_tokens -1 needs the scheduler's context length, not known yet; retry shortly"
            )
        return context - 1

    def _validate(self, request: tokenizer_pb2.GenerateRequest) -> Parsed:
        Sampling.from_pb(request.sampling, max_tokens_limit=self.settings.max_tokens_limit)
        if request.truncate_prompt_tokens < -1:
            raise InvalidRequest(
                f"truncate_prompt_tokens {request.truncate_prompt_tokens}: give the prompt tokens to keep, "
                "-1 for as many as the context holds, or 0 for all",
                metadata={"param": "truncate_prompt_tokens"},
            )
        if len(request.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(
                f"cache_salt must be at most {MAX_CACHE_SALT} characters", metadata={"param": "cache_salt"}
            )
        parsed = parse(request, self.settings, self.family)
        if request.sampling.bad_words:
            words = tuple(token_sequences(self.tokenizer, request.sampling.bad_words))
            parsed = dataclasses.replace(parsed, bad_words=words)
        return parsed

    async def _prepare_media(
        self,
        media: list[Located],
        rid: str,
        transport: int,
        ask: ItemAsk = ItemAsk(),
    ) -> list[Prepared]:
        """Every image and video fetched, preprocessed and locked, or none
        held: on any failure or cancellation the others' work is awaited and
        released. In request order: the images, then the videos. An error
        about one names where it was in the request (metadata "param").
        `ask`: how their rows are made and what bounds them."""
        tasks = [asyncio.create_task(self._located(m, rid, transport, ask)) for m in media]
        if not tasks:
            return []
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            try:
                await _settle(tasks)
            finally:
                # Also when we are cancelled while the others wind down (a
                # client leaving just after a sibling failed): `_settle`
                # re-raises that once every task is done, and what is done
                # and held is still ours to let go of.
                _release([t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None])
            raise
        finally:
            # The failure raised from here holds this frame, whose tasks hold
            # the failure: a cycle that kept the request's locals alive until
            # a full collection (`_run_in_own_task`).
            tasks = task = None  # type: ignore[assignment]

    async def _slab_ref(self) -> SlabRef | None:
        """Where shared-memory tensors go: the slab (made now if this is
        the first time), or None for a segment per tensor (slab off, or its
        making failed: logged once, and the service goes on without it).

        The slab is made by one task that every request waits for, shielded:
        a request cancelled meanwhile (another of its images failed, its
        client left) must not cancel the making, whose thread would make the
        slab all the same and leave it recorded nowhere, 128 MiB of
        /dev/shm that nothing removes while this process lives; and the
        next request would make another."""
        s = self.settings
        if not s.shm_slab_bytes or self._slab_failed:
            return None
        if self.slab is None:
            if self._slab_making is None:
                self._slab_making = asyncio.create_task(self._make_slab())
                # Read here, so that a failure nobody waits for any more is not reported as unread.
                self._slab_making.add_done_callback(lambda task: task.cancelled() or task.exception())
            await asyncio.shield(self._slab_making)
        if self.slab is None:
            return None
        return SlabRef(self.slab.name, self.slab.max_slice, s.shm_slab_wait_s)

    async def _make_slab(self) -> None:
        s = self.settings
        try:
            self.slab = await asyncio.to_thread(ranges.Slab, s.shm_prefix, self._pid, s.shm_slab_bytes)
            log.info("created a %d-byte shared-memory slab", self.slab.size)
        except files.NoDescriptors as exc:  # for now: the next request tries again
            self._slab_making = None
            raise Overloaded(f"the shared-memory slab could not be made: {exc}") from exc
        except (OSError, files.SegmentError) as exc:
            self._slab_failed = True
            log.error("no shared-memory slab (%s): one segment per tensor from now on", exc)

    def start_device_pool(self, backend: cuda_ipc.Backend) -> str:
        """Create the CUDA-IPC staging pool when the backend has a GPU and a
        pool size is set; its GPU's UUID ("" for none)."""
        s = self.settings
        if not s.cuda_ipc_pool_bytes or not backend.uuids():
            return ""
        self.device_pool = cuda_ipc.DevicePool(backend, s.shm_prefix, self._pid, s.cuda_ipc_pool_bytes)
        log.info("GPU staging pool of %d bytes on %s (CUDA IPC)", self.device_pool.size, self.device_pool.uuid)
        return self.device_pool.uuid

    async def close_pools(self) -> None:
        """Remove the segments still held, the slab and the GPU pool (at
        shutdown, once no request is left), after a slab still being made
        (its requests were cancelled). Only what this process owns: another
        tokenizer may share /dev/shm and even our pid (in its own pid
        namespace); anything a dying worker left unlocked is a janitor's."""
        left, self.held = list(self.held), set()
        for name in left:
            files.unlink(name)
        if left:
            log.warning("removed %d segment(s) still owned at shutdown", len(left))
        if self._slab_making is not None:
            await asyncio.wait([self._slab_making])
        if self.slab is not None:
            self.slab.close()
        if self.device_pool is not None:
            self.device_pool.close()
        if self.grants is not None:
            self.grants.close()

    async def _located(self, located: Located, rid: str, transport: int, ask: ItemAsk) -> Prepared:
        try:
            return await self._one(located.medium, rid, transport, ask)
        except MmsplitError as exc:
            exc.metadata.setdefault("param", located.where)
            raise

    async def _one(
        self,
        medium: tokenizer_pb2.Image | tokenizer_pb2.Video,
        rid: str,
        transport: int,
        ask: ItemAsk = ItemAsk(),
    ) -> Prepared:
        data = await self.media.load(medium)  # IO pool, its own timeouts
        # CUDA IPC: the worker returns bytes (as for inline) and this process
        # stages them in its GPU pool (`_made`).
        inline = transport != common_pb2.TRANSPORT_SHM
        slab_ref = None if inline else await self._slab_ref()
        s = self.settings
        # A scheduler that does not share our /dev/shm gets the bytes inline
        # (`inline`): the worker returns them and writes no segment at all.
        job: Job
        if isinstance(medium, tokenizer_pb2.Video):
            # A video's rows hold two frames a patch: only their dtype changes.
            job = self._video_job(data, inline, slab_ref, dataclasses.replace(ask.form, one_frame=False), ask.video)
            timeout_s = s.video_preprocess_timeout_s
        else:
            job = ImageJob(
                data=data,
                max_pixels=s.max_image_pixels,
                max_aspect_ratio=s.max_aspect_ratio,
                shm_prefix=s.shm_prefix,
                owner_pid=self._pid,
                inline=inline,
                slab=slab_ref,
                form=ask.form,
                pixels=ask.pixels,
                tiles=ask.tiles,
                max_bytes=ask.max_bytes,
            )
            timeout_s = s.preprocess_timeout_s
        # The key names the item (its content hash) whether or not the cache is on.
        key = await asyncio.to_thread(self.cache.key, job) if len(data) > 1 << 20 else self.cache.key(job)
        cached = self.cache.get(key) if self.cache.enabled else None
        made = False
        while cached is None and not made and (under_way := self._under_way.get(key)) is not None:
            # Another request is preprocessing this very item (the same
            # image sent by many at once): wait for it and take the cache's
            # copy. If it failed or was cancelled, one of those waiting takes
            # its place; if the cache could not keep what it made, each makes
            # its own, at once.
            made = await asyncio.shield(under_way)
            cached = self.cache.get(key)
        if cached is not None or not self.cache.enabled or made:
            return await self._made(job, timeout_s, rid, key, cached, transport, slab_ref)
        mine = self._under_way[key] = asyncio.get_running_loop().create_future()
        try:
            prepared = await self._made(job, timeout_s, rid, key, cached, transport, slab_ref)
            made = True
            return prepared
        finally:
            del self._under_way[key]
            mine.set_result(made)

    async def _made(
        self,
        job: Job,
        timeout_s: float,
        rid: str,
        key: bytes,
        cached: ItemResult | None,
        transport: int,
        slab_ref: Any,
    ) -> Prepared:
        """The item of `job` (keyed `key`) ready to hand over by `transport`:
        from the cache's copy `cached`, else preprocessed (and kept in the
        cache)."""
        stage = transport == common_pb2.TRANSPORT_CUDA_IPC
        inline = transport != common_pb2.TRANSPORT_SHM
        if cached is not None:
            # Seen before: no decoding or preprocessing, only the hand-over copy.
            result = await self._off_loop(self._materialize, cached, inline, slab_ref)
        else:
            result = await self._preprocess(job, timeout_s, rid, key)
        if stage:
            if self.cache.enabled and cached is None:
                self.cache.put(key, result)  # inline: the bytes the worker returned
            return self._hold(await self._off_loop(self._stage, result))
        try:
            prepared = self._hold(result)
        except _WriterLost:
            # Killed between sending its result and handing its slices over:
            # their bytes cannot be trusted. Once more, as for a worker that
            # dies while it works (`CpuPool.preprocess`).
            log.warning("request %s: a preprocessing worker died before handing its item over; again", rid)
            result = await self._preprocess(job, timeout_s, rid, key)
            try:
                prepared = self._hold(result)
            except _WriterLost as exc:
                raise PreprocessWorkerCrashed(
                    "a preprocessing worker died twice while handling this request's media"
                ) from exc
        if self.cache.enabled and cached is None:
            try:
                # On the loop: the copy out of shared memory holds the GIL
                # whichever thread makes it, and a thread only adds its hop.
                shared = any(t.segment is not None for t in result.tensors)
                self.cache.put(key, self._as_bytes(result) if shared else result)
            except Exception:
                # Only the cache misses out: the item itself is fine.
                log.warning("request %s: a preprocessed item could not be kept in the cache", rid, exc_info=True)
            except BaseException:  # cancelled: nobody will send what we hold
                prepared.release()
                raise
        return prepared

    async def _preprocess(self, job: Job, timeout_s: float, rid: str, key: bytes) -> ItemResult:
        """`job` done by the CPU pool, counted for the metrics."""
        started = time.perf_counter()
        result = await self.pool.preprocess(job, timeout_s=timeout_s, request_id=rid)
        self.preprocessed += 1
        self.preprocess_s += time.perf_counter() - started
        for name, seconds in zip(STAGES, result.stages, strict=False):
            self.worker_s[name] += seconds
        return dataclasses.replace(result, content_hash=key[:16])

    def _hold(self, result: ItemResult) -> Prepared:
        """This process's claims on `result`'s segments and slices; _WriterLost
        when a slice's writer is gone before handing it over."""
        claims: list[tuple[files.Slice, reference.Claim]] = []
        try:
            # This process owns the segments and slices from here until the
            # scheduler accepts them; a slice's writer lets go once it sees us.
            for t in result.tensors:
                if t.slice is not None:
                    claims.append((t.slice, reference.hold(t.slice, self.settings.shm_prefix)))
            return Prepared(result, claims)
        except files.SegmentError as exc:
            for _, claim in claims:
                claim.release()
            result.abandon(self.settings.shm_prefix)
            if isinstance(exc, files.NoDescriptors):
                raise Overloaded(f"a preprocessed item could not be held for hand-over: {exc}") from exc
            if isinstance(exc, ranges.SliceLost):
                raise _WriterLost("its preprocessing worker died before handing it over") from exc
            raise InternalError("a preprocessed item could not be held for hand-over") from exc

    async def _off_loop(self, fn: Callable[..., ItemResult], *args: Any) -> ItemResult:
        """`fn` on a thread. If we are cancelled meanwhile, the thread cannot
        be stopped: the segments of what it returns are released when it ends."""
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._release_abandoned)
            raise

    def _release_abandoned(self, future: asyncio.Future[ItemResult]) -> None:
        if not future.cancelled() and future.exception() is None:
            future.result().abandon(self.settings.shm_prefix)

    def _materialize(self, cached: ItemResult, inline: bool, slab_ref: SlabRef | None) -> ItemResult:
        """A cached item ready to send: as it is (inline), or its encoder
        inputs written into the slab or new segments of ours — a slice held
        by this process's hand-off until `_hold` takes it, as a worker's is."""
        if inline:
            return cached
        prefix = self.settings.shm_prefix
        tensors: list[ItemTensor] = []
        try:
            for t in cached.tensors:
                if families.is_encoder_input(t.name) and t.inline is not None:
                    t = place(t, memoryview(t.inline), slab_ref, prefix, self._pid)
                tensors.append(t)
        except BaseException:
            abandon(tensors, prefix)
            raise
        return dataclasses.replace(cached, tensors=tuple(tensors))

    def _stage(self, result: ItemResult) -> ItemResult:
        """`result`'s encoder inputs copied into ranges of the GPU pool (the
        ranges held by this process's hand-off until `_hold` takes them, as
        a worker's slab slices are). A full pool is OVERLOADED."""
        pool = self.device_pool
        if pool is None:
            raise InternalError("CUDA IPC was chosen without a staging pool")
        tensors: list[ItemTensor] = []
        try:
            for t in result.tensors:
                data = t.inline
                if families.is_encoder_input(t.name) and data is not None:
                    try:
                        held = pool.put(memoryview(data), wait_s=self.settings.shm_slab_wait_s)
                    except ranges.SlabFull as exc:
                        raise Overloaded(f"the GPU staging pool has no room: {exc}") from exc
                    ranges.hand_off(held)
                    piece = held.slice
                    t = dataclasses.replace(t, segment=piece.segment, offset=piece.offset, inline=None, device=True)
                tensors.append(t)
        except BaseException:
            abandon(tensors, self.settings.shm_prefix)
            raise
        return dataclasses.replace(result, tensors=tuple(tensors))

    def _as_bytes(self, result: ItemResult) -> ItemResult:
        """`result` with every tensor inline (what the cache keeps)."""
        tensors = [
            t if t.segment is None else dataclasses.replace(t, segment=None, inline=self._read(t))
            for t in result.tensors
        ]
        return dataclasses.replace(result, tensors=tuple(tensors))

    def _read(self, t: ItemTensor) -> bytes:
        """The bytes of a tensor held in one of our segments."""
        assert t.segment is not None
        piece = files.Slice(t.segment, t.offset, t.nbytes)
        return reference.read_bytes(piece, self.settings.shm_prefix, max_segment_bytes=t.nbytes)

    def _video_job(
        self, data: bytes, inline: bool, slab_ref: SlabRef | None, form: RowForm, own: VideoSampling | None = None
    ) -> VideoJob:
        """The sampling rule: the request's own (`own`, within the server's),
        else this server's settings, bounded by the model's video processor
        (README "Video")."""
        s, model = self.settings, self.family.video_config
        max_frames = (own.max_frames if own is not None else 0) or s.video_max_frames
        if model.get("max_frames"):
            max_frames = min(max_frames, int(model["max_frames"]))
        return VideoJob(
            data=data,
            max_pixels=s.max_video_frame_pixels,
            max_duration_s=s.max_video_duration_s,
            max_frames=s.max_video_file_frames,
            fps=(own.fps if own is not None else 0.0) or s.video_fps or float(model.get("fps") or 2.0),
            min_frames=min(int(model.get("min_frames") or 4), max_frames),
            max_sampled_frames=max_frames,
            # The worker stops itself a little before the caller gives up.
            budget_s=s.video_preprocess_timeout_s * 0.95,
            shm_prefix=s.shm_prefix,
            owner_pid=self._pid,
            inline=inline,
            slab=slab_ref,
            form=form,
        )

    def _item(
        self, result: ItemResult, runs: list[tuple[int, int]], transport: int, granted: list[grants.Grant]
    ) -> common_pb2.MultimodalItem:
        return common_pb2.MultimodalItem(
            modality=result.modality,  # type: ignore[arg-type]
            tensors={t.name: self._tensor_ref(t, transport, granted) for t in result.tensors},
            placeholders=[common_pb2.PlaceholderRange(offset=o, length=n) for o, n in runs],
            content_hash=result.content_hash,
        )

    def _tensor_ref(self, t: ItemTensor, transport: int, granted: list[grants.Grant]) -> common_pb2.TensorRef:
        dtype = DTYPE_BY_NAME[t.dtype]
        if t.segment is None:
            return TensorSpec(dtype, t.shape, inline=t.inline).to_pb()
        piece = files.Slice(t.segment, t.offset, t.nbytes)
        if t.device and self.device_pool is not None:
            cuda = CudaRef(self.device_pool.handle, self.device_pool.uuid, piece)
            return TensorSpec(dtype, t.shape, cuda=cuda, grant=self._grant(piece, granted)).to_pb()
        if transport == common_pb2.TRANSPORT_SHM:
            return TensorSpec(dtype, t.shape, shm=piece, grant=self._grant(piece, granted)).to_pb()
        return TensorSpec(dtype, t.shape, inline=self._read(t)).to_pb()

    def _grant(self, piece: files.Slice, granted: list[grants.Grant]) -> grants.Grant:
        """Grant `piece` to the request whose grants `granted` collects. A
        full table is OVERLOADED (it holds an entry per tensor of every
        request in flight, with room to spare)."""
        if self.grants is None:
            s = self.settings
            entries = max(64, s.max_inflight * (s.max_images_per_request + s.max_videos_per_request) * MAX_CHOICES)
            try:
                self.grants = grants.GrantTable(s.shm_prefix, self._pid, entries)
            except (OSError, files.SegmentError) as exc:  # /dev/shm full, no descriptor: this server's state
                raise Overloaded(f"no grant table could be made: {exc}") from exc
        try:
            grant = self.grants.issue(piece.segment, piece.offset, piece.nbytes)
        except grants.TableFull as exc:
            raise Overloaded(f"no grant can be issued: {exc}") from exc
        granted.append(grant)
        return grant

    def _revoke(self, granted: list[grants.Grant]) -> None:
        if self.grants is not None:
            for grant in granted:
                self.grants.revoke(grant)
        granted.clear()


class _WriterLost(PreprocessWorkerCrashed):
    """A worker's slice was no longer held when this process came to take
    it over: the worker died after sending its result (`_hold`)."""


@dataclass
class Assigned:
    """The backend a request is on (a failover changes it), and the form of
    its media's rows made for that backend (`SchedulerLink.row_form`); a
    failover goes only to a backend that takes them too."""

    backend: SchedulerLink
    form: RowForm = PLAIN_ROWS


def _prepared(request: tokenizer_pb2.GenerateRequest, parsed: Parsed) -> tuple[tokenizer_pb2.GenerateRequest, Parsed]:
    """What a request is kept as once its media are prepared and its prompt
    built: without them (`PREPARED_ONCE`), so that the message with their
    bytes goes while its answer streams."""
    return without(request, PREPARED_ONCE), dataclasses.replace(parsed, media=[])


def _ask(form: RowForm, parsed: Parsed, info: common_pb2.ServerInfo | None) -> ItemAsk:
    """How a request's media rows are made for a backend, and what bounds them."""
    max_bytes = info.max_tensor_bytes if info is not None else 0
    return ItemAsk(form, parsed.image_pixels, max_bytes, parsed.video_sampling, parsed.image_tiles)


@dataclass
class Prepared:
    """A preprocessed image or video and this process's claims on where its
    tensors were placed."""

    result: ItemResult
    claims: list[tuple[files.Slice, reference.Claim]]

    def disown(self) -> None:
        """The scheduler took them over: they are its to release now."""
        for _, claim in self.claims:
            claim.disown()

    def release(self) -> None:
        """Nobody will send them: let them go (idempotent; a disowned claim
        is left alone)."""
        for _, claim in self.claims:
            claim.release()

    def sent(self, *, copied: bool) -> None:
        """Its scheduler request is made: the tensors' bytes (inline ones,
        and with `copied`, an inline transport's, every one) are in that
        message now. One-off segments whose bytes were copied have done
        their job and go; what is left to do (release, disown) needs only
        the claims."""
        if copied:
            for piece, claim in self.claims:
                if not files.is_slab(piece.segment):
                    claim.release()
        tensors = self.result.tensors
        if any(t.inline is not None for t in tensors):
            kept = tuple(dataclasses.replace(t, inline=None) for t in tensors)
            self.result = dataclasses.replace(self.result, tensors=kept)


def joined_deltas(
    items: list[tokenizer_pb2.GenerateResponse | None],
) -> list[tokenizer_pb2.GenerateResponse | None]:
    """`items` with each run of consecutive deltas of the same choice joined
    into the first of them (text, token ids and logprobs in order): the
    client reads the same text and tokens in fewer messages."""
    out: list[tokenizer_pb2.GenerateResponse | None] = []
    last: tokenizer_pb2.GenerateResponse | None = None
    for item in items:
        if (
            item is not None
            and last is not None
            and item.HasField("delta")
            and last.HasField("delta")
            and item.index == last.index
        ):
            last.delta.text += item.delta.text
            last.delta.token_ids.extend(item.delta.token_ids)
            last.delta.logprobs.extend(item.delta.logprobs)
            continue
        out.append(item)
        last = item
    return out


def _release(prepared: list[Prepared]) -> None:
    for p in prepared:
        p.release()


def _finished(
    rid: str, reason: int, prompt_tokens: int, completion_tokens: int, cached_tokens: int
) -> tokenizer_pb2.GenerateResponse:
    return tokenizer_pb2.GenerateResponse(
        request_id=rid,
        finished=tokenizer_pb2.Finished(
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        ),
    )


def _with_calls(
    done: tokenizer_pb2.GenerateResponse,
    calls: Forced | Auto | None,
    text: str,
    thought: tuple[reasoning.Think, bool] | None = None,
) -> tokenizer_pb2.GenerateResponse:
    """`done` (a Finished) with the tool calls found in the whole `text` and
    the text outside them (tool_choice), and with `thought` (split_reasoning:
    the parser, and whether the model started inside its thinking) the
    thinking apart, the calls then found in the rest; unchanged without either."""
    if thought is not None:
        parser, opened = thought
        found_reasoning, text = parser.split(text, opened)
        done.finished.reasoning = found_reasoning or ""
        done.finished.content = text
    if calls is None:
        return done
    content, found = calls.split(text)
    done.finished.content = content or ""
    for call in found or ():
        function = call["function"]
        done.finished.tool_calls.add(id=call["id"], name=function["name"], arguments=function["arguments"])
    return done


async def _released_after(
    handed: AsyncGenerator[tokenizer_pb2.GenerateResponse, None], prepared: list[Prepared]
) -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
    """`handed`'s responses (`TokenizerService._handed`), then `prepared`
    released however it ends: what the scheduler took (disowned) is left
    alone. Its caller iterates it at once, under `contextlib.aclosing`."""
    try:
        async with contextlib.aclosing(handed) as responses:
            async for response in responses:
                yield response
    finally:
        _release(prepared)


async def merged(sources: Sequence[AsyncGenerator[_T, None]]) -> AsyncGenerator[_T, None]:
    """The items of every source as they come. The first failure of one
    (typed or not) ends it, raised here; however it ends, every source's
    work is cancelled and awaited (`_settle`), each source closed."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def drain(source: AsyncGenerator[_T, None]) -> None:
        async with contextlib.aclosing(source):
            async for item in source:
                queue.put_nowait((True, item))

    tasks = [asyncio.create_task(drain(source)) for source in sources]
    for task in tasks:
        task.add_done_callback(lambda done: queue.put_nowait((False, done)))
    try:
        running = len(tasks)
        while running:
            is_item, got = await queue.get()
            if is_item:
                yield got
                continue
            running -= 1
            failure = None if got.cancelled() else got.exception()
            if failure is not None:
                raise failure
    finally:
        for task in tasks:
            task.cancel()
        try:
            await _settle(tasks)
        finally:
            # Nothing of the ended work stays in reference cycles (freed only
            # by a full collection, with every frame's locals), also when our
            # caller is cancelled meanwhile: the failure raised from here
            # holds this frame (see `_run_in_own_task`), and a task cancelled
            # here is in the queue it is a closure of, unread.
            tasks = task = got = failure = None  # type: ignore[assignment]
            while not queue.empty():
                queue.get_nowait()


async def _settle(tasks: list[asyncio.Task[Any]]) -> None:
    """Wait for `tasks` to finish even if we are being cancelled meanwhile,
    then re-raise the cancellation: cleanup must see their final state."""
    gathered = asyncio.gather(*tasks, return_exceptions=True)
    cancelled = False
    while not gathered.done():
        try:
            await asyncio.shield(gathered)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
