"""Bytes that are not a protobuf message of the method's type, sent to
either service: INVALID_ARGUMENT with our ErrorInfo (INVALID_REQUEST), not
gRPC's UNKNOWN naming protobuf's exception, and nothing else breaks
(`mmsplit_server.serving.RefuseMalformed`)."""

from __future__ import annotations

import grpc
import pytest

from mmsplit.errors import error_info_of
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, tokenizer_stub
from tests.support.local_token import scheduler_channel

pytestmark = pytest.mark.e2e

# Each fails to parse as any message: a field of 5 bytes with 2 there; a
# length past the end; a varint of 11 bytes.
GARBAGE = [b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10x", b"\x08" + b"\xff" * 11]
TOKENIZER_METHODS = [
    ("/mmsplit.tokenizer.v1.TokenizerService/Generate", True),
    ("/mmsplit.tokenizer.v1.TokenizerService/GetServerInfo", False),
    ("/grpc.health.v1.Health/Check", False),
    ("/grpc.health.v1.Health/Watch", True),  # a servicer that writes with context.write
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None),  # a streamed request
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", None),  # the same servicer, its other name
]
SCHEDULER_METHODS = [
    ("/mmsplit.scheduler.v1.SchedulerService/Generate", True),
    ("/mmsplit.scheduler.v1.SchedulerService/GetServerInfo", False),
]


def call_raw(address: str, method: str, streaming: bool | None, payload: bytes) -> grpc.RpcError:
    """The error a call of `method` with `payload` as its request ends in
    (`streaming`: whether the answer is a stream; None: both are)."""
    with scheduler_channel(address) as channel:  # a scheduler asks for its local token
        identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        try:
            if streaming is None:
                list(channel.stream_stream(method, **identity)(iter([payload]), timeout=10))
            elif streaming:
                list(channel.unary_stream(method, **identity)(payload, timeout=10))
            else:
                channel.unary_unary(method, **identity)(payload, timeout=10)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} accepted {payload!r}")


@pytest.mark.parametrize("payload", GARBAGE)
def test_garbage_is_an_invalid_request_on_every_method(services: Services, payload: bytes) -> None:
    targets = [(services.tokenizer_address, m, s) for m, s in TOKENIZER_METHODS]
    targets += [(services.scheduler_address, m, s) for m, s in SCHEDULER_METHODS]
    for address, method, streaming in targets:
        exc = call_raw(address, method, streaming, payload)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.code(), exc.details())
        info = error_info_of(exc)
        assert info is not None, (method, exc.details())
        assert info.reason == "INVALID_REQUEST", (method, exc.details())
        details = exc.details() or ""
        assert "protobuf" in details
        assert "DecodeError" not in details
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        after = run_request(tokenizer_stub(channel), make_request("Describe.", [samples.good_png()], max_tokens=2))
    assert after.ok, after
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
