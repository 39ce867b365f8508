"""A tokenizer and a scheduler that mean different tokens by the same ids
(`mmsplit.vocabulary`): the tokenizer sends that scheduler nothing, says why
in its log and to its clients, and stays NOT_SERVING; the scheduler and its
own tokenizer serve on. A pair of one vocabulary publishes one digest."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, scheduler_info, tokenizer_info
from tests.support.leaks import wait_until
from tests.support.services import ENV, ServiceProcess, tokenizer_args

pytestmark = pytest.mark.e2e


def test_a_pair_of_one_vocabulary_publishes_one_digest(services: Services) -> None:
    theirs = scheduler_info(services.scheduler_address).vocabulary
    assert len(theirs) == 32
    assert tokenizer_info(services.tokenizer_address).info.vocabulary == theirs


def test_a_scheduler_of_another_vocabulary_gets_no_requests(
    services: Services, family_models: Callable[[str], Path], tmp_path: Path
) -> None:
    # A Qwen2-VL tokenizer pointed at the shared pair's LLaVA scheduler.
    qwen = family_models("qwen2-vl")
    args = tokenizer_args(qwen, services.scheduler_address, extra=["--preprocess-cache-bytes", "0"])
    wrong = ServiceProcess("tokenizer", args, tmp_path / "tokenizer.log", env=ENV)
    try:
        wrong.wait_bound(180)
        assert wait_until(lambda: "another vocabulary than ours" in wrong.log_path.read_text(), timeout=60)
        said = time.monotonic()
        assert health_status(wrong.address, TOKENIZER_SERVICE) == "NOT_SERVING"
        info = tokenizer_info(wrong.address)
        assert info.info.vocabulary not in ("", scheduler_info(services.scheduler_address).vocabulary)
        assert [b.ready for b in info.backends] == [False]
        with grpc.insecure_channel(wrong.address) as channel:
            out = run_request(
                tokenizer_pb2_grpc.TokenizerServiceStub(channel),
                make_request("Describe.", [samples.good_png()], max_tokens=2),
                timeout=30,
            )
        assert out.reason == "SCHEDULER_UNAVAILABLE"
        assert "another vocabulary" in out.message
        assert out.latency_s < 5
        # Said once, not at every refresh (every 2 s): two more have run.
        time.sleep(max(0.0, said + 4.5 - time.monotonic()))
        assert wrong.log_path.read_text().count("another vocabulary than ours") == 1
    finally:
        wrong.stop()
    # The scheduler never saw a request of it, and serves its own tokenizer.
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        after = run_request(
            tokenizer_pb2_grpc.TokenizerServiceStub(channel),
            make_request("Describe.", [samples.good_png()], max_tokens=2),
            timeout=60,
        )
    assert after.ok, after
