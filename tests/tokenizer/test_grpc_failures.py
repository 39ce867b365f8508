"""A call that fails ends with its typed status (code, details, our
ErrorInfo) and leaves nothing of its own for the garbage collector:
grpc.aio's `abort` keeps the AbortError it raises on the call's state, and
its traceback holds every frame it passed through, a reference cycle that
kept each failed request's frames and locals (its request, its images'
bytes) alive until a full collection. The servicers end streamed calls
with `serving.end_with` instead; unary ones, which must abort, with
`serving.abort`, whose error lets go of its traceback once the call is
done (what stays in a cycle is grpc.aio's own call state, and that error)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from mmsplit.errors import error_info_of
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_server.serving import TokenAuth
from tests.support.cycles import server_calls_ended, uncollected
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


async def _calls() -> tuple[list[str], list[tuple[grpc.StatusCode, str]], list[str], list[str]]:
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
                await server_calls_ended()
            # Unary calls are aborted (no message before the status).
            await one(stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=tokenizer_pb2.GenerateRequest())))
            with uncollected() as unary:
                for i in range(3):
                    await one(stub.Tokenize(_tokenize(f"t{i}")))
                    await one(stub.Tokenize(_tokenize("\x00bad")))
                await server_calls_ended()
    finally:
        await server.stop(None)
    return found, ended, messages, unary


def _tokenize(rid: str) -> tokenizer_pb2.TokenizeRequest:
    return tokenizer_pb2.TokenizeRequest(request=tokenizer_pb2.GenerateRequest(request_id=rid, prompt="x" * 100_000))


def test_a_failed_call_ends_typed_and_leaves_no_frame_for_the_collector() -> None:
    """Generate's stream ends with the status alone: no message is added
    before it (the refused id gets none; the others their one)."""
    found, ended, messages, unary = asyncio.run(_calls())
    decode = (grpc.StatusCode.INVALID_ARGUMENT, "MEDIA_DECODE_FAILED")
    invalid = (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert ended == [decode, *[decode, invalid] * 3, decode, *[decode, invalid] * 3]
    assert messages == ["warm", "r0", "r1", "r2"]
    assert found == [], found
    # Tokenize's aborts: no frame, no request; each AbortError alone, on
    # grpc.aio's call state (its own cycle), holding nothing else.
    assert unary, "grpc.aio's call state is no longer in a cycle: `uncollected` sees nothing at all"
    assert set(unary) == {"AbortError"}, unary


async def _denied() -> tuple[list[object], grpc.StatusCode | None, list[str]]:
    server = grpc.aio.server(interceptors=[TokenAuth(lambda: ["the token"])])
    servicer = TokenizerServicer(FailingService(), TokenizerSettings(model_dir=Path("unused")))  # type: ignore[arg-type]
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    got: list[object] = []
    codes: list[grpc.StatusCode] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            with uncollected() as found:
                for i in range(3):
                    try:
                        async for message in stub.Generate(tokenizer_pb2.GenerateRequest(request_id=f"no-token-{i}")):
                            got.append(message)
                    except grpc.aio.AioRpcError as refused:
                        codes.append(refused.code())
                    try:
                        await stub.Tokenize(_tokenize(f"no-token-{i}"))
                    except grpc.aio.AioRpcError as refused:
                        codes.append(refused.code())
                await server_calls_ended()
    finally:
        await server.stop(None)
    return got, codes[0] if set(codes) == {codes[0]} and len(codes) == 6 else None, found


def test_a_call_refused_for_want_of_a_token_gets_no_message_and_leaves_nothing() -> None:
    """The token check's handler is unary, and answers every method: it
    aborts, since a unary handler that returned would send its (empty)
    message to a streaming caller before the status; its request is not
    kept in a cycle (`serving.abort`)."""
    got, code, found = asyncio.run(_denied())
    assert (got, code) == ([], grpc.StatusCode.UNAUTHENTICATED)
    assert found, "grpc.aio's call state is no longer in a cycle: `uncollected` sees nothing at all"
    assert set(found) == {"AbortError"}, found
