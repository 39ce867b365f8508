"""The scheduler's API driven straight by a test client (no tokenizer):
malformed references, injected read failures under concurrency, deadlines."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from mmsplit_server.handoff import files, segment
from scheduler_svc.model import model_info
from tests.conftest import SCHEDULER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests
from tests.support.faults import failing_request_id
from tests.support.granting import grant_ref, grant_table
from tests.support.leaks import PROJECT_PREFIX, project_segments, wait_until
from tests.support.local_token import scheduler_channel

pytestmark = pytest.mark.e2e
F32 = common_pb2.DTYPE_FLOAT32


@pytest.fixture
def sched(services: Services):  # type: ignore[no-untyped-def]
    with scheduler_channel(services.scheduler_address) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


def outcome(stub: scheduler_pb2_grpc.SchedulerServiceStub, request: scheduler_pb2.GenerateRequest) -> tuple[str, dict]:
    """("ok", {}) or (ErrorInfo reason, metadata) of one direct call."""
    try:
        events = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as exc:
        error = RemoteError.from_rpc_error(exc)
        return error.reason, {"grpc": exc.code().name, **error.metadata}  # type: ignore[attr-defined]
    assert events[-1].HasField("finished")
    return "ok", {}


def prompt_ids(services: Services, images: int) -> list[int]:
    info = model_info(services.model)
    return [1, *([info.image_token_id] * info.tokens_per_image * images), 22557, 1526]


def shm_ref(name: str, shape: list[int], *, offset: int = 0, nbytes: int | None = None) -> common_pb2.TensorRef:
    n = int(np.prod(shape)) * 4 if nbytes is None else nbytes
    return common_pb2.TensorRef(dtype=F32, shape=shape, shm=common_pb2.ShmSlice(segment=name, offset=offset, nbytes=n))


IMAGE = [3, 224, 224]
GOOD = np.random.default_rng(1).random(IMAGE, dtype=np.float32)
PID = os.getpid()


def malformed_cases() -> list[tuple[str, common_pb2.TensorRef, str]]:
    real = "REAL"  # replaced by a real segment's name in the test
    return [
        ("name with /", shm_ref(f"{PROJECT_PREFIX}-{PID}-0123456789abcdef/x", IMAGE), "INVALID_REQUEST"),
        ("name with ..", shm_ref("..", IMAGE), "INVALID_REQUEST"),
        (
            "segment that does not exist",
            shm_ref(f"{PROJECT_PREFIX}-{PID}-0123456789abcdef", IMAGE),
            "FEATURE_TRANSPORT_FAILED",
        ),
        ("another prefix", shm_ref(f"other-{PID}-0123456789abcdef", IMAGE), "INVALID_REQUEST"),
        ("no grant", shm_ref(real, IMAGE), "INVALID_REQUEST"),
        ("nbytes != shape x itemsize", shm_ref(real, IMAGE, nbytes=100), "INVALID_REQUEST"),
        ("offset past the end", shm_ref(real, IMAGE, offset=GOOD.nbytes), "INVALID_REQUEST"),
        ("negative shape", common_pb2.TensorRef(dtype=F32, shape=[3, -224, 224], inline=b""), "INVALID_REQUEST"),
        ("zero shape", common_pb2.TensorRef(dtype=F32, shape=[3, 0, 224], inline=b""), "INVALID_REQUEST"),
        ("enormous shape", common_pb2.TensorRef(dtype=F32, shape=[3, 1 << 20, 1 << 20], inline=b""), "INVALID_REQUEST"),
        ("unknown dtype", common_pb2.TensorRef(dtype=42, shape=IMAGE, inline=GOOD.tobytes()), "INVALID_REQUEST"),
        (
            "inline of the wrong length",
            common_pb2.TensorRef(dtype=F32, shape=IMAGE, inline=b"\0" * 10),
            "INVALID_REQUEST",
        ),
        (
            "shape the model cannot take",
            common_pb2.TensorRef(dtype=F32, shape=[3, 8, 8], inline=b"\0" * 768),
            "INVALID_REQUEST",
        ),
    ]


@pytest.mark.parametrize(("case", "ref", "expected"), malformed_cases(), ids=[c[0] for c in malformed_cases()])
def test_malformed_reference_gets_its_code_and_the_group_keeps_serving(
    sched, services: Services, case: str, ref: common_pb2.TensorRef, expected: str
) -> None:
    made = None
    if ref.WhichOneof("location") == "shm" and ref.shm.segment == "REAL":
        made = segment.place(PROJECT_PREFIX, PID, memoryview(GOOD))
        ref.shm.segment = made.segment
    try:
        with grant_table(PROJECT_PREFIX) as table:
            if ref.WhichOneof("location") == "shm" and case != "no grant":
                grant_ref(ref, table)  # what the case probes lies past the grant
            request = scheduler_pb2.GenerateRequest(
                request_id=f"bad-{uuid.uuid4().hex[:8]}", input_ids=prompt_ids(services, 1), pixel_values=[ref]
            )
            reason, metadata = outcome(sched, request)
        assert reason == expected, (case, metadata)
        if expected == "FEATURE_TRANSPORT_FAILED":
            # Refused at admission: rank 0 locks every segment before it
            # says Accepted, and a missing one cannot be locked.
            assert "failed_ranks" not in metadata
            assert metadata["grpc"] == "INTERNAL"
    finally:
        if made is not None:
            files.unlink(made.segment)  # rejected before acceptance: still ours
    good = scheduler_pb2.GenerateRequest(
        request_id=f"good-{uuid.uuid4().hex[:8]}",
        input_ids=prompt_ids(services, 1),
        pixel_values=[common_pb2.TensorRef(dtype=F32, shape=IMAGE, inline=GOOD.tobytes())],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    assert outcome(sched, good)[0] == "ok"
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)


def test_injected_read_failures_among_16_concurrent_requests(services: Services) -> None:
    images = [samples.good_png(seed=100 + i) for i in range(16)]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        # Without injection, one at a time: the tokens each request must get.
        expected = [run_request(stub, make_request("Describe.", [img], max_tokens=6)).token_ids for img in images]
        tag = uuid.uuid4().hex[:6]
        fail_on = {3: 1, 7: 0, 11: 1, 12: 1}  # request index -> rank whose read fails
        ids = [failing_request_id(fail_on[i], f"{tag}-{i}") if i in fail_on else f"ok-{tag}-{i}" for i in range(16)]
        barrier = threading.Barrier(16)

        def send(i: int):  # type: ignore[no-untyped-def]
            barrier.wait()
            return run_request(
                stub, make_request("Describe.", [images[i]], max_tokens=6, request_id=ids[i]), timeout=90
            )

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(send, range(16)))
    for i, out in enumerate(results):
        if i in fail_on:
            assert out.reason == "FEATURE_TRANSPORT_FAILED", (i, out)
            assert out.metadata["failed_ranks"] == str(fail_on[i])
        else:
            assert out.ok, (i, out)
            assert out.token_ids == expected[i], i
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)


def test_deadline_shorter_than_the_generation(services: Services) -> None:
    rid = f"deadline-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        out = run_request(
            stub, make_request("Go on and on.", [samples.good_png()], max_tokens=4000, request_id=rid), timeout=1.5
        )
    assert out.grpc_code == "DEADLINE_EXCEEDED"
    log = services.scheduler.log_path
    assert wait_until(lambda: f".{rid} aborted on all 2 ranks" in log.read_text(), timeout=10)
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert wait_until(lambda: not project_segments(), timeout=10)


def test_requests_a_direct_client_malformed_are_refused_and_the_group_keeps_serving(
    services: Services,
    sched,  # type: ignore[no-untyped-def]
) -> None:
    """The request itself, beside its tensors' references: an id that is
    empty, too long or not printable; items and legacy pixel_values
    together; more items than the limit; an input the model does not
    have, too many tensors in an item, an integer encoder input; legacy
    pixel_values whose placeholders are not one run. Each is
    INVALID_REQUEST (INVALID_ARGUMENT) before anything is admitted, and a
    good request is served after them."""
    info = model_info(services.model)
    per_image, holder = info.tokens_per_image, info.image_token_id
    ids = prompt_ids(services, 1)
    pixels = common_pb2.TensorRef(dtype=F32, shape=[1, *IMAGE], inline=GOOD.tobytes())
    run = common_pb2.PlaceholderRange(offset=1, length=per_image)

    def item(**tensors: common_pb2.TensorRef) -> common_pb2.MultimodalItem:
        return common_pb2.MultimodalItem(
            modality=common_pb2.MODALITY_IMAGE, tensors=tensors or {"pixel_values": pixels}, placeholders=[run]
        )

    legacy = common_pb2.TensorRef(dtype=F32, shape=IMAGE, inline=GOOD.tobytes())
    split = [1, *[holder] * (per_image // 2), 22557, *[holder] * (per_image - per_image // 2), 1526]
    integers = common_pb2.TensorRef(dtype=common_pb2.DTYPE_INT64, shape=[1, *IMAGE], inline=GOOD.tobytes() * 2)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"request_id": "", "input_ids": ids, "items": [item()]}, "request_id must be"),
        ({"request_id": "x" * 129, "input_ids": ids, "items": [item()]}, "request_id must be"),
        ({"request_id": "a\nb", "input_ids": ids, "items": [item()]}, "request_id must be"),
        ({"input_ids": ids, "items": [item()], "pixel_values": [legacy]}, "either items or the legacy pixel_values"),
        ({"input_ids": ids, "items": [item()] * 65}, "65 media items, at most"),
        ({"input_ids": ids, "items": [item(pixel_values=pixels, image_sizes=pixels)]}, "'image_sizes' is not an input"),
        ({"input_ids": ids, "items": [item(**{f"t{k}": pixels for k in range(9)})]}, "9 tensors, at most 8"),
        ({"input_ids": ids, "items": [item(pixel_values=integers)]}, "must be a float tensor"),
        ({"input_ids": split, "pixel_values": [legacy]}, "placeholder tokens are not one run"),
    ]
    for fields, said in cases:
        request = scheduler_pb2.GenerateRequest(**{"request_id": f"bad-{uuid.uuid4().hex[:8]}", **fields})
        with pytest.raises(grpc.RpcError) as refused:
            list(sched.Generate(request, timeout=60))
        error = RemoteError.from_rpc_error(refused.value)
        assert (error.reason, refused.value.code()) == ("INVALID_REQUEST", grpc.StatusCode.INVALID_ARGUMENT), said
        assert said in error.message, (said, error.message)
    good = scheduler_pb2.GenerateRequest(
        request_id=f"good-{uuid.uuid4().hex[:8]}", input_ids=ids, items=[item()],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )  # fmt: skip
    assert outcome(sched, good) == ("ok", {})
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)


def test_a_cache_salt_too_long_names_its_field(services: Services, sched) -> None:  # type: ignore[no-untyped-def]
    request = scheduler_pb2.GenerateRequest(
        request_id=f"salt-{uuid.uuid4().hex[:8]}",
        input_ids=[1, 22557, 1526],
        sampling=common_pb2.SamplingParams(max_tokens=2),
        cache_salt="x" * 257,
    )
    reason, metadata = outcome(sched, request)
    assert (reason, metadata.get("param"), metadata["grpc"]) == ("INVALID_REQUEST", "cache_salt", "INVALID_ARGUMENT")
    request.cache_salt = "x" * 256
    assert outcome(sched, request) == ("ok", {})


def test_bad_word_sequences_are_checked_and_banned_for_a_direct_client(services: Services, sched) -> None:  # type: ignore[no-untyped-def]
    """GenerateRequest.bad_words from a client of the scheduler itself:
    over the limits or outside the vocabulary it is INVALID_REQUEST naming
    bad_words; within them, the greedy answer never holds a banned
    sequence (here its own first two tokens, then its first alone)."""

    def request(*words: list[int], tokens: int = 6) -> scheduler_pb2.GenerateRequest:
        return scheduler_pb2.GenerateRequest(
            request_id=f"bad-{uuid.uuid4().hex[:8]}",
            input_ids=[1, 22557, 1526],
            sampling=common_pb2.SamplingParams(max_tokens=tokens),
            bad_words=[scheduler_pb2.TokenSequence(token_ids=w) for w in words],
        )

    def answer(req: scheduler_pb2.GenerateRequest) -> list[int]:
        return [t for e in sched.Generate(req, timeout=60) if e.HasField("tokens") for t in e.tokens.token_ids]

    vocab = model_info(services.model).vocab_size
    for words in ([[]], [[1] * 65], [[5]] * 129, [[5, vocab]]):
        reason, metadata = outcome(sched, request(*words))
        assert (reason, metadata.get("param")) == ("INVALID_REQUEST", "bad_words"), words
    plain = answer(request())
    pair = answer(request(plain[:2]))
    assert pair[0] == plain[0]
    assert pair[1] != plain[1]
    alone = answer(request(plain[:1]))
    assert plain[0] not in alone
