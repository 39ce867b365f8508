"""`--stream-interval`: rank 0 streams a running request's tokens N at a
time (the first at once), and the tokenizer relays them as they come: the
same tokens, fewer messages, stop strings still cut where they fall."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.support import hf_loaded
from tests.support.services import Pair, running_pair

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("interval")
    with running_pair(tiny_model, logs, scheduler_extra=["--tp", "1", "--stream-interval", "4"]) as p:
        yield p


def test_tokens_come_four_at_a_time_after_the_first(pair: Pair) -> None:
    request = make_request("Describe it.", [samples.good_png()], max_tokens=10, min_tokens=10)
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        sizes = [len(e.delta.token_ids) for e in stub.Generate(request, timeout=60) if e.HasField("delta")]
        whole = run_request(stub, request, timeout=60)
    messages = [n for n in sizes if n]
    # [1, 4, 4, 1] on an idle host; tokens that queued while a message was
    # being sent go out together (a loaded host: even [10]), never fewer
    # than four in a message between the first and the last.
    assert sum(messages) == 10
    assert len(messages) <= 4, messages
    assert all(n >= 4 for n in messages[1:-1]), messages
    assert whole.ok, whole
    assert len(whole.token_ids) == 10
    assert whole.finish_reason == "FINISH_REASON_LENGTH"


def test_a_stop_string_inside_a_message_ends_the_text_before_it(pair: Pair, tiny_model: Path) -> None:
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        free = run_request(stub, make_request("Go on.", max_tokens=12, min_tokens=12), timeout=60)
        assert free.ok, free
        # A stop string from the middle of the text (four tokens a message: most
        # likely inside one, not at its edge).
        stop = free.text[len(free.text) // 2 :][:3]
        assert stop.strip(), free.text
        stopped = run_request(stub, make_request("Go on.", max_tokens=12, min_tokens=12, stop=[stop]), timeout=60)
    assert stopped.ok, stopped
    assert stopped.finish_reason == "FINISH_REASON_STOP"
    assert stopped.text == free.text[: free.text.index(stop)]
    # As with one token a message: the tokens end with the one the stop string falls in.
    tokenizer = hf_loaded.tokenizer(tiny_model)
    kept = len(stopped.token_ids)
    assert stopped.token_ids == free.token_ids[:kept]
    assert stop in tokenizer.decode(free.token_ids[:kept], skip_special_tokens=True)
    assert stop not in tokenizer.decode(free.token_ids[: kept - 1], skip_special_tokens=True)
