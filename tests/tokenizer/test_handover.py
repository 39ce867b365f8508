"""A streamed request's media are let go once they are prepared, not when
its answer ends: a protobuf message's strings and bytes are freed only with
the whole message, so every frame that kept the request (gRPC's, the HTTP
call's, the service's) kept a data: URL's megabytes while tokens streamed
(bench/stream_hold.py measured 1-2 bodies a stream). The front ends hand
the request over (`serving.Handed`); the service keeps it without its media
and prompt (`conversation.PREPARED_ONCE`) once they are prepared.

Each test looks while the answer is streaming: nothing but the one frame
that runs refers to the request (a suspended generator or coroutine that
kept it would be among `gc.get_referrers`), and gRPC keeps no copy of its
bytes (`tracemalloc`)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai

from mmsplit.common.v1 import common_pb2
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_server.serving import ClientSecurity, Handed, Health, new_server
from tokenizer_svc.downstream import PLAIN_ROWS, SCHEDULER_SERVICE, SchedulerLink
from tokenizer_svc.http_api import HttpApi, start
from tokenizer_svc.preprocess import ItemResult, ItemTensor, Job
from tokenizer_svc.server import GENERATE, SERVICE_NAME, TokenizerServicer, _load_processor
from tokenizer_svc.service import TokenizerService
from tokenizer_svc.settings import TokenizerSettings

BIG = 8 << 20  # a request's bytes: what must not stay while it streams


class Taking:
    """A stand-in service that takes its request and, while its answer is
    open, notes who else refers to it and what large blocks are left."""

    tokenizer = None

    def __init__(self) -> None:
        self.referrers: list[str] = []
        self.left: list[int] = []

    async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> AsyncIterator[Any]:
        assert isinstance(request, Handed)
        taken = request.take()
        del request
        self.referrers = [type(r).__name__ for r in gc.get_referrers(taken)]
        del taken
        if tracemalloc.is_tracing():
            self.left = [s.size for s in tracemalloc.take_snapshot().statistics("traceback") if s.size > BIG // 2]
        yield tokenizer_pb2.GenerateResponse(delta=tokenizer_pb2.TextDelta(text="ok"))


def test_grpc_hands_a_streamed_request_over_and_keeps_no_copy_of_its_bytes() -> None:
    """Generate's servicer is handed the request; gRPC's frames keep neither
    the message nor its bytes (grpc.aio keeps a unary request's bytes
    until the call ends: the method is read as a stream of one)."""
    request = tokenizer_pb2.GenerateRequest(request_id="big")
    request.images.add(data=b"\1" * BIG)
    raw = request.SerializeToString()  # made before the tracing: the client's own copy is not counted
    del request
    service = Taking()

    async def run() -> list[bytes]:
        server, port = await new_server(
            host="127.0.0.1", port=0, health_=Health(SERVICE_NAME), service_names=[SERVICE_NAME],
            max_message_bytes=64 << 20, handed=[GENERATE],
        )  # fmt: skip
        servicer = TokenizerServicer(service, TokenizerSettings(model_dir=Path("unused")))  # type: ignore[arg-type]
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
        await server.start()
        try:
            options = [("grpc.max_send_message_length", 64 << 20)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
                return [message async for message in call(raw)]
        finally:
            await server.stop(None)

    tracemalloc.start()
    try:
        answers = asyncio.run(run())
    finally:
        tracemalloc.stop()
    assert len(answers) == 1
    assert service.referrers == [], service.referrers
    assert service.left == [], f"blocks of {service.left} bytes kept while the answer streamed"


def test_a_generate_call_to_the_scheduler_keeps_no_request_while_it_answers() -> None:
    """A scheduler request that goes by a Generate call of its own
    (--scheduler-stream false, or one too large for the shared stream):
    nothing refers to it while its answer streams. grpc.aio's unary call
    kept it, inline tensors and all, until the call ended; the call is
    made as a stream of one request."""
    go_on = asyncio.Event()

    async def generate(request: scheduler_pb2.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        yield scheduler_pb2.GenerateResponse(accepted=scheduler_pb2.Accepted())
        yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[5]))
        await go_on.wait()
        yield scheduler_pb2.GenerateResponse(finished=scheduler_pb2.Finished(completion_tokens=1))

    async def run() -> tuple[list[str], int]:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        method = grpc.unary_stream_rpc_method_handler(
            generate,
            request_deserializer=scheduler_pb2.GenerateRequest.FromString,
            response_serializer=scheduler_pb2.GenerateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SCHEDULER_SERVICE, {"Generate": method})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        settings = TokenizerSettings(model_dir=Path("unused"), scheduler_stream=False)
        link = SchedulerLink(settings, ClientSecurity(), f"127.0.0.1:{port}")
        try:
            request = scheduler_pb2.GenerateRequest(request_id="r", input_ids=[1, 2])
            request.items.add().tensors["pixel_values"].inline = b"\1" * BIG
            events = link.generate(Handed(request), timeout_s=30.0)
            answers = [await events.__anext__(), await events.__anext__()]  # accepted, then a token
            referrers = [type(r).__name__ for r in gc.get_referrers(request)]
            go_on.set()
            answers += [event async for event in events]
            return referrers, len(answers)
        finally:
            await link.close()
            await server.stop(None)

    assert asyncio.run(run()) == ([], 3)


def test_an_http_call_hands_its_request_over_and_keeps_it_without_media() -> None:
    service = Taking()

    async def run() -> str:
        api = HttpApi(service, model="m", ready=lambda: True, max_body_bytes=32 << 20)  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        url = "data:image/png;base64," + "A" * BIG
        content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
        try:
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])  # type: ignore[misc,list-item]
            return reply.choices[0].message.content or ""
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(run()) == "ok"
    assert service.referrers == [], service.referrers


class Pool:
    """Answers every image with small pixels, inline (as workers do for an
    inline transport); keeps each answer's bytes in `made`."""

    def __init__(self) -> None:
        self.made: list[bytes] = []

    async def preprocess(self, job: Job, *, timeout_s: float, request_id: str) -> ItemResult:
        pixels = np.zeros((1, 3, 8, 8), dtype=np.float32)
        self.made.append(pixels.tobytes())
        tensor = ItemTensor("pixel_values", "float32", pixels.shape, pixels.nbytes, inline=self.made[-1])
        return ItemResult(common_pb2.MODALITY_IMAGE, (tensor,), tokens=4, content_hash=b"", width=8, height=8)


class Media:
    async def load(self, medium: Any) -> bytes:
        return b"an image"


class Backend:
    """A scheduler that takes tensors inline, accepts, sends a token, then
    holds the answer open until told (`go_on`)."""

    target = "stand-in"
    transport = common_pb2.TRANSPORT_INLINE
    info = common_pb2.ServerInfo(max_context_tokens=4096, max_tokens_limit=64, default_max_tokens=8, eos_token_ids=[2])

    def __init__(self) -> None:
        self.inflight = 0
        self.go_on = asyncio.Event()
        # Set once `expect` answers are held open (every choice streaming).
        self.holding, self.expect, self.all_held = 0, 1, asyncio.Event()

    def row_form(self, family: Any) -> Any:
        return PLAIN_ROWS

    def takes(self, form: Any) -> bool:
        return True

    async def generate(self, request: scheduler_pb2.GenerateRequest, *, timeout_s: float | None) -> AsyncIterator[Any]:
        yield scheduler_pb2.GenerateResponse(accepted=scheduler_pb2.Accepted())
        yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[5]))
        self.holding += 1
        if self.holding == self.expect:
            self.all_held.set()
        await self.go_on.wait()
        yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[6]))
        done = scheduler_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_LENGTH, completion_tokens=2)
        yield scheduler_pb2.GenerateResponse(finished=done)


class Link:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.serving_another_model = ""
        self.max_context = 4096

    def pick(self, **_: Any) -> Backend:
        return self.backend


def test_the_service_keeps_a_streaming_request_without_its_media(tiny_model: Path) -> None:
    """The real service (a stand-in pool, media loader and scheduler): one
    choice, and n choices, each hold the request only until its media are
    prepared and its prompt built, and the preprocessed tensors' bytes (an
    inline transport's) only until they are in the scheduler request."""
    settings = TokenizerSettings(model_dir=tiny_model, preprocess_cache_bytes=0)  # a cache keeps tensors by design
    family, tokenizer, template = _load_processor(settings)
    backend, pool = Backend(), Pool()
    service = TokenizerService(settings, family, tokenizer, Media(), pool, None, chat_template=template)  # type: ignore[arg-type]
    service.link = Link(backend)  # type: ignore[assignment]

    async def look(n: int) -> tuple[list[str], list[str]]:
        request = tokenizer_pb2.GenerateRequest(request_id=f"n{n}", prompt="Describe it.", n=n)
        request.images.add(data=b"an image")
        request.sampling.max_tokens = 2
        backend.go_on, backend.all_held = asyncio.Event(), asyncio.Event()
        backend.holding, backend.expect = 0, n
        pool.made.clear()
        stream = service.generate(Handed(request), request.request_id, 30.0)
        await stream.__anext__()  # streaming now: the first token's delta
        await backend.all_held.wait()  # every choice's answer
        referrers = [type(r).__name__ for r in gc.get_referrers(request)]
        # The pool's list alone refers to the bytes it made.
        tensors = [type(r).__name__ for made in pool.made for r in gc.get_referrers(made) if r is not pool.made]
        backend.go_on.set()
        async for _ in stream:
            pass
        return referrers, tensors

    async def run() -> dict[str, tuple[list[str], list[str]]]:
        return {"one": await look(1), "n=2": await look(2)}

    assert asyncio.run(run()) == {"one": ([], []), "n=2": ([], [])}
