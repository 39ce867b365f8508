from __future__ import annotations

import grpc
import pytest

from mmsplit.errors import DOMAIN, TABLE, E, MmsplitError, RemoteError, code_of_reason, error_info_of, reason_of


def test_every_error_code_has_one_mapping() -> None:
    codes = [v for v in E.values() if v != E.ERROR_CODE_UNSPECIFIED]
    assert sorted(TABLE) == sorted(codes)


@pytest.mark.parametrize("code", [v for v in E.values() if v != E.ERROR_CODE_UNSPECIFIED])
def test_status_roundtrip(code: int) -> None:
    error = RemoteError(code, "it broke", metadata={"failed_ranks": "1"})
    status = error.to_status("req-1")
    assert status.code == TABLE[code].grpc_code

    class FakeRpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return status.trailing_metadata

    info = error_info_of(FakeRpcError())
    assert info is not None
    assert info.domain == DOMAIN
    assert info.reason == reason_of(code)
    assert info.metadata["request_id"] == "req-1"
    assert info.metadata["retriable"] == str(TABLE[code].retriable).lower()
    back = RemoteError.from_rpc_error(FakeRpcError())
    assert back.error_code == code
    assert back.message == "it broke"
    assert back.metadata == {"failed_ranks": "1"}


def test_foreign_statuses_map_by_grpc_code() -> None:
    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return ()

    error = RemoteError.from_rpc_error(Unavailable(), unavailable_code=E.ERROR_CODE_SCHEDULER_UNAVAILABLE)
    assert error.reason == "SCHEDULER_UNAVAILABLE"
    assert RemoteError.from_rpc_error(Unavailable()).reason == "INTERNAL"


def test_reason_names() -> None:
    assert reason_of(E.ERROR_CODE_MEDIA_DECODE_FAILED) == "MEDIA_DECODE_FAILED"
    assert code_of_reason("MEDIA_DECODE_FAILED") == E.ERROR_CODE_MEDIA_DECODE_FAILED
    assert code_of_reason("NO_SUCH_THING") == E.ERROR_CODE_INTERNAL
    assert str(MmsplitError("x")) == "INTERNAL: x"


def test_the_message_scan_catches_what_must_not_reach_users() -> None:
    from tests.support import messages

    host = messages.boot_id()
    told = [
        "image could not be decoded: OSError: broken data stream",
        "the segment does not exist (released already, or never created)",
        "segment mmsplit-1234-0123456789abcdef does not exist",
        f"namespace {host}:21",
        'Traceback (most recent call last):\n  File "x.py", line 3, in f',
    ]
    assert messages.leaks(told) == told[2:]
