"""A call that fails ends with its typed status (code, details, our
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


async def _calls() -> tuple[list[str], list[tuple[grpc.StatusCode, str]]]:
    server = grpc.aio.server()
    servicer = TokenizerServicer(FailingService(), TokenizerSettings(model_dir=Path("unused")))  # type: ignore[arg-type]
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ended: list[tuple[grpc.StatusCode, str]] = []
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
                        pass

                await one(read())

            await streamed(tokenizer_pb2.GenerateRequest(request_id="warm"))  # gRPC's own first-call objects
            with uncollected() as found:
                for i in range(3):
                    await streamed(tokenizer_pb2.GenerateRequest(request_id=f"r{i}"))
                    await one(stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=tokenizer_pb2.GenerateRequest())))
                    await streamed(tokenizer_pb2.GenerateRequest(request_id="\x00bad"))
                await asyncio.sleep(0.1)  # the calls' own ends, on the server's side
    finally:
        await server.stop(None)
    return found, ended


def test_a_failed_call_ends_typed_and_leaves_no_frame_for_the_collector() -> None:
    found, ended = asyncio.run(_calls())
    decode = (grpc.StatusCode.INVALID_ARGUMENT, "MEDIA_DECODE_FAILED")
    assert ended[0] == decode
    assert ended[1:] == [decode, decode, (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")] * 3
    assert found == [], found
