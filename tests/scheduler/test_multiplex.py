"""`StreamCall` (scheduler_svc/multiplex.py) without gRPC: what a step's
events become in the call's messages, refusals, cancels, and when the call
is done. A stand-in frontend takes the admissions; the test plays the step
loop by calling the requests' sinks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmsplit.scheduler.v1 import scheduler_pb2
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.loop import Event, Failed, Finished, Token
from scheduler_svc.multiplex import StreamCall


@dataclass
class _Settings:
    stream_interval: int = 1


@dataclass
class FakeFrontend:
    settings: _Settings = field(default_factory=_Settings)
    sinks: dict[str, Callable[[Event], None]] = field(default_factory=dict)
    ended: list[str] = field(default_factory=list)
    fail_with: dict[str, Exception] = field(default_factory=dict)

    async def ready(self, pb: scheduler_pb2.GenerateRequest) -> None:
        pass

    def admit(self, pb: scheduler_pb2.GenerateRequest, sink: Callable[[Event], None]) -> None:
        if pb.request_id in self.fail_with:
            raise self.fail_with[pb.request_id]
        self.sinks[pb.request_id] = sink

    def end(self, rid: str) -> None:
        self.ended.append(rid)


def make_call(interval: int = 1, draining: bool = False) -> tuple[StreamCall, FakeFrontend]:
    frontend = FakeFrontend(settings=_Settings(interval))
    return StreamCall(frontend, None, lambda: draining), frontend  # type: ignore[arg-type]


def request(rid: str) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(request_id=rid, input_ids=[1, 2, 3])


def events(call: StreamCall) -> list[tuple[str, str, Any]]:
    """The next message's events as (request id, kind, what it carries)."""
    message = call.take()
    assert message is not None
    call.written()
    out = []
    for e in message.events:
        kind = e.WhichOneof("event")
        what: Any = None
        if kind == "tokens":
            what = list(e.tokens.token_ids)
        elif kind == "failed":
            what = e.failed.reason
        elif kind == "finished":
            what = e.finished.completion_tokens
        out.append((e.request_id, kind, what))
    return out


def finished(n: int) -> Finished:
    return Finished(reason=2, prompt_tokens=3, completion_tokens=n)


def test_a_step_s_tokens_for_every_request_go_in_one_message_and_a_backlog_joins_one_event() -> None:
    call, frontend = make_call()
    call.start(request("a"))
    call.start(request("b"))
    assert events(call) == [("a", "accepted", None), ("b", "accepted", None)]
    frontend.sinks["a"](Token(10))
    frontend.sinks["b"](Token(20))
    assert events(call) == [("a", "tokens", [10]), ("b", "tokens", [20])]
    # Two steps before the writer came back: one Tokens event each.
    for step in range(2):
        frontend.sinks["a"](Token(11 + step))
        frontend.sinks["b"](Token(21 + step))
    frontend.sinks["b"](finished(4))
    assert events(call) == [("a", "tokens", [11, 12]), ("b", "tokens", [21, 22]), ("b", "finished", 4)]
    assert frontend.ended == ["b"], "a request ends once its last event is sent"
    assert not call.done, "the caller has not half-closed"


def test_stream_interval_holds_tokens_after_the_first_and_flushes_them_before_the_end() -> None:
    call, frontend = make_call(interval=4)
    call.start(request("a"))
    events(call)
    for token in range(6):
        frontend.sinks["a"](Token(token))
    assert events(call) == [("a", "tokens", [0, 1, 2, 3, 4])], "the first alone, then four"
    frontend.sinks["a"](Token(6))
    assert call.take() is None, "one token waits for three more"
    frontend.sinks["a"](finished(7))
    assert events(call) == [("a", "tokens", [5, 6]), ("a", "finished", 7)]


def test_a_refused_request_fails_alone_and_a_bug_is_internal_to_its_request() -> None:
    call, frontend = make_call()
    frontend.fail_with = {"bad": InvalidRequest("no input ids"), "bug": KeyError("oops")}
    for rid in ("bad", "bug", "good"):
        call.start(request(rid))
    assert events(call) == [
        ("bad", "failed", "INVALID_REQUEST"),
        ("bug", "failed", "INTERNAL"),
        ("good", "accepted", None),
    ]
    frontend.sinks["good"](Failed(InvalidRequest("its tensors")))
    assert events(call) == [("good", "failed", "INVALID_REQUEST")]
    assert frontend.ended == ["good"]


def test_a_cancelled_request_gets_nothing_more_and_the_call_is_done_when_the_caller_has_half_closed() -> None:
    call, frontend = make_call()
    call.start(request("a"))
    call.start(request("b"))
    events(call)
    frontend.sinks["a"](Token(1))
    call.cancel("a")
    assert frontend.ended == ["a"], "cancelled: every rank drops it"
    frontend.sinks["a"](Token(2))
    frontend.sinks["a"](finished(2))
    call.cancel("unknown")
    call.reading = False  # the caller half-closed
    assert not call.done, "b is still open"
    frontend.sinks["b"](finished(0))
    sent = events(call)
    assert ("a", "finished", 2) not in sent
    assert ("b", "finished", 0) in sent
    assert call.done


def test_a_draining_server_ends_an_idle_call_and_a_closed_call_cancels_what_is_open() -> None:
    idle, _ = make_call(draining=True)
    assert idle.done
    call, frontend = make_call()
    call.start(request("a"))
    call.start(request("b"))
    frontend.sinks["b"](finished(0))  # its last event not yet sent
    call.close()
    assert sorted(frontend.ended) == ["a", "b"]
