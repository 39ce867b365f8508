"""How the tokenizer reads a failed call to its scheduler (`SchedulerLink._failure`):
our scheduler's own errors keep their ErrorInfo's code; what gRPC itself
reports when the connection breaks mid-call is the scheduler being
unavailable (retriable), INTERNAL "Internal error from Core" included: a
killed group once surfaced as a non-retriable INTERNAL (the chaos test).
And which backend a failing request may go to instead (`Schedulers.pick`)."""

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


def test_a_request_with_one_frame_rows_fails_over_only_to_a_backend_that_takes_them(tmp_path: Path) -> None:
    """`Schedulers.pick(one_frame=True)` (a request whose images went as rows
    of one frame, failing over) passes by a backend whose ServerInfo does not
    say one_frame_image_rows; without media any ready backend will do."""
    from mmsplit.common.v1 import common_pb2
    from tokenizer_svc.downstream import Schedulers

    async def run() -> list[list[str]]:
        settings = TokenizerSettings(model_dir=tmp_path, scheduler="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
        backends = Schedulers(settings, ClientSecurity())
        try:
            old, new, other = backends.links.values()
            for link, takes in ((old, False), (new, True), (other, True)):
                link.info = common_pb2.ServerInfo(one_frame_image_rows=takes)
                link.transport = common_pb2.TRANSPORT_SHM
            shm = common_pb2.TRANSPORT_SHM
            picked = []
            for exclude, one_frame in (([new], True), ([new, other], True), ([new, other], False), ([], True)):
                chosen = [backends.pick(exclude, shm, one_frame=one_frame) for _ in range(6)]
                picked.append(sorted({"-" if link is None else link.target for link in chosen}))
            return picked
        finally:
            for link in backends.links.values():
                await link.close()

    assert asyncio.run(run()) == [
        ["127.0.0.1:3"],
        ["-"],
        ["127.0.0.1:1"],
        ["127.0.0.1:2", "127.0.0.1:3"],
    ]
