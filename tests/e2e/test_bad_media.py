"""The bad-media corpus and mutated images through the real services: every
input gets its documented outcome, never INTERNAL or UNKNOWN, and the service
goes on serving with nothing leaked."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status
from tests.support.corpus import corpus

pytestmark = pytest.mark.e2e
CASES = corpus()
MEDIA_ERRORS = {"MEDIA_DECODE_FAILED", "MEDIA_UNSUPPORTED", "MEDIA_TOO_LARGE"}


def test_corpus_is_large_enough() -> None:
    assert len({c.name for c in CASES if c.expected != "ok"}) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_input_gets_its_documented_outcome(services: Services, case) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(services.tokenizer_address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
        request = make_request(
            "Describe.", [case.data] if not case.url else [], urls=[case.url] if case.url else [], max_tokens=1
        )
        out = run_request(stub, request, timeout=60)
        got = "ok" if out.ok else out.reason
        assert got == case.expected, (case.name, out.grpc_code, out.message)
        if not out.ok:
            assert out.grpc_code not in ("INTERNAL", "UNKNOWN")
            assert out.metadata == {} or "failed_ranks" not in out.metadata
        after = run_request(stub, make_request("Describe.", [samples.good_png()], max_tokens=1), timeout=60)
        assert after.ok, after
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"


BASES = [
    samples.good_png(),
    samples.good_jpeg(),
    samples.encode(samples.gradient(96, 64).convert("P"), "GIF"),
    samples.encode(samples.gradient(96, 64), "WEBP"),
]


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 8))):
        # Bias towards the header, where parsers are most fragile.
        pos = draw(st.one_of(st.integers(0, min(63, len(data) - 1)), st.integers(0, len(data) - 1)))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=mutated_images())
def test_mutated_images_never_internal(services: Services, data: bytes) -> None:
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        out = run_request(
            tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("x", [data], max_tokens=1), timeout=60
        )
    assert out.ok or out.reason in MEDIA_ERRORS, (out.grpc_code, out.reason, out.message)


def test_service_still_serving_after_the_mutations(services: Services) -> None:
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
