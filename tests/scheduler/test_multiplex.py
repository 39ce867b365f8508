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


def test_prompt_logprobs_cut_the_call_s_messages_to_their_budget_in_order() -> None:
    """Requests whose first message carries prompt log probabilities (up to
    PROMPT_LOGPROBS_BYTES each) go in messages of about MESSAGE_BYTES: every
    event once, in order, each request's tokens still joined while its event
    waits, and a request ends only once its last event went out."""
    from scheduler_svc.frontend import PROMPT_LOGPROBS_BYTES
    from scheduler_svc.multiplex import MESSAGE_BYTES
    from scheduler_svc.sampler import Logprob

    call, frontend = make_call()
    names = ["a", "b", "c", "d"]
    for rid in names:
        call.start(request(rid))
    events(call)
    # As large as a request's may be: the most entries with 20 top tokens (ids of 3-byte varints).
    entry = Logprob(-1.5, tuple(range(100_000, 100_020)), tuple(-float(k) for k in range(20)), 150_000)
    scored = (entry,) * (PROMPT_LOGPROBS_BYTES // (25 + 11 * 20))
    for rid in names:
        frontend.sinks[rid](Token(5, None, 0, scored))
    frontend.sinks["d"](Token(6))  # a second token while its first event waits: joined to it
    frontend.sinks["d"](finished(2))
    messages = []
    while (message := call.take()) is not None:
        messages.append(message)
        assert message.ByteSize() <= MESSAGE_BYTES or len(message.events) == 1
        if not any(e.request_id == "d" and e.HasField("finished") for m in messages for e in m.events):
            assert "d" not in frontend.ended, "ended before its Finished went out"
        call.written()
    assert len(messages) >= 2  # not one message of the four (~6 MB)
    got = [(e.request_id, e.WhichOneof("event")) for m in messages for e in m.events]
    assert got == [(rid, "tokens") for rid in names] + [("d", "finished")]
    d = next(e for m in messages for e in m.events if e.request_id == "d" and e.HasField("tokens"))
    assert list(d.tokens.token_ids) == [5, 6]
    assert all(len(e.tokens.prompt_logprobs) == len(scored) for m in messages for e in m.events if e.HasField("tokens"))
    assert frontend.ended == ["d"]
    # Small events go back to one message for all.
    for rid in names[:3]:
        frontend.sinks[rid](Token(7))
    assert events(call) == [(rid, "tokens", [7]) for rid in names[:3]]


def test_the_bound_on_prompt_logprobs_bytes_holds_on_the_wire() -> None:
    """`prompt_logprobs_bytes` is at least what a PromptLogprobs of that many
    tokens takes (ids and ranks of a 250,000-token vocabulary), for 0 to 20
    top tokens; the scheduler refuses a request over PROMPT_LOGPROBS_BYTES."""
    import pytest

    from mmsplit.common.v1 import common_pb2
    from mmsplit.tokenizer.v1 import tokenizer_pb2
    from mmsplit_server.sampling import Sampling
    from scheduler_svc.frontend import PROMPT_LOGPROBS_BYTES, check_prompt_logprobs, prompt_logprobs_bytes

    for top in (0, 1, 5, 20):
        entry = common_pb2.TokenLogprob(
            logprob=-1.25, top_token_ids=[249_999 - k for k in range(top)], top_logprobs=[-0.5] * top, rank=249_999
        )
        scored = tokenizer_pb2.PromptLogprobs(token_ids=[249_999] * 1000, logprobs=[entry] * 999)
        assert scored.ByteSize() <= prompt_logprobs_bytes(1000, top), top
        most = PROMPT_LOGPROBS_BYTES // (25 + 11 * top) + 1
        check_prompt_logprobs(most, top)
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            check_prompt_logprobs(most + 1, top)
    assert Sampling(max_tokens=1).prompt_logprobs is None
