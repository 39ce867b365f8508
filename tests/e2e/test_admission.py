"""Limits before cost: a request beyond the tokenizer's in-flight limit is
refused when its call starts — before any of its images is fetched or
decoded — however big its message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.support.origins import Origin, local_origin
from tests.support.services import running_pair

pytestmark = pytest.mark.e2e


@pytest.fixture
def origin() -> Iterator[Origin]:
    with local_origin(samples.good_png()) as served:
        yield served


def test_a_big_request_beyond_the_inflight_limit_fetches_nothing(
    tiny_model: Path, tmp_path: Path, origin: Origin
) -> None:
    extra = ["--max-inflight", "1", "--private-fetch-exempt", origin.address]
    with running_pair(tiny_model, tmp_path, scheduler_extra=["--tp", "1"], tokenizer_extra=extra) as pair:
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            assert run_request(stub, make_request("Hi", urls=[origin.url("a.png")], max_tokens=2)).ok
            assert origin.hits == 1
            busy = stub.Generate(make_request("Go on and on.", max_tokens=2000, request_id="occupant"))
            events = iter(busy)
            assert next(events).HasField("delta")  # the one in-flight slot is taken
            big = tokenizer_pb2.GenerateRequest(
                prompt="Compare them all.",
                images=[tokenizer_pb2.Image(url=origin.url("b.png"))]
                + [tokenizer_pb2.Image(data=b"\xff" * (16 * 1024 * 1024 + 64)) for _ in range(4)],
            )
            assert big.ByteSize() > 64 * 1024 * 1024
            refused = run_request(stub, big, timeout=60)
            busy.cancel()
        assert (refused.grpc_code, refused.reason) == ("RESOURCE_EXHAUSTED", "OVERLOADED"), refused
        assert origin.hits == 1, "the refused request's image was fetched"
