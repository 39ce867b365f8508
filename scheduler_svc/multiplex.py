"""`GenerateStream`: many requests over one call, the events of a step in one message.

A tokenizer that streams 32 requests' tokens through `Generate` receives 32
messages a step, and gRPC's per-message work on both sides is most of the
CPU a streamed token costs (bench/RESULTS.md, `bench/engine.py`). Over one
`GenerateStream` call the step's events for every request on the call go
out as one `GenerateStreamResponse`: the step loop hands a step's events to
the event loop in one callback (`StepLoop.post`), each request's events are
added to the call's outbox there, and the writer sends the outbox once that
callback is done.

Per request the call means what `Generate` means (the same admission, the
same events, the same errors and their codes, `--stream-interval`), with
two differences a multiplexed call cannot avoid: a request's failure is an
event (`RequestFailed`, the ErrorInfo its own call would have ended with),
and the caller cancels a request with a `cancel` message instead of
cancelling a call. The call itself fails only as a whole: the caller not
being ours (pairing), or the transport.

Ownership (DESIGN.md §3) is per request as with `Generate`: the scheduler
owns a request's tensors from its Accepted event on. A request still open
when the call ends (the caller went away) is cancelled on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import InternalError, MmsplitError
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit_server.metrics import ServiceMetrics
from mmsplit_server.serving import RequestSummary
from scheduler_svc.frontend import Frontend, add_tokens, finished_pb
from scheduler_svc.loop import Event, Failed, Finished, Token

log = logging.getLogger(__name__)
# A message of the call is cut after the event that takes it past this
# size when the outbox holds prompt log probabilities (the tokenizer reads
# up to 16 MiB; each request's are at most PROMPT_LOGPROBS_BYTES).
MESSAGE_BYTES = 4 * 1024 * 1024


def failed_event(rid: str, error: MmsplitError) -> scheduler_pb2.RequestEvent:
    """A request's failure as an event: what `MmsplitError.to_status` puts
    in its call's ErrorInfo (reason, message, metadata)."""
    failed = scheduler_pb2.RequestFailed(reason=error.reason, message=error.message, metadata=error.metadata)
    return scheduler_pb2.RequestEvent(request_id=rid, failed=failed)


class _Request:
    """One request on the call, from its admission to its last event."""

    __slots__ = ("held", "rid", "sent_first", "summary")

    def __init__(self, rid: str, summary: RequestSummary) -> None:
        self.rid = rid
        self.summary = summary
        self.held: list[Token] = []  # tokens waiting for --stream-interval
        self.sent_first = False


class StreamCall:
    """The requests of one `GenerateStream` call and the events not yet sent.

    Runs on the event loop alone: `start` and `cancel` from the reader,
    the requests' events from the step loop's posted callback, `take` and
    `written` from the writer."""

    def __init__(self, frontend: Frontend, metrics: ServiceMetrics | None, draining: Callable[[], bool]) -> None:
        self.frontend = frontend
        self.metrics = metrics
        self.interval = frontend.settings.stream_interval
        self._draining = draining
        self.open: dict[str, _Request] = {}
        self.reading = True  # until the caller half-closes
        self.started = 0  # requests the call has carried
        self.wake = asyncio.Event()
        self._outbox: list[scheduler_pb2.RequestEvent] = []
        # A request's Tokens event still in the outbox: later tokens join it.
        self._joinable: dict[str, scheduler_pb2.RequestEvent] = {}
        # Requests whose last event is in the outbox: ended once it is sent.
        self._ending: list[_Request] = []
        # The outbox holds a request's prompt_logprobs: messages are cut to MESSAGE_BYTES.
        self._large = False

    # ---- the reader
    async def read(self, messages: AsyncIterator[scheduler_pb2.GenerateStreamRequest]) -> None:
        async for message in messages:
            action = message.WhichOneof("action")
            if action == "generate":
                # This stream's next messages wait (its order is kept); other streams go on.
                await self.frontend.ready(message.generate)
                self.start(message.generate)
            elif action == "cancel":
                self.cancel(message.cancel.request_id)
        self.reading = False
        self.wake.set()

    def start(self, pb: scheduler_pb2.GenerateRequest) -> None:
        rid = pb.request_id
        self.started += 1
        summary = RequestSummary(rid, quiet=pb.search_step, items=len(pb.items) + len(pb.pixel_values))
        request = _Request(rid, summary)
        try:
            # A request id still open anywhere is refused, as by Generate.
            self.frontend.admit(pb, sink=lambda event: self._on_event(request, event))
        except MmsplitError as exc:
            log.info("request %s rejected: %s", rid, exc)
            self._refuse(request, exc)
            return
        except Exception:
            # A bug of ours fails this request alone, not the call's others.
            incident = uuid.uuid4().hex[:12]
            log.exception("request %s failed on an unexpected error (incident %s)", rid, incident)
            self._refuse(request, InternalError(f"internal error (incident {incident})"))
            return
        self.open[rid] = request
        self._push(scheduler_pb2.RequestEvent(request_id=rid, accepted=scheduler_pb2.Accepted()))

    def _refuse(self, request: _Request, error: MmsplitError) -> None:
        request.summary.outcome = error.reason
        request.summary.log(log, self.metrics)
        self._push(failed_event(request.rid, error))

    def cancel(self, rid: str) -> None:
        """The caller gave the request up (its client went away, its
        deadline passed, a stop string ended it): nothing more is sent
        for it. Unknown and ended requests are ignored."""
        request = self.open.pop(rid, None)
        if request is not None:
            self._end(request)

    # ---- the step loop's events (on the event loop)
    def _on_event(self, request: _Request, event: Event) -> None:
        if self.open.get(request.rid) is not request:
            return  # cancelled meanwhile
        if isinstance(event, Token):
            request.summary.token()
            request.held.append(event)
            if not request.sent_first or len(request.held) >= self.interval:
                self._send_held(request)
            return
        self._send_held(request)
        if isinstance(event, Finished):
            reason = common_pb2.FinishReason.Name(event.reason)  # type: ignore[arg-type]
            request.summary.finished(reason, event.prompt_tokens, event.completion_tokens)
            self._push(scheduler_pb2.RequestEvent(request_id=request.rid, finished=finished_pb(event)))
        else:
            assert isinstance(event, Failed)
            request.summary.outcome = event.error.reason
            self._push(failed_event(request.rid, event.error))
        del self.open[request.rid]
        self._ending.append(request)

    def _send_held(self, request: _Request) -> None:
        """Move the request's held tokens into the outbox, joining its Tokens
        event there when one is not yet sent (one event per request and message)."""
        held = request.held
        if not held:
            return
        event = self._joinable.get(request.rid)
        if event is None:
            event = scheduler_pb2.RequestEvent(request_id=request.rid)
            event.tokens.cached_tokens = held[0].cached_tokens
            self._push(event)
            self._joinable[request.rid] = event
        add_tokens(event.tokens, held)
        self._large = self._large or held[0].prompt_logprobs is not None
        request.sent_first = True
        request.held = []

    def _push(self, event: scheduler_pb2.RequestEvent) -> None:
        self._outbox.append(event)
        self.wake.set()

    # ---- the writer
    def take(self) -> scheduler_pb2.GenerateStreamResponse | None:
        """Everything to send now, as one message (None when nothing is)."""
        self.wake.clear()
        if not self._outbox:
            return None
        events = _within(self._outbox, MESSAGE_BYTES) if self._large else self._outbox
        self._outbox = self._outbox[len(events) :]
        if not self._outbox:
            self._joinable, self._large = {}, False
            return scheduler_pb2.GenerateStreamResponse(events=events)
        for event in events:  # those left may still take tokens
            if self._joinable.get(event.request_id) is event:
                del self._joinable[event.request_id]
        self.wake.set()  # the rest goes in the next message
        return scheduler_pb2.GenerateStreamResponse(events=events)

    def written(self) -> None:
        """The requests whose last event went out end now."""
        waiting = {event.request_id for event in self._outbox}
        ending = [r for r in self._ending if r.rid not in waiting]
        self._ending = [r for r in self._ending if r.rid in waiting]
        for request in ending:
            self._end(request)

    @property
    def done(self) -> bool:
        """Nothing open, nothing to send, and the caller has half-closed or
        the server is draining (the caller opens a new call for its next
        request, which a draining server refuses)."""
        return not self.open and not self._outbox and not self._ending and (not self.reading or self._draining())

    def close(self) -> None:
        """The call ended: every request still open is cancelled (every rank drops it)."""
        for request in [*self.open.values(), *self._ending]:
            self._end(request)
        self.open.clear()
        self._ending = []

    def _end(self, request: _Request) -> None:
        self.frontend.end(request.rid)
        request.summary.log(log, self.metrics)


def _within(events: list[scheduler_pb2.RequestEvent], budget: int) -> list[scheduler_pb2.RequestEvent]:
    """The first of `events` whose message stays within `budget` bytes (one at least)."""
    size = 0
    for n, event in enumerate(events):
        size += event.ByteSize() + 8  # its tag and length in the message
        if n and size > budget:
            return events[:n]
    return events


async def serve(
    call: StreamCall, messages: AsyncIterator[scheduler_pb2.GenerateStreamRequest]
) -> AsyncIterator[scheduler_pb2.GenerateStreamResponse]:
    """The call's responses: a message each time events wait, until
    `call.done`; the reader's failure (not ours: the transport) ends it."""
    reader = asyncio.create_task(call.read(messages))
    reader.add_done_callback(lambda _: call.wake.set())
    try:
        while True:
            await call.wake.wait()
            message = call.take()
            if message is not None:
                yield message
            call.written()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            if call.done:
                return
    finally:
        reader.cancel()
        call.close()
