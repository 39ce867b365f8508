"""Qwen3-VL's mixture-of-experts variant (`qwen3_vl_moe`): the Qwen3-VL
adapter serves it at TP=2 (its experts loaded whole on each rank:
`Qwen3VL.tp_plan_overrides`, then split over the two by
`scheduler_svc.experts`), prefilling in chunks, with greedy tokens and log
probabilities equal to the model's own `generate` for text, images and
videos in one batch; and a forward that fails on one rank fails its request
alone.

The pair sums over gloo (`--tp-all-reduce gloo`), where the scheduler counts
a forward's sums to drain a failed one (`scheduler_svc.counted_sums`): the
split experts add one sum per MoE layer, which must be counted like the
model's own. (Shared-memory sums, every other family's default here, treat
any sum alike.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.client import make_request, run_request
from tests.e2e.helpers import png, rank_active_requests, sent_together, the_group_went_on
from tests.support import greedy
from tests.support.leaks import wait_until
from tests.support.services import Pair, running_pair

pytestmark = pytest.mark.e2e
FAMILY = "qwen3-vl-moe"


@pytest.fixture(scope="module")
def moe_pair(family_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    extra = ["--max-prefill-tokens", "32", "--log-level", "DEBUG", "--tp-all-reduce", "gloo"]
    extra += ["--engine-hook", "tests.support.faults"]
    with running_pair(family_models(FAMILY), tmp_path_factory.mktemp("moe"), scheduler_extra=extra) as pair:
        yield pair


def test_qwen3_vl_moe_at_tp2_gives_the_model_s_tokens_for_text_images_and_videos(moe_pair: Pair) -> None:
    pair = moe_pair
    images = (png(120, 200, 1), png(300, 90, 2), png(224, 224, 3))
    greedy.equal_to_the_model(FAMILY, pair, greedy.asks(FAMILY, video=True, images=images), max_tokens=6)
    log = pair.scheduler.log_path.read_text()
    assert log.count("prefilled in chunks") >= 8, "the media asks were not prefilled in chunks (a line per rank)"
    split = [line for line in log.splitlines() if "MoE layers split over 2 ranks" in line]
    assert len(split) == 2, "each rank keeps half of every expert"
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def test_a_forward_that_raises_on_one_rank_fails_that_request_alone(moe_pair: Pair) -> None:
    """A prompt whose prefill raises on rank 1 inside the model (after the
    first layer's sums, the split experts' among them) fails alone while 4
    others keep the tokens they make alone; the group keeps its processes."""
    pair = moe_pair
    pid = pair.scheduler.pid
    goods = [make_request(f"Say something about {t}.", max_tokens=6, min_tokens=6) for t in ("rain", "owls", "salt")]
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        alone = [run_request(stub, good, timeout=120).token_ids for good in goods]
        doomed = make_request(
            "Tell me all about tides and maps.", max_tokens=6, request_id="inject-forward-failure-rank1"
        )
        *together, failed = sent_together(stub, [*goods, doomed])
        assert [out.token_ids for out in together] == alone
        assert (failed.grpc_code, failed.reason) == ("INTERNAL", "INTERNAL"), failed
        assert "the model failed on this request in" in failed.message, failed
        assert run_request(stub, goods[0], timeout=120).token_ids == alone[0]
    the_group_went_on(pair, pid)
