"""A tokenizer and a scheduler of different models (`mmsplit.pairing`): the
tokenizer sends that scheduler nothing, says why in its log and to its
clients, and stays NOT_SERVING; the scheduler and its own tokenizer serve
on. A pair of one model publishes the same digests.

Without the check, a LLaVA-NeXT tokenizer in front of a LLaVA-1.5
scheduler got INVALID_REQUEST for every image ("'image_sizes' is not an
input of this model"), blaming its clients; a tokenizer whose vocabulary
differs only in which token an id names would have been served garbage."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.pairing import Pairing
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from mmsplit_cli.launch import Arg, FreePort
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests, scheduler_info, scrape, tokenizer_info
from tests.support.leaks import wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import ServiceProcess, started_tokenizer

pytestmark = pytest.mark.e2e


def test_a_pair_of_one_model_publishes_the_same_digests(services: Services) -> None:
    theirs = scheduler_info(services.scheduler_address)
    assert len(theirs.vocabulary) == 32
    assert len(theirs.item_rules) == 32
    ours = tokenizer_info(services.tokenizer_address).info
    assert (ours.vocabulary, ours.item_rules) == (theirs.vocabulary, theirs.item_rules)


@pytest.mark.parametrize(
    ("family", "differ"),
    [("qwen2-vl", "vocabulary and rules for images and videos"), ("llava-next", "rules for images and videos")],
)
def test_a_scheduler_of_another_model_gets_no_requests(
    services: Services, family_models: Callable[[str], Path], tmp_path: Path, family: str, differ: str
) -> None:
    """A tokenizer of another family pointed at the shared pair's LLaVA-1.5
    scheduler: Qwen2-VL's vocabulary differs too; LLaVA-NeXT's is the same."""
    metrics = FreePort()
    extra: list[Arg] = ["--preprocess-cache-bytes", "0", "--metrics-port", metrics]

    def bound(tok: ServiceProcess) -> None:
        tok.wait_bound(180)  # (never SERVING: its scheduler serves another model)

    wrong = started_tokenizer(
        family_models(family), services.scheduler_address, tmp_path / "tok.log", extra=extra, ready=bound
    )
    try:
        assert wait_until(lambda: f"another {differ} than ours" in wrong.log_path.read_text(), timeout=60)
        said = time.monotonic()
        assert health_status(wrong.address, TOKENIZER_SERVICE) == "NOT_SERVING"
        info = tokenizer_info(wrong.address)
        theirs = scheduler_info(services.scheduler_address)
        assert info.info.item_rules not in ("", theirs.item_rules)
        assert (info.info.vocabulary == theirs.vocabulary) == (family == "llava-next")
        assert [(b.ready, b.serves_another_model) for b in info.backends] == [(False, differ)]
        backend = (("backend", services.scheduler_address),)
        assert scrape(metrics.number)[("mmsplit_tokenizer_backend_serves_another_model", backend)] == 1
        with grpc.insecure_channel(wrong.address) as channel:
            out = run_request(
                tokenizer_pb2_grpc.TokenizerServiceStub(channel),
                make_request("Describe.", [samples.good_png()], max_tokens=2),
                timeout=30,
            )
        assert out.reason == "SCHEDULER_UNAVAILABLE"
        assert out.message.endswith(f"(theirs has another {differ})"), out.message
        assert out.latency_s < 5
        # Said once, not at every refresh (every 2 s): two more have run.
        time.sleep(max(0.0, said + 4.5 - time.monotonic()))
        assert wrong.log_path.read_text().count("than ours") == 1
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


def test_the_scheduler_refuses_a_request_from_a_caller_of_another_model(services: Services) -> None:
    """The tokenizer sends its digests with each request, and the scheduler
    checks them: a tokenizer that has not yet seen its scheduler replaced
    by another model's (it looks every 2 s) is refused, retriably."""
    ours = Pairing.of(scheduler_info(services.scheduler_address))
    request = scheduler_pb2.GenerateRequest(input_ids=[1, 306, 4966], sampling=common_pb2.SamplingParams(max_tokens=2))
    with scheduler_channel(services.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        def call(rid: str, metadata: tuple[tuple[str, str], ...]) -> str:
            request.request_id = rid
            try:
                events = list(stub.Generate(request, timeout=60, metadata=metadata))
            except grpc.RpcError as exc:
                error = RemoteError.from_rpc_error(exc)
                return f"{exc.code().name} {error.reason}: {error.message}"  # type: ignore[attr-defined]
            return "ok" if events[-1].HasField("finished") else "unfinished"

        assert call("same", ours.metadata()) == "ok"
        assert call("unsaid", ()) == "ok"  # a caller that says nothing is trusted
        other = Pairing(vocabulary="0" * 32, item_rules=ours.item_rules)
        refused = call("other", other.metadata())
        assert refused == (
            "UNAVAILABLE SCHEDULER_UNAVAILABLE: this scheduler serves another model (another vocabulary than the"
            " caller's)"
        ), refused
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
