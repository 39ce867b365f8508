"""Limits before cost: a request beyond the tokenizer's in-flight limit is
refused when its call starts — before any of its images is fetched or
decoded — however big its message."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.support.origins import local_origin
from tests.support.services import running_pair

pytestmark = pytest.mark.e2e


def test_a_big_request_beyond_the_inflight_limit_fetches_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """The one in-flight slot is held by a request whose image the origin
    holds (as long as the test needs, on any host's speed)."""
    with local_origin(samples.good_png(), held=True) as origin:
        extra = ["--max-inflight", "1", "--private-fetch-exempt", origin.address]
        pair_at = running_pair(tiny_model, tmp_path, scheduler_extra=["--tp", "1"], tokenizer_extra=extra)
        with pair_at as pair, grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            occupant = stub.Generate(make_request("Hi", urls=[origin.url("occupant.png")], max_tokens=2))
            assert origin.asked.wait(60), "the occupant never fetched its image"
            big = tokenizer_pb2.GenerateRequest(
                prompt="Compare them all.",
                images=[tokenizer_pb2.Image(url=origin.url("big.png"))]
                + [tokenizer_pb2.Image(data=b"\xff" * (16 * 1024 * 1024 + 64)) for _ in range(4)],
            )
            assert big.ByteSize() > 64 * 1024 * 1024
            refused = run_request(stub, big, timeout=60)
            origin.release.set()
            finished = [r for r in occupant if r.HasField("finished")]
            assert len(finished) == 1, "the occupant, once its image came, ran to its end"
            # The slot is free again: the next request is served.
            assert run_request(stub, make_request("Hi", max_tokens=2)).ok
    assert (refused.grpc_code, refused.reason) == ("RESOURCE_EXHAUSTED", "OVERLOADED"), refused
    assert origin.paths == ["/occupant.png"], "the refused request's image was fetched"
