"""A streamed call that fails ends with its typed status (code, details, our
ErrorInfo) and leaves nothing for the garbage collector: grpc.aio's
`abort` keeps the AbortError it raises on the call's state, and its
traceback holds every frame it passed through, a reference cycle that kept
each failed request's frames and locals (its request, its images' bytes)
alive until a full collection. The servicers end such calls with
`serving.end_with` instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from mmsplit.errors import error_info_of
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_server.serving import TokenAuth
from tests.support.cycles import uncollected
from tokenizer_svc.errors import MediaDecodeFailed
from tokenizer_svc.server import TokenizerServicer
from tokenizer_svc.settings import TokenizerSettings


class FailingService:
    """Fails every request after its first message, holding a large local (as
    a request's decoded media would be) in the frame the failure passes."""

    async def generate(
        self, request: tokenizer_pb2.GenerateRequest, rid: str, remaining: float | None, client: str
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        media = bytearray(1 << 20)
        yield tokenizer_pb2.GenerateResponse()
        raise MediaDecodeFailed(f"image could not be decoded ({len(media)} bytes)")

    async def tokenize(self, request: tokenizer_pb2.GenerateRequest, rid: str, client: str) -> list[int]:
        media = bytearray(1 << 20)
        raise MediaDecodeFailed(f"image could not be decoded ({len(media)} bytes)")


async def _calls() -> tuple[list[str], list[tuple[grpc.StatusCode, str]], list[str]]:
    server = grpc.aio.server()
    servicer = TokenizerServicer(FailingService(), TokenizerSettings(model_dir=Path("unused")))  # type: ignore[arg-type]
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ended: list[tuple[grpc.StatusCode, str]] = []
    messages: list[str] = []  # the request id of each message a Generate call received
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

            async def one(call: object) -> None:
                try:
                    await call  # type: ignore[misc]
                except grpc.aio.AioRpcError as failed:
                    info = error_info_of(failed)
                    ended.append((failed.code(), info.reason if info else ""))
                else:
                    ended.append((grpc.StatusCode.OK, ""))

            async def streamed(request: tokenizer_pb2.GenerateRequest) -> None:
                async def read() -> None:
                    async for _ in stub.Generate(request):
                        messages.append(request.request_id)

                await one(read())

            await streamed(tokenizer_pb2.GenerateRequest(request_id="warm"))  # gRPC's own first-call objects
            with uncollected() as found:
                for i in range(3):
                    await streamed(tokenizer_pb2.GenerateRequest(request_id=f"r{i}"))
                    await streamed(tokenizer_pb2.GenerateRequest(request_id="\x00bad"))
                await asyncio.sleep(0.1)  # the calls' own ends, on the server's side
            # Unary calls are aborted (no message before the status), as before.
            await one(stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=tokenizer_pb2.GenerateRequest())))
    finally:
        await server.stop(None)
    return found, ended, messages


def test_a_failed_call_ends_typed_and_leaves_no_frame_for_the_collector() -> None:
    """Generate's stream ends with the status alone: no message is added
    before it (the refused id gets none; the others their one)."""
    found, ended, messages = asyncio.run(_calls())
    decode = (grpc.StatusCode.INVALID_ARGUMENT, "MEDIA_DECODE_FAILED")
    invalid = (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert ended == [decode, *[decode, invalid] * 3, decode]
    assert messages == ["warm", "r0", "r1", "r2"]
    assert found == [], found


async def _denied() -> tuple[list[object], grpc.StatusCode | None]:
    server = grpc.aio.server(interceptors=[TokenAuth(lambda: ["the token"])])
    servicer = TokenizerServicer(FailingService(), TokenizerSettings(model_dir=Path("unused")))  # type: ignore[arg-type]
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    got: list[object] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                async for message in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(
                    tokenizer_pb2.GenerateRequest(request_id="no-token")
                ):
                    got.append(message)
            except grpc.aio.AioRpcError as refused:
                return got, refused.code()
    finally:
        await server.stop(None)
    return got, None


def test_a_stream_refused_for_want_of_a_token_gets_no_message() -> None:
    """The token check's handler is unary, and answers every method: it
    aborts, since a unary handler that returned would send its (empty)
    message to a streaming caller before the status."""
    assert asyncio.run(_denied()) == ([], grpc.StatusCode.UNAUTHENTICATED)
