"""Generated requests, well formed as protobuf and wild in every value, to
both services: each ends in success or a typed error, never INTERNAL or
UNKNOWN, and the services go on serving. Media bytes are fuzzed in
`test_bad_media.py`; this covers the rest of a request: ids, prompts and
their markers, URLs of every shape, sampling values (NaN, infinities,
extremes), and, on the scheduler's port, token ids, items, placeholder
runs and tensor references (dtypes, shapes, locations). The examples are
derandomized, so a run is the same every time; an example that failed
before is kept as an explicit case below.

The first runs of this kind found two requests answered INTERNAL: a URL
with an unclosed IPv6 bracket (urllib's ValueError), and a file URL naming
the allowed media directory itself (`os.fdopen` refuses a directory)."""

from __future__ import annotations

import string

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from scheduler_svc.model import model_info
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, tokenizer_stub
from tests.support.local_token import scheduler_channel

pytestmark = pytest.mark.e2e

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GOOD = samples.good_png()
NEVER = ("INTERNAL", "UNKNOWN")

floats = st.one_of(
    st.floats(width=32),  # NaN and the infinities included
    st.sampled_from([0.0, -0.0, 1e-30, 1e-8, 0.5, 1.0, 2.0, -1.0, 1e30]),
)
u32 = st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
markers = st.lists(
    st.sampled_from(["<image>", "<video>", "USER:", " ", "x", "\x00", "</s>", "<s>", "<|im_start|>"]), max_size=8
)
urls = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "http://[::1",  # urllib raises ValueError
            "http://[::1]:99999/x.png",
            "http://127.0.0.1:0/x.png",
            "https://user@[fe80::1%25eth0]/x.png",
            "file:///etc/passwd",
            "file://",
            "data:",
            "data:image/png;base64,@@",
            "data:,",
            "ftp://example.invalid/x.png",
            "//example.invalid/x.png",
            "\x00",
            "good.png",
            "../good.png",
        ]
    ),
)


@st.composite
def client_requests(draw: st.DrawFn) -> tokenizer_pb2.GenerateRequest:
    valid_ids = st.text(alphabet=string.ascii_letters + "-_.:", min_size=1, max_size=30)
    request = tokenizer_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), valid_ids, st.text(max_size=200))),
        prompt=draw(st.one_of(st.just("Describe."), st.text(max_size=60), markers.map("".join))),
    )
    for image in draw(st.lists(st.one_of(st.just(GOOD), st.binary(max_size=40), urls), max_size=3)):
        request.images.append(
            tokenizer_pb2.Image(data=image) if isinstance(image, bytes) else tokenizer_pb2.Image(url=image)
        )
    for video in draw(st.lists(st.one_of(st.binary(max_size=30), urls), max_size=1)):
        request.videos.append(
            tokenizer_pb2.Video(data=video) if isinstance(video, bytes) else tokenizer_pb2.Video(url=video)
        )
    sampling = request.sampling
    # Few tokens, or over the limit (4096): a long generation costs seconds and tests nothing new.
    sampling.max_tokens = draw(st.one_of(st.integers(0, 4), st.integers(4097, 2**32 - 1)))
    sampling.temperature = draw(st.one_of(st.just(0.0), floats))
    sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        sampling.top_p = draw(floats)
    sampling.top_k = draw(u32)
    sampling.min_tokens = draw(st.one_of(st.integers(0, 4), u32))
    sampling.stop_token_ids.extend(draw(st.lists(u32, max_size=4)))
    sampling.stop.extend(draw(st.lists(st.text(max_size=150), max_size=4)))
    if draw(st.booleans()):
        request.image_budget.min_pixels, request.image_budget.max_pixels = draw(u32), draw(u32)
    return request


@FUZZ
@given(request=client_requests())
@example(request=tokenizer_pb2.GenerateRequest(prompt="x", images=[tokenizer_pb2.Image(url="http://[::1")]))
@example(request=tokenizer_pb2.GenerateRequest(prompt="x", images=[tokenizer_pb2.Image(url="file://")]))
def test_client_requests_end_in_success_or_a_typed_error(services: Services, request) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        out = run_request(tokenizer_stub(channel), request, timeout=60)
    if not out.ok:
        assert out.grpc_code not in NEVER, (out.grpc_code, out.reason, out.message)
        assert out.reason, (out.grpc_code, out.message)
        assert out.reason not in NEVER, (out.reason, out.message)


@st.composite
def tensor_refs(draw: st.DrawFn) -> common_pb2.TensorRef:
    dims = st.one_of(st.integers(-2, 300), st.integers(-(2**63), 2**63 - 1))
    ref = common_pb2.TensorRef(dtype=draw(st.integers(0, 12)), shape=draw(st.lists(dims, max_size=5)))
    where = draw(st.sampled_from(["inline", "fitting", "shm", "cuda", "nowhere"]))
    if where == "inline":
        ref.inline = draw(st.binary(max_size=64))
    elif where == "fitting":
        shape = draw(st.one_of(st.just([3, 224, 224]), st.lists(st.integers(0, 40), min_size=1, max_size=4)))
        ref.dtype = common_pb2.DTYPE_FLOAT32
        ref.shape[:] = shape
        ref.inline = np.random.default_rng(0).standard_normal(int(np.prod(shape)), dtype=np.float32).tobytes()
    elif where == "shm":
        names = st.sampled_from(["mmsplit-1-slabffff", "mmsplit-999999-abcdef", "../x", ""])
        ref.shm.segment = draw(st.one_of(names, st.text(max_size=20)))
        ref.shm.offset = draw(st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1)))
        ref.shm.nbytes = draw(st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1)))
    elif where == "cuda":
        ref.cuda_ipc.SetInParent()
    return ref


@st.composite
def scheduler_requests(draw: st.DrawFn, image_token: int, per_image: int) -> scheduler_pb2.GenerateRequest:
    """Most with the placeholder tokens one image needs, so that the
    reference itself is what gets checked."""
    request = scheduler_pb2.GenerateRequest(request_id=draw(st.text(string.ascii_letters, min_size=1, max_size=12)))
    ids = draw(st.lists(st.integers(0, image_token + 5), max_size=8))
    ids += [image_token] * draw(st.sampled_from([per_image, per_image, per_image - 1, per_image + 1, 0]))
    request.input_ids.extend([*ids, *draw(st.lists(st.integers(0, image_token - 1), max_size=4))])
    if draw(st.booleans()):
        request.pixel_values.extend(draw(st.lists(tensor_refs(), max_size=2)))
    else:
        for _ in range(draw(st.integers(0, 2))):
            item = request.items.add(modality=draw(st.sampled_from([1, 1, 0, 2, 7])))
            for key in draw(st.lists(st.sampled_from(["pixel_values", "image_sizes", ""]), max_size=2, unique=True)):
                item.tensors[key].CopyFrom(draw(tensor_refs()))
            for _ in range(draw(st.integers(0, 2))):
                item.placeholders.add(
                    offset=draw(st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))),
                    length=draw(st.one_of(st.just(per_image), st.integers(0, 2**32 - 1))),
                )
    request.sampling.max_tokens = draw(st.integers(0, 4))
    return request


@FUZZ
@given(data=st.data())
def test_scheduler_requests_end_in_success_or_a_typed_error(services: Services, data: st.DataObject) -> None:
    info = model_info(services.model)
    request = data.draw(scheduler_requests(info.image_token_id, info.tokens_per_image))
    with scheduler_channel(services.scheduler_address) as channel:
        failure: grpc.RpcError | None = None
        try:
            list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as exc:
            failure = exc
    if failure is not None:
        error = RemoteError.from_rpc_error(failure)
        # FEATURE_TRANSPORT_FAILED is a typed error whose gRPC code is INTERNAL.
        typed = failure.code().name not in NEVER or error.reason == "FEATURE_TRANSPORT_FAILED"
        assert typed, (failure.code().name, error.reason, error.message)
        assert error.reason != "INTERNAL", error.message


def test_both_still_serve_after_the_fuzzing(services: Services) -> None:
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        after = run_request(tokenizer_stub(channel), make_request("Describe.", [GOOD], max_tokens=2))
    assert after.ok, after
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
