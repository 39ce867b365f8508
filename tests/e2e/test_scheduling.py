"""Scheduling through the real services: requests interleave step by step,
sampling is reproducible, a scheduler rejection leaves nothing behind, and
both servers expose health and reflection."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status
from tests.support.local_token import scheduler_channel

pytestmark = pytest.mark.e2e


@pytest.fixture
def stub(services: Services):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


def test_a_short_request_is_not_stuck_behind_a_long_one(stub) -> None:  # type: ignore[no-untyped-def]
    finished_at: dict[str, float] = {}
    outcomes: dict[str, Outcome] = {}
    long_started = threading.Event()

    def long_request() -> None:
        request = make_request("Tell me everything.", [samples.good_png()], max_tokens=300, request_id="long-1")
        out = Outcome(request_id="long-1")
        for event in stub.Generate(request, timeout=120):
            if event.HasField("delta"):
                out.token_ids.extend(event.delta.token_ids)
                long_started.set()
            elif event.HasField("finished"):
                out.finish_reason = str(event.finished.finish_reason)
        finished_at["long"] = time.monotonic()
        outcomes["long"] = out

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        assert long_started.wait(60), "the long request produced no token"
        short = run_request(stub, make_request("Hi", max_tokens=3, request_id="short-1"), timeout=60)
        finished_at["short"] = time.monotonic()
    finally:
        thread.join(120)
    assert short.ok, short
    assert len(short.token_ids) == 3
    assert len(outcomes["long"].token_ids) == 300
    assert finished_at["short"] < finished_at["long"]


def test_sampling_is_reproducible_by_seed(stub) -> None:  # type: ignore[no-untyped-def]
    image = samples.good_png(seed=9)

    def sample(seed: int) -> list[int]:
        out = run_request(stub, make_request("Go", [image], max_tokens=8, temperature=0.8, seed=seed))
        assert out.ok, out
        return out.token_ids

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


def test_scheduler_rejection_releases_the_tokenizers_segments(stub, services: Services) -> None:  # type: ignore[no-untyped-def]
    long_prompt = "word " * 1500  # more tokens than the tiny model's context of 1024
    out = run_request(stub, make_request(long_prompt, [samples.good_png()], request_id="too-long-1"))
    assert out.grpc_code == "INVALID_ARGUMENT"
    assert out.reason == "INVALID_REQUEST"
    assert "context" in out.message
    # The autouse leak guard fails this test if the image's segment remains.
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"


@pytest.mark.parametrize("which", ["tokenizer", "scheduler"])
def test_health_and_reflection(services: Services, which: str) -> None:
    address = services.tokenizer_address if which == "tokenizer" else services.scheduler_address
    service = TOKENIZER_SERVICE if which == "tokenizer" else SCHEDULER_SERVICE
    assert health_status(address, "") == "SERVING"
    assert health_status(address, service) == "SERVING"
    with scheduler_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert service in names
    assert "grpc.health.v1.Health" in names


def test_two_clients_may_use_the_same_request_id(stub) -> None:  # type: ignore[no-untyped-def]
    """The scheduler keys requests by an id the tokenizer makes unique; the
    client's request_id is only echoed back."""
    barrier = threading.Barrier(2)

    def send(prompt: str) -> Outcome:
        barrier.wait()
        return run_request(stub, make_request(prompt, max_tokens=20, request_id="order-42"), timeout=60)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(send, ["One story.", "Another story."])
    assert first.ok, first
    assert second.ok, second
    assert first.request_id == second.request_id == "order-42"


def test_a_request_id_that_is_not_printable_is_refused_without_being_echoed(stub) -> None:  # type: ignore[no-untyped-def]
    out = run_request(stub, make_request("Hi", max_tokens=2, request_id="evil\nline\x01"), timeout=30)
    assert (out.grpc_code, out.reason) == ("INVALID_ARGUMENT", "INVALID_REQUEST")
    assert "request_id" in out.message
    assert "evil" not in out.message
