"""Requests to one scheduler over one `GenerateStream` call.

The scheduler sends a step's events for every request on the call in one
message (`scheduler_svc.multiplex`), where `Generate` costs a message per
request and step; gRPC's per-message work is most of what a streamed token
costs the tokenizer. `StreamedCalls.generate` yields the same
`GenerateResponse` events and raises the same errors as a `Generate` call
would, so the service cannot tell the two apart:

- a request's failure comes as its `RequestFailed` event and is raised as
  the `RemoteError` its call's ErrorInfo would have made;
- its deadline is kept here: when it passes, the request is cancelled
  downstream and fails DEADLINE_EXCEEDED as a call's deadline does;
- closing the generator early (the client went away, a stop string)
  sends `cancel`, as cancelling the call would;
- when the call itself fails or ends, every request on it fails with the
  call's error (`SchedulerLink` reads it as it reads a failed `Generate`);
  the next request opens a new call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeAlias

import grpc

from mmsplit.errors import E, RemoteError, code_of_reason
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit_server.serving import Handed


class _Deadline:
    """Put in a request's queue when its deadline passes."""


DEADLINE = _Deadline()
# What a request's queue holds: its events, the deadline's mark, or what
# ended the call (an AioRpcError, or CallEnded).
_Item: TypeAlias = scheduler_pb2.RequestEvent | _Deadline | BaseException


class CallEnded(Exception):
    """The call ended without an error status (the scheduler drains): the
    request did not run there. `SchedulerLink` reads it as UNAVAILABLE."""


class _Call:
    """One `GenerateStream` call and the requests on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.routes: dict[str, asyncio.Queue[_Item]] = {}
        self.ended: BaseException | None = None
        # Messages go out from a task of their own: gRPC cancels the whole
        # call when a task is cancelled inside its write, and a request's
        # task is cancelled whenever its client goes away.
        self._outgoing: asyncio.Queue[scheduler_pb2.GenerateStreamRequest] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    async def _read(self) -> None:
        ended: BaseException
        try:
            async for message in self.call:
                for event in message.events:
                    queue = self.routes.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
            ended = CallEnded("the scheduler ended the stream of requests")
        except grpc.aio.AioRpcError as exc:
            ended = exc
        except asyncio.CancelledError:
            self._end(CallEnded("the stream of requests was closed"))
            raise
        self._end(ended)

    def _end(self, ended: BaseException) -> None:
        """Every request on the call fails with what ended it; no more writes."""
        self.ended = ended
        self._writer.cancel()
        for queue in self.routes.values():
            queue.put_nowait(ended)

    async def _write(self) -> None:
        while True:
            message = await self._outgoing.get()
            if message.HasField("generate") and message.generate.request_id not in self.routes:
                # Given up before it went out (its client left): the scheduler
                # need never hear of it, and its tensors' grants are revoked.
                continue
            try:
                await self.call.write(message)
            except Exception:
                # The call is broken: ending it ends every request on it,
                # with the status the reader gets.
                self.call.cancel()
                return

    async def generate(
        self, request: Handed[scheduler_pb2.GenerateRequest] | scheduler_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        """The request's events; one handed over is let go once queued to
        be written (its message on the call is a copy)."""
        message: scheduler_pb2.GenerateRequest = Handed.of(request).take()
        del request
        rid = message.request_id
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.routes[rid] = queue
        loop = asyncio.get_running_loop()
        timer = None if timeout_s is None else loop.call_later(timeout_s, queue.put_nowait, DEADLINE)
        over = False  # the scheduler has said the request's last word
        try:
            if self.ended is not None:
                queue.put_nowait(self.ended)
            else:
                self._outgoing.put_nowait(scheduler_pb2.GenerateStreamRequest(generate=message))
            del message
            held: _Item | None = None  # taken from the queue, not yet handled
            while True:
                if held is not None:
                    event, held = held, None
                else:
                    event = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(event, _Deadline):
                    raise RemoteError(E.ERROR_CODE_DEADLINE_EXCEEDED, "Deadline Exceeded")
                if isinstance(event, BaseException):
                    over = True
                    raise event
                kind = event.WhichOneof("event")
                if kind == "tokens":
                    response = scheduler_pb2.GenerateResponse(tokens=event.tokens)
                    # Tokens that queued up while the request's last ones
                    # were relayed go on together: fewer messages, and one
                    # decode, for a request that fell behind.
                    while held is None and not queue.empty():
                        after = queue.get_nowait()
                        if isinstance(after, scheduler_pb2.RequestEvent) and after.WhichOneof("event") == "tokens":
                            response.tokens.token_ids.extend(after.tokens.token_ids)
                            response.tokens.logprobs.extend(after.tokens.logprobs)
                        else:
                            held = after  # the next to handle
                    yield response
                elif kind == "accepted":
                    yield scheduler_pb2.GenerateResponse(accepted=event.accepted)
                elif kind == "finished":
                    over = True
                    yield scheduler_pb2.GenerateResponse(finished=event.finished)
                    return
                elif kind == "failed":
                    over = True
                    f = event.failed
                    raise RemoteError(code_of_reason(f.reason), f.message, metadata=dict(f.metadata))
        finally:
            if timer is not None:
                timer.cancel()
            del self.routes[rid]
            if not over and self.ended is None:
                # As cancelling its call would: every rank drops it.
                cancel = scheduler_pb2.Cancel(request_id=rid)
                self._outgoing.put_nowait(scheduler_pb2.GenerateStreamRequest(cancel=cancel))

    def close(self) -> None:
        self.call.cancel()


class StreamedCalls:
    """A scheduler's `GenerateStream` call, opened on the first request and
    again after it ends."""

    def __init__(
        self, stub: scheduler_pb2_grpc.SchedulerServiceStub, metadata: Callable[[], Sequence[tuple[str, str]]]
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._call: _Call | None = None

    def generate(
        self, request: Handed[scheduler_pb2.GenerateRequest] | scheduler_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        """The request's events, as a `Generate` call of it would give them."""
        if self._call is None or self._call.ended is not None:
            self._call = _Call(self._stub.GenerateStream(metadata=self._metadata()))
        return self._call.generate(request, timeout_s)

    def close(self) -> None:
        if self._call is not None:
            self._call.close()
