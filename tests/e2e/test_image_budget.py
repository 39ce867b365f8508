"""An image too large for the scheduler (its pixels over --max-tensor-bytes,
which its GetServerInfo states) is refused by the tokenizer before the
hand-off, MEDIA_TOO_LARGE naming the image and the pixel budget that would
fit; asking for that budget (`mm_processor_kwargs`, `image_budget`) is then
served, and the pair goes on. (The budget itself against the model's own
processor: tests/e2e/test_http_api.py.)"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.client import ImagePart, build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, run_request
from tests.e2e.helpers import health_status, rank_active_requests, scheduler_info, tokenizer_info
from tests.support.leaks import wait_until
from tests.support.services import Pair, running_pair

pytestmark = pytest.mark.e2e

CAP = 200_000  # bytes: a 320x240 photo at the tiny Qwen2-VL's budget is ~600 KB of float32 rows


@pytest.fixture(scope="module")
def capped_pair(family_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("logs-capped")
    with running_pair(family_models("qwen2-vl"), logs, tp=1, scheduler_extra=["--max-tensor-bytes", str(CAP)]) as pair:
        yield pair


def test_an_image_over_the_scheduler_s_cap_is_refused_naming_a_budget_that_fits(capped_pair: Pair) -> None:
    """Refused by the worker from the image's header (nothing processed,
    nothing kept in the preprocessing cache), or, for an item the cache
    kept from a Tokenize (which sends nothing: no cap), by the tokenizer
    before the hand-off: MEDIA_TOO_LARGE both, naming the image and the
    largest max_pixels whose rows fit, which is then served."""
    pair = capped_pair
    assert scheduler_info(pair.scheduler_address).max_tensor_bytes == CAP
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

        def ask(photo: bytes, **budget: int) -> Outcome:
            messages = [("user", ["Describe ", ImagePart(photo), "."])]
            return run_request(stub, build_request(messages=messages, max_tokens=2, **budget), timeout=60)

        def cached_bytes() -> int:
            return tokenizer_info(pair.tokenizer_address).info.preprocess_cache_bytes

        def refused_with_a_budget(outcome: Outcome) -> int:
            assert (outcome.grpc_code, outcome.reason) == ("INVALID_ARGUMENT", "MEDIA_TOO_LARGE"), outcome
            assert f"over the {CAP:,} its scheduler takes (--max-tensor-bytes)" in outcome.message, outcome
            assert outcome.metadata.get("param") == "messages[0].content[1]", outcome
            found = re.search(r"ask for at most ([\d,]+) pixels an image \(max_pixels\)", outcome.message)
            assert found, outcome.message
            return int(found.group(1).replace(",", ""))

        first, second = (samples.encode(samples.gradient(320, 240, seed=s), "JPEG") for s in (4, 5))
        before = cached_bytes()
        most = refused_with_a_budget(ask(first))
        assert cached_bytes() == before  # refused from its header, before any preprocessing
        # The most that fits: served at it, refused a pixel over it (the resize floors to whole merged patches).
        assert ask(first, max_pixels=most).ok
        assert refused_with_a_budget(ask(first, max_pixels=most + 1)) == most

        counted = stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=build_request(
            messages=[("user", ["Describe ", ImagePart(second), "."])])), timeout=60)  # fmt: skip
        assert counted.token_ids
        assert cached_bytes() > before
        assert refused_with_a_budget(ask(second)) == most  # the cache's item, refused before the hand-off
        assert run_request(stub, build_request("Hello.", max_tokens=2), timeout=60).ok
    assert health_status(pair.tokenizer_address, "") == "SERVING"
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0], timeout=10)
