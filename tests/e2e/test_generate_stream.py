"""GenerateStream: many requests over one call (`scheduler_svc.multiplex`),
driven straight by a test client, and the tokenizer's use of it
(`tokenizer_svc.multiplex`)."""

from __future__ import annotations

import queue
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit_cli.client import make_request, run_request
from scheduler_svc.model import model_info
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import rank_active_requests, tokenizer_stub
from tests.support.leaks import wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import start_tokenizer
from tokenizer_svc.downstream import STREAM_ENVELOPE_BYTES, fits_in_stream

pytestmark = pytest.mark.e2e
OPENED = "stream of requests from"


@pytest.fixture
def sched(services: Services):  # type: ignore[no-untyped-def]
    with scheduler_channel(services.scheduler_address) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


class Stream:
    """A GenerateStream call whose messages the test sends as it goes."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, metadata: tuple = ()) -> None:
        self._outbox: queue.Queue[scheduler_pb2.GenerateStreamRequest | None] = queue.Queue()
        self.call = stub.GenerateStream(self._messages(), timeout=120, metadata=metadata)

    def _messages(self) -> Iterator[scheduler_pb2.GenerateStreamRequest]:
        while (message := self._outbox.get()) is not None:
            yield message

    def start(self, request: scheduler_pb2.GenerateRequest) -> None:
        self._outbox.put(scheduler_pb2.GenerateStreamRequest(generate=request))

    def cancel(self, request_id: str) -> None:
        self._outbox.put(scheduler_pb2.GenerateStreamRequest(cancel=scheduler_pb2.Cancel(request_id=request_id)))

    def half_close(self) -> None:
        self._outbox.put(None)


def text_request(services: Services, rid: str, word: int, tokens: int) -> scheduler_pb2.GenerateRequest:
    info = model_info(services.model)
    ids = [1, 22557, 1526, 100 + word] if info.image_token_id != 100 + word else [1, 22557, 1526]
    sampling = common_pb2.SamplingParams(max_tokens=tokens, min_tokens=tokens)
    return scheduler_pb2.GenerateRequest(request_id=rid, input_ids=ids, sampling=sampling)


def generated(events: list[scheduler_pb2.RequestEvent]) -> list[int]:
    return [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids]


def test_requests_on_one_stream_each_get_their_own_events_and_errors(sched, services: Services) -> None:
    good = [text_request(services, f"stream-good-{i}", i, 6) for i in range(3)]
    bad = scheduler_pb2.GenerateRequest(request_id="stream-bad", input_ids=[1, 10**8])  # outside the vocabulary
    long = text_request(services, "stream-long", 7, 400)
    stream = Stream(sched)
    for request in [*good, bad, long]:
        stream.start(request)
    events: dict[str, list[scheduler_pb2.RequestEvent]] = defaultdict(list)
    cancelled = False
    for message in stream.call:
        tokens_events = Counter(e.request_id for e in message.events if e.HasField("tokens"))
        assert max(tokens_events.values(), default=0) <= 1, "two Tokens events of one request in one message"
        for event in message.events:
            events[event.request_id].append(event)
        ended = all(events[r.request_id] and events[r.request_id][-1].HasField("finished") for r in good)
        if ended and generated(events["stream-long"]) and not cancelled:
            stream.cancel("stream-long")
            stream.half_close()  # the call ends once the cancel is read: nothing is left on it
            cancelled = True
    assert stream.call.code() == grpc.StatusCode.OK

    for request in good:
        mine = events[request.request_id]
        assert mine[0].HasField("accepted"), mine
        assert mine[-1].HasField("finished"), mine
        assert mine[-1].finished.completion_tokens == 6
        # The same request alone over Generate makes the same greedy tokens.
        alone = scheduler_pb2.GenerateRequest()
        alone.CopyFrom(request)
        alone.request_id += "-alone"
        responses = list(sched.Generate(alone, timeout=60))
        assert generated(mine) == [t for r in responses if r.HasField("tokens") for t in r.tokens.token_ids]
    [failed] = events["stream-bad"]
    assert failed.failed.reason == "INVALID_REQUEST"
    assert "vocabulary" in failed.failed.message
    kinds = [e.WhichOneof("event") for e in events["stream-long"]]
    assert kinds[0] == "accepted", kinds
    assert set(kinds[1:]) == {"tokens"}, kinds
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=60)


def test_a_caller_of_another_model_is_refused_the_whole_stream(sched, services: Services) -> None:
    stream = Stream(sched, metadata=(("mmsplit-vocabulary", "0" * 16),))
    stream.start(text_request(services, "stream-other-model", 0, 4))
    with pytest.raises(grpc.RpcError) as raised:
        list(stream.call)
    stream.half_close()
    error = RemoteError.from_rpc_error(raised.value)
    assert (raised.value.code(), error.reason) == (grpc.StatusCode.UNAVAILABLE, "SCHEDULER_UNAVAILABLE")
    assert "another vocabulary" in error.message


def test_the_tokenizer_streams_its_requests_and_without_the_stream_gets_the_same_tokens(
    services: Services, tmp_path: Path
) -> None:
    requests = [make_request(f"Count to {i}.", max_tokens=8, min_tokens=8, request_id=f"tok-{i}") for i in range(4)]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        streamed = [run_request(tokenizer_stub(channel), r, timeout=60) for r in requests]
    log = Path(services.scheduler.log_path)
    assert OPENED in log.read_text(), "the shared tokenizer never opened a GenerateStream call"

    opened = log.read_text().count(OPENED)
    alone = start_tokenizer(
        services.model, services.scheduler_address, tmp_path / "tokenizer.log", extra=["--scheduler-stream", "false"]
    )
    try:
        alone.wait_serving(TOKENIZER_SERVICE, 180)
        with grpc.insecure_channel(alone.address) as channel:
            per_call = [run_request(tokenizer_stub(channel), r, timeout=60) for r in requests]
    finally:
        assert alone.stop() == 0
    assert [o.token_ids for o in per_call] == [o.token_ids for o in streamed]
    assert all(o.finish_reason == "FINISH_REASON_LENGTH" and len(o.token_ids) == 8 for o in streamed), streamed
    assert log.read_text().count(OPENED) == opened, "a tokenizer with --scheduler-stream false opened a stream"


def test_a_request_too_large_for_a_message_of_the_stream_goes_by_generate() -> None:
    info = common_pb2.ServerInfo(generate_stream=True, max_message_bytes=4096)

    def sized(n: int) -> scheduler_pb2.GenerateRequest:
        tensor = common_pb2.TensorRef(inline=b"\0" * n)
        return scheduler_pb2.GenerateRequest(request_id="r" * 128, pixel_values=[tensor])

    assert fits_in_stream(info, sized(100))
    assert not fits_in_stream(info, sized(4096))
    assert not fits_in_stream(common_pb2.ServerInfo(max_message_bytes=1 << 30), sized(100)), "a scheduler without it"
    # What the stream's message adds around a request stays within the room kept for it.
    for n in (0, 100, 4000, 1 << 20, 1 << 24):
        wrapped = scheduler_pb2.GenerateStreamRequest(generate=sized(n)).ByteSize()
        assert wrapped <= sized(n).ByteSize() + STREAM_ENVELOPE_BYTES


def test_a_stream_whose_caller_goes_away_cancels_its_requests_and_the_scheduler_goes_on(
    sched, services: Services
) -> None:
    """Three times over: a caller whose call ends mid-stream (cancelled by
    it; its connection closed, as when its process dies) leaves nothing
    running, and the scheduler (same pid) serves the next call."""
    pid = services.scheduler.pid
    for attempt, how in enumerate(["cancel", "close", "close"]):
        with scheduler_channel(services.scheduler_address) as channel:
            stream = Stream(scheduler_pb2_grpc.SchedulerServiceStub(channel))
            stream.start(text_request(services, f"stream-cut-{attempt}", attempt, 400))
            for message in stream.call:
                if any(e.HasField("tokens") for e in message.events):
                    break
            if how == "cancel":
                stream.call.cancel()
        stream.half_close()
        assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=60)
        log = Path(services.scheduler.log_path).read_text()
        assert f"request stream-cut-{attempt} finished: CANCELLED" in log
    assert services.scheduler.pid == pid
    assert services.scheduler.proc.poll() is None, "the scheduler died"
    stream = Stream(sched)
    stream.start(text_request(services, "stream-after-cut", 0, 3))
    stream.half_close()
    events = [e for message in stream.call for e in message.events]
    assert events[-1].finished.completion_tokens == 3


def test_a_message_that_does_not_parse_ends_the_call_invalid_request(services: Services) -> None:
    with scheduler_channel(services.scheduler_address) as channel:
        method = channel.stream_stream(f"/{SCHEDULER_SERVICE}/GenerateStream")
        with pytest.raises(grpc.RpcError) as raised:
            list(method(iter([b"\xff\xff\xff\xff"]), timeout=60))
    error = RemoteError.from_rpc_error(raised.value)
    assert (raised.value.code(), error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert services.scheduler.proc.poll() is None, "the scheduler died"
