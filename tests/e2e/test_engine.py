"""The engine through real servers: continuous batching gives every request
the greedy tokens of plain `generate` at TP=1 and TP=2, seeded sampling does
not depend on the batch, sampling limits and stop conditions hold, and no
request — hostile sampling, NaN/Inf pixels, pixels that make NaN logits, a
failed read — can take the group down or change another request's tokens."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError, error_info_of
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from scheduler_svc.model import model_info
from tests.conftest import SCHEDULER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests, rank_processes, scheduler_info
from tests.support.faults import failing_request_id
from tests.support.leaks import wait_until
from tests.support.local_token import scheduler_channel
from tests.support.reference import Ask, greedy
from tests.support.services import Pair, running_pair, start_scheduler

pytestmark = pytest.mark.e2e
F32 = common_pb2.DTYPE_FLOAT32
IMAGE = [3, 224, 224]


@pytest.fixture(scope="module")
def tp1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    extra = ["--tp", "1", "--stats-interval-s", "0.5", "--engine-hook", "tests.support.faults"]
    with running_pair(tiny_model, tmp_path_factory.mktemp("tp1"), scheduler_extra=extra) as pair:
        yield pair


def asks(n: int, seed: int) -> list[Ask]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = tuple(samples.good_jpeg(seed=seed * 100 + i * 3 + k) for k in range(rng.choice([0, 1, 1, 2])))
        words = " ".join(
            rng.choice(["tell", "me", "about", "the", "picture", "colors", "now"]) for _ in range(rng.randrange(1, 25))
        )
        out.append(Ask(f"Request {i}: {words}.", images, rng.randrange(1, 25)))
    return out


def send_staggered(address: str, items: list[Ask], seed: int) -> list[Outcome]:
    """Every request from its own client after a random delay, so requests
    join and leave the running batch at random steps."""
    rng = random.Random(seed)
    delays = [rng.uniform(0, 1.5) for _ in items]

    def one(i: int) -> Outcome:
        time.sleep(delays[i])
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            ask = items[i]
            return run_request(stub, make_request(ask.prompt, list(ask.images), max_tokens=ask.max_tokens), timeout=120)

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(one, range(len(items))))


def check_against_generate(pair: Pair, model: Path, seed: int) -> None:
    items = asks(32, seed=seed)
    outcomes = send_staggered(pair.tokenizer_address, items, seed=seed)
    expected = greedy(model, items)
    for i, (out, want) in enumerate(zip(outcomes, expected, strict=True)):
        assert out.ok, (i, out)
        assert out.token_ids == want, f"request {i} ({len(items[i].images)} images, max {items[i].max_tokens})"


def test_32_requests_joining_and_leaving_get_the_tokens_of_plain_generate_at_tp1(tp1: Pair, tiny_model: Path) -> None:
    check_against_generate(tp1, tiny_model, seed=1)
    # This pair logs statistics every 0.5 s instead of a line per step.
    stats = [line for line in tp1.scheduler.log_path.read_text().splitlines() if "mean batch" in line]
    assert stats, "the step loop logs periodic statistics"
    assert "KV reserved" in stats[-1]


def test_a_decode_forward_that_raises_at_tp1_ends_its_rows_typed_and_the_group_goes_on(tp1: Pair) -> None:
    """The fault hook makes every decode forward that holds the marked
    request raise: it ends with a typed INTERNAL error after its first
    token, and the scheduler, without a restart, serves the next request."""
    pid = tp1.scheduler.pid
    with grpc.insecure_channel(tp1.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        doomed = make_request(
            "Go on.", max_tokens=8, min_tokens=8, request_id=f"inject-decode-failure-{uuid.uuid4().hex[:6]}"
        )
        out = run_request(stub, doomed)
        assert (out.grpc_code, out.reason) == ("INTERNAL", "INTERNAL"), out
        assert "the model failed in a decode step" in out.message, out
        assert len(out.token_ids) == 1, "its prefill's token came before the decode failed"
        after = run_request(stub, make_request("Go on.", max_tokens=4, min_tokens=4))
        assert after.ok, after
        assert len(after.token_ids) == 4, after
    assert tp1.scheduler.pid == pid
    assert tp1.scheduler.proc.poll() is None
    assert "a decode forward of 1 requests failed" in tp1.scheduler.log_path.read_text()


@pytest.mark.parametrize(
    "marker", ["inject-decode-failure-rank1", "inject-decode-failure-rank0", "inject-decode-failure"]
)
def test_a_decode_forward_that_raises_at_tp2_ends_its_rows_typed_and_the_group_goes_on(
    services: Services, marker: str
) -> None:
    """Inside the model on rank 1 only, on rank 0 only (between two TP
    sums: the other rank is released from the next sum, or from the sum
    after the forward), or on every rank: the rows of that decode end with
    a typed INTERNAL error after their first token (their prefill's), every
    rank drops them, and the group, without a restart, serves on."""
    pid = services.scheduler.pid
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        doomed = make_request("Go on.", max_tokens=8, min_tokens=8, request_id=f"{marker}-{uuid.uuid4().hex[:6]}")
        out = run_request(stub, doomed)
        assert (out.grpc_code, out.reason) == ("INTERNAL", "INTERNAL"), out
        assert "the model failed in a decode step" in out.message, out
        assert len(out.token_ids) == 1, "its prefill's token came before the decode failed"
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert_still_serving(services, pid)
    assert "a decode forward of 1 requests failed" in services.scheduler.log_path.read_text()


def test_over_gloo_a_forward_that_raises_on_one_rank_fails_its_requests_alone(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TP=2 with the model's sums over gloo (as between hosts, or NCCL on
    GPUs), not shared memory: a prefill or decode forward that raises
    inside the model on one rank only, between two TP sums. That rank makes
    the sums the other is still waiting in (zeros, `counted_sums`), so both
    meet in the agreement: the request fails alone with a typed error, at
    once rather than after the collective timeout (here 120 s, past each
    request's 60), and the group serves on with its processes. Last, a
    prefix-cache change that fails on one rank: GetServerInfo reports the
    caches diverged."""
    extra = ["--tp-all-reduce", "gloo", "--engine-hook", "tests.support.faults", "--collective-timeout-s", "120"]
    with running_pair(tiny_model, tmp_path_factory.mktemp("gloo"), scheduler_extra=extra) as pair:
        pid, ranks = pair.scheduler.pid, [p.pid for p in rank_processes(pair.scheduler.pid)]
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

            def ask(rid: str) -> Outcome:
                return run_request(stub, make_request("Go on.", max_tokens=6, min_tokens=6, request_id=rid), 60)

            # The first forward of all fails (each rank learnt its sums as the group started).
            first = ask(f"inject-forward-failure-rank1-{uuid.uuid4().hex[:6]}")
            assert (first.grpc_code, first.reason) == ("INTERNAL", "INTERNAL"), first
            good = ask("good")
            assert good.ok, good
            for marker, where, tokens in (
                ("inject-decode-failure-rank1", "in a decode step", 1),  # the first decode to fail
                ("inject-forward-failure-rank1", "in its prefill", 0),
                ("inject-forward-failure-rank0", "in its prefill", 0),
                ("inject-decode-failure-rank0", "in a decode step", 1),
            ):
                out = ask(f"{marker}-{uuid.uuid4().hex[:6]}")
                assert (out.grpc_code, out.reason) == ("INTERNAL", "INTERNAL"), (marker, out)
                assert where in out.message, (marker, out)
                assert len(out.token_ids) == tokens, (marker, out)
                after = ask(f"after-{uuid.uuid4().hex[:6]}")
                assert after.ok, (marker, after)
                assert after.token_ids == good.token_ids, marker
            # Keeping a request's prefix-cache blocks fails on rank 1 only:
            # the request is served, and from the next join on the ranks'
            # stores differ, no cached prefix is taken, and the server says so.
            assert not scheduler_info(pair.scheduler_address).prefix_cache_diverged
            kept = ask(f"inject-keep-failure-rank1-{uuid.uuid4().hex[:6]}")
            assert kept.ok, kept
            assert kept.token_ids == good.token_ids
            after = ask(f"after-{uuid.uuid4().hex[:6]}")
            assert after.ok, after
            assert after.token_ids == good.token_ids
            info = scheduler_info(pair.scheduler_address)
            assert (info.prefix_cache_diverged, info.encoder_cache_diverged) == (True, False)
        assert pair.scheduler.pid == pid
        assert [p.pid for p in rank_processes(pair.scheduler.pid)] == ranks, "a rank was restarted"
        log = pair.scheduler.log_path.read_text()
        assert "made the sums the other ranks still make" in log


def test_32_requests_joining_and_leaving_get_the_tokens_of_plain_generate_at_tp2(
    services: Services, tiny_model: Path
) -> None:
    """The shared pair holds each rank's rows of the LM head column after
    column (`--lm-head-layout columns`) and decodes through the lean body
    (`scheduler_svc/lean_decode.py`) on both ranks: the tokens are the
    model's all the same."""
    log = services.scheduler.log_path.read_text()
    laid = log.count("the LM head is stored column after column")
    assert laid == 2, f"{laid} ranks laid out their rows of the LM head"
    # Under TP too the decode steps skip the module calls (the TP plan's sums inside its projections' forwards).
    assert log.count("decode steps run the model's operations without its module calls") == 2
    check_against_generate(services, tiny_model, seed=2)


def seeded(seed: int) -> tokenizer_pb2.GenerateRequest:
    return make_request(
        "Invent a story.", [samples.good_png(seed=41)], max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=seed
    )


def test_seeded_sampling_does_not_depend_on_the_batch(services: Services) -> None:
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        alone = run_request(stub, seeded(1234))
        assert alone.ok, alone
        assert run_request(stub, seeded(1235)).token_ids != alone.token_ids
        crowd = [
            make_request(f"Other {i}", [samples.good_png(seed=i)], max_tokens=20, temperature=0.7 * (i % 2), seed=i + 1)
            for i in range(8)
        ]
        barrier = threading.Barrier(9)

        def send(req):  # type: ignore[no-untyped-def]
            barrier.wait()
            return run_request(stub, req)

        with ThreadPoolExecutor(9) as pool:
            results = list(pool.map(send, [*crowd, seeded(1234)]))
    assert all(r.ok for r in results), results
    assert results[-1].token_ids == alone.token_ids


HOSTILE_SAMPLING = [
    ("temperature 1e-39", {"temperature": 1e-39}, "sampling.temperature"),
    ("temperature 1e-30", {"temperature": 1e-30}, "sampling.temperature"),
    ("temperature NaN", {"temperature": float("nan")}, "sampling.temperature"),
    ("temperature Inf", {"temperature": float("inf")}, "sampling.temperature"),
    ("temperature -1", {"temperature": -1.0}, "sampling.temperature"),
    ("top_p 0", {"top_p": 0.0, "temperature": 0.8}, "sampling.top_p"),
    ("top_p 2", {"top_p": 2.0, "temperature": 0.8}, "sampling.top_p"),
    ("max_tokens over the limit", {"max_tokens": 100_000}, "limit 4096"),
    ("frequency_penalty 3", {"frequency_penalty": 3.0}, "sampling.frequency_penalty"),
    ("repetition_penalty NaN", {"repetition_penalty": float("nan")}, "sampling.repetition_penalty"),
    ("logit_bias outside the vocabulary", {"logit_bias": {10**6: 1.0}}, "sampling.logit_bias"),
]


def assert_still_serving(services: Services, pid: int) -> None:
    assert services.scheduler.pid == pid
    assert services.scheduler.proc.poll() is None
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        good = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("Hi", max_tokens=3))
    assert good.ok, good
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"


@pytest.mark.parametrize(("case", "params", "named"), HOSTILE_SAMPLING, ids=[c[0] for c in HOSTILE_SAMPLING])
def test_hostile_sampling_is_refused_at_both_services(
    services: Services, case: str, params: dict[str, Any], named: str
) -> None:
    pid = services.scheduler.pid
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("hello", **params))
    assert (out.grpc_code, out.reason) == ("INVALID_ARGUMENT", "INVALID_REQUEST"), out
    assert named in out.message
    # Straight to the scheduler, past the tokenizer's check: refused there too.
    sampling = common_pb2.SamplingParams(**{k: v for k, v in params.items()})  # type: ignore[arg-type]
    reason, meta = direct(services, prompt_ids(services, 0), [], sampling)
    assert (reason, meta.get("grpc")) == ("INVALID_REQUEST", "INVALID_ARGUMENT"), meta
    assert_still_serving(services, pid)


def prompt_ids(services: Services, images: int) -> list[int]:
    info = model_info(services.model)
    return [1, *([info.image_token_id] * info.tokens_per_image * images), 22557, 1526]


def inline(fill: float | None = None, seed: int = 1) -> common_pb2.TensorRef:
    array = np.random.default_rng(seed).random(IMAGE, dtype=np.float32)
    if fill is not None:
        array[:] = fill
    return common_pb2.TensorRef(dtype=F32, shape=IMAGE, inline=array.tobytes())


def direct(
    services: Services,
    ids: list[int],
    images: list[common_pb2.TensorRef],
    sampling: common_pb2.SamplingParams,
    rid: str = "",
) -> tuple[str, dict[str, str]]:
    """("ok", {"tokens": ...}) or (ErrorInfo reason, metadata + grpc code) of one call to the scheduler."""
    request = scheduler_pb2.GenerateRequest(
        request_id=rid or f"direct-{uuid.uuid4().hex[:8]}", input_ids=ids, pixel_values=images, sampling=sampling
    )
    with scheduler_channel(services.scheduler_address) as channel:
        try:
            events = list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as exc:
            if error_info_of(exc) is None:
                return "UNTYPED", {"grpc": exc.code().name, "message": str(exc.details())}  # type: ignore[attr-defined]
            error = RemoteError.from_rpc_error(exc)
            return error.reason, {"grpc": exc.code().name, "message": error.message, **error.metadata}  # type: ignore[attr-defined]
    tokens = [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids]
    return "ok", {"tokens": ",".join(map(str, tokens))}


@pytest.mark.parametrize(
    ("case", "fill", "expected"),
    [
        ("NaN pixels", float("nan"), "INVALID_REQUEST"),
        ("Inf pixels", float("inf"), "INVALID_REQUEST"),
        ("finite pixels so large the logits are NaN", 3e38, "INTERNAL"),
    ],
)
def test_poisoned_pixels_fail_their_request_only(services: Services, case: str, fill: float, expected: str) -> None:
    pid = services.scheduler.pid
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.8, seed=3)
    reason, meta = direct(services, prompt_ids(services, 1), [inline(fill)], sampling)
    assert reason == expected, meta
    if expected == "INVALID_REQUEST":
        assert meta["failed_ranks"] == "0,1"  # every rank checked the same bytes
        assert "NaN or infinite" in meta["message"]
    else:
        assert "non-finite logits" in meta["message"]
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert_still_serving(services, pid)


def test_16_good_requests_keep_their_tokens_while_8_hostile_ones_join_the_same_step(services: Services) -> None:
    """Hostile requests fail alone with typed errors however they fail:
    poisoned pixels and a read that fails on one rank (at the agreement),
    NaN logits (on rank 0, after the forward), a prefill that raises on
    rank 0 only and an encoder output that does not fit its placeholders
    (between the agreement and the forward: agreed on again), and a forward
    that raises inside the model on rank 1 only, or on rank 0 only, between
    two of its TP sums (the other rank is released from the next sum and the
    forward agreed on). The good ones in the same steps keep the tokens they
    make alone, and the group its processes."""
    pid = services.scheduler.pid
    good = [(prompt_ids(services, 1), inline(seed=200 + i)) for i in range(16)]
    greedy8 = common_pb2.SamplingParams(max_tokens=8)
    alone = [direct(services, ids, [img], greedy8) for ids, img in good]
    assert all(reason == "ok" for reason, _ in alone), alone
    hostile_sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.5)

    def burst() -> bool:
        """All 20 at once: every result checked; whether a request failing
        at the agreement shared its step with a good one (their arrival
        decides, so a slow machine can spread them over steps)."""
        tag = uuid.uuid4().hex[:6]
        hostile = [
            (f"nan-{tag}", inline(float("nan")), "INVALID_REQUEST"),
            (f"inf-{tag}", inline(float("inf")), "INVALID_REQUEST"),
            (f"huge-{tag}", inline(3e38), "INTERNAL"),
            (failing_request_id(1, tag), inline(seed=9), "FEATURE_TRANSPORT_FAILED"),
            (f"inject-prefill-failure-rank0-{tag}", inline(seed=10), "INTERNAL"),
            (f"inject-short-encoder-output-{tag}", inline(seed=11), "INTERNAL"),
            (f"inject-forward-failure-rank1-{tag}", inline(seed=12), "INTERNAL"),
            (f"inject-forward-failure-rank0-{tag}", inline(seed=13), "INTERNAL"),
        ]
        jobs = [(f"good-{tag}-{i}", ids, img, greedy8) for i, (ids, img) in enumerate(good)]
        jobs += [(rid, prompt_ids(services, 1), img, hostile_sampling) for rid, img, _ in hostile]
        barrier = threading.Barrier(len(jobs))

        def send(job):  # type: ignore[no-untyped-def]
            rid, ids, img, sampling = job
            barrier.wait()
            return direct(services, ids, [img], sampling, rid=rid)

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(send, jobs))
        for i in range(16):
            assert results[i] == alone[i], f"good request {i}"
        for (rid, _, expected), (reason, meta) in zip(hostile, results[16:], strict=True):
            assert reason == expected, (rid, meta)
            if rid.startswith("inject-forward-failure"):
                assert "the model failed on this request in its prefill" in meta["message"], (rid, meta)
        # An agreement failure names the requests that joined its step.
        at_agreement = [rid for rid, _, _ in hostile if not rid.startswith("huge-")]
        log = services.scheduler.log_path.read_text()
        return any(
            f"request {rid} failed" in line and f"good-{tag}" in line
            for line in log.splitlines()
            for rid in at_agreement
        )

    assert any(burst() for _ in range(3)), "in 3 bursts no hostile request joined a step with good ones"
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert_still_serving(services, pid)


def test_stop_strings_stop_token_ids_and_min_tokens(services: Services) -> None:
    image = samples.good_png(seed=77)
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        plain = run_request(stub, make_request("Describe.", [image], max_tokens=16))
        assert plain.ok, plain
        assert len(plain.token_ids) == 16
        text, ids = plain.text, plain.token_ids

        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = run_request(stub, make_request("Describe.", [image], max_tokens=16, stop=[stop]))
        assert cut.ok, cut
        assert cut.finish_reason == "FINISH_REASON_STOP"
        assert cut.text == text[: text.index(stop)]
        assert stop not in cut.text

        at = ids.index(ids[5])
        by_id = run_request(stub, make_request("Describe.", [image], max_tokens=16, stop_token_ids=[ids[5]]))
        assert (by_id.finish_reason, by_id.token_ids) == ("FINISH_REASON_STOP", ids[: at + 1])

        held = run_request(
            stub, make_request("Describe.", [image], max_tokens=16, stop_token_ids=[ids[0]], min_tokens=6)
        )
        assert held.ok, held
        assert ids[0] not in held.token_ids[:6]
        assert held.finish_reason == "FINISH_REASON_LENGTH" or held.token_ids[-1] == ids[0]
        assert run_request(stub, make_request("Hi", max_tokens=2)).ok


def test_requests_in_flight_when_a_rank_is_killed_get_a_typed_scheduler_unavailable(
    tiny_model: Path, tmp_path: Path
) -> None:

    sched = start_scheduler(tiny_model, tmp_path / "scheduler.log", extra=["--port", "0"])
    try:
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        first = threading.Semaphore(0)
        failures: list[grpc.RpcError | None] = []

        def long_call(i: int) -> None:
            request = scheduler_pb2.GenerateRequest(
                request_id=f"long-{i}",
                input_ids=[1, 22557, 1526, 100 + i],
                sampling=common_pb2.SamplingParams(max_tokens=1000, min_tokens=1000),
            )
            with scheduler_channel(sched.address) as channel:
                try:
                    for event in scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=120):
                        if event.HasField("tokens"):
                            first.release()
                    failures.append(None)
                except grpc.RpcError as exc:
                    failures.append(exc)

        threads = [threading.Thread(target=long_call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in range(3):
            assert first.acquire(timeout=60)
        ranks = rank_processes(sched.pid)
        os.kill(ranks[0].pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert len(failures) == 3
        for exc in failures:
            assert exc is not None, "a request finished although its group died"
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            detail = error_info_of(exc)
            assert detail is not None, f"untyped status: {exc.details()}"
            assert detail.reason == "SCHEDULER_UNAVAILABLE"
            assert detail.metadata["retriable"] == "true"
        assert sched.proc.wait(30) != 0
    finally:
        sched.stop()
