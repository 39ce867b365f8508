"""Rank 0's admission: validate a request, hand it to the step loop, stream
its events back on the event loop.

Everything here runs on the asyncio event loop and never blocks: the step
loop is reached through its thread-safe inbox, and each step's events come
back in one `loop.call_soon_threadsafe` (the step loop's `post`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mmsplit.sampling import Sampling
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit.tensors import TensorSpec
from scheduler_svc.errors import InvalidRequest, InvalidTensorRef, MmsplitError
from scheduler_svc.loop import Admission, Event, Failed, Finished, StepLoop, Token
from scheduler_svc.model import ModelInfo
from scheduler_svc.plan import NewRequest
from scheduler_svc.settings import SchedulerSettings

MAX_REQUEST_ID = 128
FLOAT_DTYPES = (1, 2, 3)


class Frontend:
    def __init__(self, step_loop: StepLoop, settings: SchedulerSettings, info: ModelInfo) -> None:
        self.step_loop = step_loop
        self.settings = settings
        self.info = info
        self._streams: dict[str, asyncio.Queue[Event]] = {}

    def admit(self, pb: scheduler_pb2.GenerateRequest) -> Admission:
        """Validate and enqueue; raise MmsplitError (the caller still owns
        the request's segments then). After it returns the scheduler owns them."""
        request = self._validate(pb)
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequest(f"request id {rid!r} is already running")
        reserve = min(len(request.input_ids) + request.sampling.max_tokens, self.info.max_context)
        budget = self.step_loop.kv_budget_tokens
        if reserve > budget:
            raise InvalidRequest(
                f"the prompt ({len(request.input_ids)} tokens) and max_tokens ({request.sampling.max_tokens}) "
                f"need {reserve} tokens of KV cache; this server's budget is {budget}"
            )
        # Events are delivered on this event loop's thread (StepLoop.post).
        events: asyncio.Queue[Event] = asyncio.Queue()
        admission = Admission(request=request, emit=events.put_nowait, reserve=reserve)
        # Ownership first (DESIGN.md §3): lock every segment, then say
        # Accepted; the sender drops its own locks once it hears that.
        try:
            for spec in request.pixel_values:
                lock = spec.lock(self.settings.shm_prefix)
                if lock is not None:
                    admission.locks.append(lock)
            self.step_loop.submit(admission)
        except BaseException:
            admission.unlock()
            raise
        self._streams[rid] = events
        return admission

    async def stream(self, admission: Admission) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The request's events as responses; raises its failure, if any."""
        events = self._streams[admission.request_id]
        while True:
            event = await events.get()
            if isinstance(event, Token):
                yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[event.token_id]))
            elif isinstance(event, Finished):
                yield scheduler_pb2.GenerateResponse(
                    finished=scheduler_pb2.Finished(
                        finish_reason=event.reason,  # type: ignore[arg-type]
                        prompt_tokens=event.prompt_tokens,
                        completion_tokens=event.completion_tokens,
                    )
                )
                return
            elif isinstance(event, Failed):
                raise event.error

    def fail_all(self, error: MmsplitError) -> None:
        """End every open stream with `error` (the group died while the step
        thread may be stuck in a collective and cannot do it)."""
        for events in self._streams.values():
            events.put_nowait(Failed(error))

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def end(self, request_id: str) -> None:
        """Whatever ended the call (finish, failure, cancel, deadline, even a
        cancel before the first event): forget its stream, and have the step
        loop drop the request on every rank if it still runs. Harmless for
        unknown and finished requests."""
        self._streams.pop(request_id, None)
        self.step_loop.abort(request_id)

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
        if len(pb.pixel_values) > self.settings.max_images_per_request:
            raise InvalidRequest(f"{len(pb.pixel_values)} images, at most {self.settings.max_images_per_request}")
        specs = []
        for i, ref in enumerate(pb.pixel_values):
            spec = TensorSpec.from_pb(ref, prefix=self.settings.shm_prefix, max_bytes=self.settings.max_tensor_bytes)
            if spec.dtype not in FLOAT_DTYPES or spec.shape != self.info.image_shape:
                raise InvalidTensorRef(
                    f"image {i}: pixel tensor must be a float tensor of shape {list(self.info.image_shape)}, "
                    f"got dtype {spec.dtype} shape {list(spec.shape)}"
                )
            specs.append(spec)
        placeholders = ids.count(self.info.image_token_id)
        if placeholders != len(specs) * self.info.tokens_per_image:
            raise InvalidRequest(
                f"{placeholders} image placeholder tokens for {len(specs)} image(s); "
                f"each image needs {self.info.tokens_per_image}"
            )
        sampling = Sampling.from_pb(
            pb.sampling,
            max_tokens_limit=self.settings.max_tokens_limit,
            default_max_tokens=self.settings.default_max_tokens,
            vocab_size=self.info.vocab_size,
        )
        return NewRequest(request_id=rid, input_ids=ids, pixel_values=tuple(specs), sampling=sampling)
