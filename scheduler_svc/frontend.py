"""Rank 0's admission: validate a request, hand it to the step loop, stream
its events back on the event loop.

Everything here runs on the asyncio event loop and never blocks: the step
loop is reached through its thread-safe inbox, and each step's events come
back in one `loop.call_soon_threadsafe` (the step loop's `post`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import numpy as np

from mmsplit.common.v1 import common_pb2
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit_server import structured
from mmsplit_server.families import IMAGE, BadItem, is_encoder_input
from mmsplit_server.handoff.reference import TensorSpec
from mmsplit_server.sampling import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, Sampling
from scheduler_svc.errors import InvalidRequest, InvalidTensorRef, MmsplitError
from scheduler_svc.loop import Admission, Event, Failed, Finished, StepLoop, Token
from scheduler_svc.model import ModelInfo
from scheduler_svc.plan import Item, NewRequest
from scheduler_svc.sampler import Logprob
from scheduler_svc.settings import SchedulerSettings

MAX_REQUEST_ID = 128
MAX_CACHE_SALT = 256
# What one request's prompt_logprobs may take in its first message (and in
# the tokenizer's PromptLogprobs, with the ids): within the 4 MiB a gRPC
# client reads by default, with room for the rest.
PROMPT_LOGPROBS_BYTES = 3 * 1024 * 1024
FLOAT_DTYPES = (1, 2, 3)


class Frontend:
    def __init__(
        self,
        step_loop: StepLoop,
        settings: SchedulerSettings,
        info: ModelInfo,
        *,
        cuda_uuids: frozenset[str] = frozenset(),
    ) -> None:
        self.step_loop = step_loop
        self.settings = settings
        self.info = info
        # GPUs whose CUDA IPC handles every rank can open (none: the transport is not offered).
        self.cuda_uuids = cuda_uuids
        # Where each open request's events go (on this event loop's thread,
        # StepLoop.post), and the queue of those `stream` reads.
        self._sinks: dict[str, Callable[[Event], None]] = {}
        self._streams: dict[str, asyncio.Queue[Event]] = {}

    async def ready(self, pb: scheduler_pb2.GenerateRequest) -> None:
        """What `admit` checks that can take milliseconds, done first in a
        thread: compiling a structure (a json_schema: ~19 ms for 48 KB),
        which `admit` then finds compiled. Await it before `admit`: the
        event loop keeps serving every other stream meanwhile."""
        await structured.ready(pb.sampling)

    def admit(self, pb: scheduler_pb2.GenerateRequest, sink: Callable[[Event], None] | None = None) -> Admission:
        """Validate and enqueue; raise MmsplitError (the caller still owns
        the request's segments then). After it returns the scheduler owns them.
        The request's events go to `sink`, or without one to a queue that
        `stream` reads."""
        request = self._validate(pb)
        rid = request.request_id
        if rid in self._sinks:
            raise InvalidRequest(f"request id {rid!r} is already running")
        self._check_prefill(request)
        reserve = min(len(request.input_ids) + request.sampling.max_tokens, self.info.max_context)
        budget = self.step_loop.kv_budget_tokens
        if reserve > budget:
            raise InvalidRequest(
                f"the prompt ({len(request.input_ids)} tokens) and max_tokens ({request.sampling.max_tokens}) "
                f"need {reserve} tokens of KV cache; this server's budget is {budget}"
            )
        events: asyncio.Queue[Event] | None = None
        if sink is None:
            events = asyncio.Queue()
            sink = events.put_nowait
        admission = Admission(request=request, emit=sink, reserve=reserve)
        grammars = self.step_loop.engine.grammars
        if request.sampling.structure and grammars is not None:
            grammars.prepare(rid, request.sampling.structure)  # its matcher, made before it joins
        # Ownership first (DESIGN.md §3): take every tensor over, then say
        # Accepted; the sender disowns its own claims once it hears that.
        try:
            for spec in request.specs:
                claim = spec.take(self.settings.shm_prefix)
                if claim is not None:
                    admission.claims.append(claim)
            self.step_loop.submit(admission)
        except BaseException:
            admission.disown()  # still the sender's to release
            if grammars is not None:
                grammars.forget(rid)
            raise
        self._sinks[rid] = sink
        if events is not None:
            self._streams[rid] = events
        return admission

    def stream(self, admission: Admission) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The request's events as responses (`responses`); raises its failure, if any."""
        return responses(self._streams[admission.request_id], self.settings.stream_interval)

    def fail_all(self, error: MmsplitError) -> None:
        """End every open stream with `error` (the group died while the step
        thread may be stuck in a collective and cannot do it)."""
        for sink in list(self._sinks.values()):
            sink(Failed(error))

    @property
    def open_streams(self) -> int:
        return len(self._sinks)

    def end(self, request_id: str) -> None:
        """Whatever ended the call (finish, failure, cancel, deadline, even a
        cancel before the first event): forget its stream, and have the step
        loop drop the request on every rank if it still runs. Harmless for
        unknown and finished requests."""
        self._sinks.pop(request_id, None)
        self._streams.pop(request_id, None)
        self.step_loop.abort(request_id)
        grammars = self.step_loop.engine.grammars
        if grammars is not None:
            grammars.forget(request_id)  # a matcher made for it before it joined

    def _check_prefill(self, request: NewRequest) -> None:
        """A prompt longer than one step's prefill budget is prefilled in
        chunks; one with media that the model encodes inside its forward (a
        family without separate encoding, or the encoder cache off) cannot
        be cut, so it must fit one step, or it is refused now rather than
        run alone and out of memory later."""
        s, n = self.settings, len(request.input_ids)
        if not request.items or n <= s.max_prefill_tokens:
            return
        if self.info.family.caches_encoder_outputs and s.encoder_cache_bytes:
            return
        why = "--encoder-cache-bytes is 0" if self.info.family.caches_encoder_outputs else "its family encodes it"
        raise InvalidRequest(
            f"a prompt of {n} tokens with media is prefilled in one step here (the forward encodes the media: "
            f"{why}), and one step's prefill is limited to --max-prefill-tokens {s.max_prefill_tokens}; send "
            "fewer or smaller media, or raise the limit"
        )

    def _validate(self, pb: scheduler_pb2.GenerateRequest) -> NewRequest:
        rid = pb.request_id
        if not rid or len(rid) > MAX_REQUEST_ID or not rid.isprintable():
            raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID} printable characters")
        # Count before converting: a huge message costs nothing more to refuse.
        count = len(pb.input_ids)
        if not count:
            raise InvalidRequest("input_ids is empty")
        if count >= self.info.max_context:
            raise InvalidRequest(f"prompt of {count} tokens does not fit the context of {self.info.max_context}")
        ids = tuple(pb.input_ids)
        if max(ids) >= self.info.vocab_size:
            raise InvalidRequest(f"token id {max(ids)} is outside the vocabulary of {self.info.vocab_size}")
        items = self._items(pb, ids)
        sampling = Sampling.from_pb(
            pb.sampling,
            max_tokens_limit=self.settings.max_tokens_limit,
            default_max_tokens=self.settings.default_max_tokens,
            vocab_size=self.info.vocab_size,
        )
        if len(pb.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(
                f"cache_salt must be at most {MAX_CACHE_SALT} characters", metadata={"param": "cache_salt"}
            )
        if sampling.prompt_logprobs is not None:
            check_prompt_logprobs(count, sampling.prompt_logprobs)
        return NewRequest(
            request_id=rid,
            input_ids=ids,
            items=items,
            sampling=sampling,
            cache_salt=pb.cache_salt,
            bad_words=self._bad_words(pb),
            priority=self._priority(pb),
        )

    def _priority(self, pb: scheduler_pb2.GenerateRequest) -> int:
        if pb.priority and self.settings.scheduling_policy != "priority":
            raise InvalidRequest(
                f"priority {pb.priority}: this scheduler admits requests first come first served "
                "(--scheduling-policy fcfs); send 0",
                metadata={"param": "priority"},
            )
        return pb.priority

    def _bad_words(self, pb: scheduler_pb2.GenerateRequest) -> tuple[tuple[int, ...], ...]:
        if len(pb.bad_words) > MAX_BAD_WORD_SEQUENCES:
            raise InvalidRequest(
                f"bad_words has {len(pb.bad_words)} token sequences, at most {MAX_BAD_WORD_SEQUENCES}",
                metadata={"param": "bad_words"},
            )
        words = tuple(tuple(word.token_ids) for word in pb.bad_words)
        for i, word in enumerate(words):
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise InvalidRequest(
                    f"bad_words[{i}] has {len(word)} token ids; each sequence has 1 to {MAX_BAD_WORD_TOKENS}",
                    metadata={"param": "bad_words"},
                )
            if max(word) >= self.info.vocab_size:
                raise InvalidRequest(
                    f"bad_words[{i}]: token id {max(word)} is outside the vocabulary of {self.info.vocab_size}",
                    metadata={"param": "bad_words"},
                )
        return words

    # ---- multimodal items ----
    def _items(self, pb: scheduler_pb2.GenerateRequest, ids: tuple[int, ...]) -> tuple[Item, ...]:
        """Every item checked against the model family's rule, and its
        placeholder runs against `ids`, here, before any rank sees it."""
        if pb.pixel_values and pb.items:
            raise InvalidRequest("a request sets either items or the legacy pixel_values, not both")
        count = len(pb.items) or len(pb.pixel_values)
        if count > self.settings.max_images_per_request:
            raise InvalidRequest(f"{count} media items, at most {self.settings.max_images_per_request}")
        items = self._legacy_items(pb, ids) if pb.pixel_values else [self._item(i, it) for i, it in enumerate(pb.items)]
        family = self.info.family
        placeholder_ids = {p.token_id: m for m, p in family.placeholders.items()}
        claimed = 0
        end = 0
        for i, (item, tokens) in enumerate(items):
            holder = family.placeholders[item.modality].token_id
            total = 0
            for offset, length in item.placeholders:
                if length < 1 or offset < end or offset + length > len(ids):
                    raise InvalidRequest(
                        f"item {i}: placeholder run [{offset}, {offset + length}) is empty, out of order, "
                        f"overlapping or outside the {len(ids)} prompt tokens"
                    )
                if any(t != holder for t in ids[offset : offset + length]):
                    raise InvalidRequest(
                        f"item {i}: placeholder run [{offset}, {offset + length}) holds tokens other than {holder}"
                    )
                end = offset + length
                total += length
            if total != tokens:
                raise InvalidRequest(f"item {i}: its placeholder runs hold {total} tokens; its tensors need {tokens}")
            claimed += total
        stray = sum(1 for t in ids if t in placeholder_ids)
        if stray != claimed:
            raise InvalidRequest(f"the prompt has {stray} placeholder tokens; its items claim {claimed}")
        try:
            family.check_runs([item for item, _ in items])
        except BadItem as exc:
            raise InvalidRequest(str(exc)) from exc
        return tuple(item for item, _ in items)

    def _item(self, index: int, pb: common_pb2.MultimodalItem) -> tuple[Item, int]:
        """One item of `items`: (validated item, its placeholder count)."""
        family = self.info.family
        if pb.modality not in family.placeholders:
            raise InvalidRequest(f"item {index}: modality {pb.modality} is not one this model takes")
        if len(pb.tensors) > MAX_ITEM_TENSORS:
            raise InvalidRequest(f"item {index}: {len(pb.tensors)} tensors, at most {MAX_ITEM_TENSORS}")
        encoder: list[tuple[str, TensorSpec]] = []
        side: dict[str, np.ndarray] = {}
        for name in sorted(pb.tensors):
            if name not in family.input_names:
                allowed = ", ".join(sorted(family.input_names))
                raise InvalidRequest(f"item {index}: {name!r} is not an input of this model (allowed: {allowed})")
            spec = self._spec(pb.tensors[name])
            if is_encoder_input(name):
                if spec.dtype not in FLOAT_DTYPES:
                    raise InvalidTensorRef(f"item {index}: {name} must be a float tensor, got dtype {spec.dtype}")
                encoder.append((name, spec))
            else:
                side[name] = _side_tensor(index, name, spec)
        shapes = {name: spec.shape for name, spec in encoder}
        try:
            tokens = family.count(pb.modality, shapes, side)
        except (BadItem, ArithmeticError) as exc:  # arithmetic on values the client sent
            raise InvalidRequest(f"item {index}: {exc}") from exc
        if not self.settings.one_frame_image_rows and family.one_frame_rows(pb.modality, shapes):
            raise InvalidRequest(
                f"item {index}: an image's rows of one frame, which this scheduler does not take "
                "(--one-frame-image-rows false); send all of its frames' rows"
            )
        runs = tuple((int(r.offset), int(r.length)) for r in pb.placeholders)
        item = Item(pb.modality, tuple(encoder), side, runs, bytes(pb.content_hash[:64]))
        return item, tokens

    def _spec(self, ref: common_pb2.TensorRef) -> TensorSpec:
        s = self.settings
        return TensorSpec.from_pb(ref, prefix=s.shm_prefix, max_bytes=s.max_tensor_bytes, cuda_uuids=self.cuda_uuids)

    def _legacy_items(self, pb: scheduler_pb2.GenerateRequest, ids: tuple[int, ...]) -> list[tuple[Item, int]]:
        """`pixel_values` (one [C,H,W] tensor per image, LLaVA-1.5) as items:
        each image's placeholders are the next `tokens_per_image` positions
        holding the image token, which must be one run."""
        if not self.info.image_shape:
            raise InvalidRequest(f"this model ({self.info.family.name}) takes media as items, not pixel_values")
        per_image = self.info.tokens_per_image
        positions = [i for i, t in enumerate(ids) if t == self.info.image_token_id]
        if len(positions) != len(pb.pixel_values) * per_image:
            raise InvalidRequest(
                f"{len(positions)} image placeholder tokens for {len(pb.pixel_values)} image(s); "
                f"each image needs {per_image}"
            )
        items = []
        for i, ref in enumerate(pb.pixel_values):
            spec = self._spec(ref)
            if spec.dtype not in FLOAT_DTYPES or spec.shape != self.info.image_shape:
                raise InvalidTensorRef(
                    f"image {i}: pixel tensor must be a float tensor of shape {list(self.info.image_shape)}, "
                    f"got dtype {spec.dtype} shape {list(spec.shape)}"
                )
            mine = positions[i * per_image : (i + 1) * per_image]
            if mine[-1] - mine[0] != per_image - 1:
                raise InvalidRequest(f"image {i}: its {per_image} placeholder tokens are not one run")
            spec = dataclasses.replace(spec, shape=(1, *spec.shape))
            items.append((Item(IMAGE, (("pixel_values", spec),), {}, ((mine[0], per_image),)), per_image))
        return items


MAX_ITEM_TENSORS = 8
# Side tensors are a few integers or floats; they travel inline.
MAX_SIDE_BYTES = 1024
SIDE_DTYPES = {1: np.float32, 5: np.int64}


def _side_tensor(index: int, name: str, spec: TensorSpec) -> np.ndarray:
    if spec.inline is None or spec.nbytes > MAX_SIDE_BYTES or spec.dtype not in SIDE_DTYPES:
        raise InvalidTensorRef(
            f"item {index}: {name} is a side tensor: inline, int64 or float32, at most {MAX_SIDE_BYTES} bytes"
        )
    return np.frombuffer(spec.inline, dtype=SIDE_DTYPES[spec.dtype]).reshape(spec.shape).copy()


def prompt_logprobs_bytes(prompt: int, top: int) -> int:
    """At most what a prompt's log probabilities take on the wire: per
    token, its id and an entry (log probability, rank, `top` ids and values)."""
    return max(prompt - 1, 0) * (25 + 11 * top)


def check_prompt_logprobs(prompt: int, top: int) -> None:
    """INVALID_REQUEST when a prompt of `prompt` tokens scored with `top`
    top tokens could pass PROMPT_LOGPROBS_BYTES."""
    size = prompt_logprobs_bytes(prompt, top)
    if size > PROMPT_LOGPROBS_BYTES:
        most = PROMPT_LOGPROBS_BYTES // (25 + 11 * top) + 1
        raise InvalidRequest(
            f"sampling.prompt_logprobs {top} for a prompt of {prompt} tokens: the answer would take up to "
            f"{size >> 10} KiB, over {PROMPT_LOGPROBS_BYTES >> 10} KiB (at most {most} tokens with {top} top "
            "tokens each; ask for fewer)",
            metadata={"param": "sampling.prompt_logprobs"},
        )


def _logprob_pb(lp: Logprob | None) -> common_pb2.TokenLogprob:
    if lp is None:
        return common_pb2.TokenLogprob()
    return common_pb2.TokenLogprob(
        logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs, rank=lp.rank
    )


def add_tokens(message: scheduler_pb2.Tokens, tokens: list[Token]) -> None:
    """Append `tokens` (and their logprobs, when the request asked) to a Tokens message."""
    message.token_ids.extend(t.token_id for t in tokens)
    if tokens[0].logprob is not None:
        message.logprobs.extend(_logprob_pb(t.logprob) for t in tokens)
    if tokens[0].prompt_logprobs is not None:  # a request's first token: the first of its first message
        message.prompt_logprobs.extend(_logprob_pb(lp) for lp in tokens[0].prompt_logprobs)


def finished_pb(event: Finished) -> scheduler_pb2.Finished:
    return scheduler_pb2.Finished(
        finish_reason=event.reason,  # type: ignore[arg-type]
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
    )


async def responses(events: asyncio.Queue[Event], interval: int = 1) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
    """A request's events as responses, ending with Finished (or raising the
    failure). The first token goes out as soon as it comes (time to first
    token); after it, each Tokens message waits for `interval` tokens
    (`--stream-interval`), or the end. Tokens that queued up while the last
    message was being sent go out together in any case, so a call that
    fell behind catches up one message at a time, not one per token."""
    event = await events.get()
    want = 1  # tokens the next message waits for: the first goes alone
    while True:
        if isinstance(event, Token):
            tokens = [event]
            after: Event | None = None
            while after is None and (len(tokens) < want or not events.empty()):
                queued = await events.get()  # no wait while the queue holds one
                if isinstance(queued, Token):
                    tokens.append(queued)
                else:
                    after = queued
            want = interval
            message = scheduler_pb2.Tokens(cached_tokens=tokens[0].cached_tokens)
            add_tokens(message, tokens)
            yield scheduler_pb2.GenerateResponse(tokens=message)
            event = after if after is not None else await events.get()
        elif isinstance(event, Finished):
            yield scheduler_pb2.GenerateResponse(finished=finished_pb(event))
            return
        else:
            raise event.error
