"""How the tokenizer reads a failed call to its scheduler (`SchedulerLink._failure`):
our scheduler's own errors keep their ErrorInfo's code; what gRPC itself
reports when the connection breaks mid-call is the scheduler being
unavailable (retriable), INTERNAL "Internal error from Core" included: a
killed group once surfaced as a non-retriable INTERNAL (the chaos test)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from mmsplit.errors import E, MmsplitError
from mmsplit_server.serving import ClientSecurity
from tokenizer_svc.downstream import SchedulerLink
from tokenizer_svc.errors import InternalError, MediaDecodeFailed
from tokenizer_svc.settings import TokenizerSettings


def _failed(code: grpc.StatusCode, details: str, typed: MmsplitError | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if isinstance(typed, MmsplitError):
        trailing = grpc.aio.Metadata(*typed.to_status().trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def test_grpc_s_own_internal_is_the_scheduler_unavailable_and_ours_stays_typed(tmp_path: Path) -> None:
    async def run() -> list[int]:
        link = SchedulerLink(TokenizerSettings(model_dir=tmp_path), ClientSecurity(), "127.0.0.1:1")
        try:
            return [
                link._failure(exc).error_code
                for exc in (
                    _failed(grpc.StatusCode.INTERNAL, "Internal error from Core"),
                    _failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
                    _failed(grpc.StatusCode.INTERNAL, "a bug", InternalError("a bug")),
                    _failed(grpc.StatusCode.INVALID_ARGUMENT, "bad", MediaDecodeFailed("bad")),
                    _failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large"),
                )
            ]
        finally:
            await link.close()

    assert asyncio.run(run()) == [
        E.ERROR_CODE_SCHEDULER_UNAVAILABLE,
        E.ERROR_CODE_SCHEDULER_UNAVAILABLE,
        E.ERROR_CODE_INTERNAL,
        E.ERROR_CODE_MEDIA_DECODE_FAILED,
        E.ERROR_CODE_INTERNAL,
    ]
