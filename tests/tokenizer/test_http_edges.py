"""The HTTP API's answers to requests that never reach a handler's logic:
a body that cannot be read (its Content-Encoding is not what its bytes are
in), a path this server does not serve, a method a path does not take. Each
gets a 4xx in the OpenAI error shape that says what was wrong, never a 500,
and the server goes on answering."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from tests.support.cycles import uncollected
from tokenizer_svc.http_api import HttpApi, _Prefetch, start
from tokenizer_svc.response_store import ResponseStore

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


class Answers:
    tokenizer = None

    async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
        yield pb.GenerateResponse(delta=pb.TextDelta(text="hi"))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=1, completion_tokens=1))


async def _calls(*calls: tuple[str, str, bytes, dict[str, str]]) -> list[tuple[int, dict[str, str], Any]]:
    """Each call on a connection of its own (a refused body closes its connection)."""
    api = HttpApi(Answers(), model="m", ready=lambda: True, max_body_bytes=1 << 20)  # type: ignore[arg-type]
    runner, port = await start(api, "127.0.0.1", 0)
    seen = []
    try:
        for method, path, body, headers in calls:
            url = f"http://127.0.0.1:{port}{path}"
            async with (
                aiohttp.ClientSession() as session,
                session.request(method, url, data=body, headers=headers) as r,
            ):
                seen.append((r.status, dict(r.headers), json.loads(await r.read())))
    finally:
        await runner.cleanup()
    return seen


def test_a_body_not_in_its_content_encoding_is_refused_and_the_next_request_is_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = json.dumps(CHAT).encode()
    json_type = {"content-type": "application/json"}
    with caplog.at_level(logging.ERROR):
        refused, zipped, after = asyncio.run(
            _calls(
                ("POST", "/v1/chat/completions", plain, {**json_type, "content-encoding": "gzip"}),
                ("POST", "/v1/chat/completions", gzip.compress(plain), {**json_type, "content-encoding": "gzip"}),
                ("POST", "/v1/chat/completions", plain, json_type),
            )
        )
    status, headers, body = refused
    assert status == 400, body
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert "could not be read" in body["error"]["message"]
    assert "gzip" in body["error"]["message"]
    assert headers.get("Connection", "").lower() == "close"  # the stream past the bad bytes is unreadable
    # A body that is in its encoding is read (aiohttp decodes it), and so is a plain one.
    assert zipped[0] == 200, zipped
    assert zipped[2]["choices"][0]["message"]["content"] == "hi"
    assert after[0] == 200, after
    # Neither the handler nor aiohttp logged it as an unexpected error.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_an_unserved_path_is_named_with_the_paths_that_are_and_a_wrong_method_with_its_path() -> None:
    (missing_status, _, missing), (method_status, _, method) = asyncio.run(
        _calls(
            ("POST", "/v1/embeddings", b"{}", {"content-type": "application/json"}),
            ("GET", "/v1/chat/completions", b"", {}),
        )
    )
    assert missing_status == 404
    assert missing["error"]["type"] == "not_found_error"
    message = missing["error"]["message"]
    assert message.startswith("/v1/embeddings is not served here")
    for served in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"):
        assert served in message
    assert method_status == 405
    assert method["error"]["message"] == "Method Not Allowed: GET /v1/chat/completions"


def test_malformed_http_gets_aiohttp_s_400_and_one_warning_line_not_an_error_s_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def exchange() -> tuple[bytes, int]:
        api = HttpApi(Answers(), model="m", ready=lambda: True, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n"
            )
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            # The server still answers.
            good = await _calls(("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), {}))
        finally:
            await runner.cleanup()
        return answer, good[0][0]

    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        answer, after = asyncio.run(exchange())
    assert answer.startswith(b"HTTP/1.0 400 Bad Request"), answer
    assert b"chunk size" in answer
    assert after == 200
    seen = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(seen) == 1, caplog.text
    assert seen[0].levelno == logging.WARNING
    assert seen[0].exc_info is None
    assert "127.0.0.1" in seen[0].getMessage()
    assert "Invalid character in chunk size" in seen[0].getMessage()


def test_a_stream_read_to_its_end_leaves_nothing_for_the_collector() -> None:
    """A stream's events are read through `_Prefetch`: its end, a
    StopAsyncIteration raised from the task that read ahead, held the frame
    that held that task (and `asyncio.wait`'s sets of it), a reference cycle
    each stream left behind for a collection."""

    async def events() -> AsyncIterator[int]:
        yield 1
        yield 2

    async def main() -> list[str]:
        with uncollected() as found:
            prefetch = _Prefetch(events())
            first = await prefetch.first(5.0)
            assert [event async for event in prefetch.rest(first, 5.0)] == [1, 2]
            await prefetch.aclose()
            del prefetch
        return found

    assert asyncio.run(main()) == []


class Held:
    """A service whose answers wait for `go`: their requests stay in flight."""

    tokenizer = None

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: asyncio.Queue[None] = asyncio.Queue()  # one item per answer started

    async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
        self.started.put_nowait(None)
        await self.go.wait()
        yield pb.GenerateResponse(delta=pb.TextDelta(text="hi"))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=1, completion_tokens=1))


def test_bodies_past_their_budget_are_refused_unread_until_the_requests_holding_it_end() -> None:
    """--max-body-bytes-in-flight: with one request of a 600 KB body in
    flight and a budget of 1 MB, another such body is OVERLOADED (429,
    Retry-After: the SDK retries) before it is read, declared or chunked;
    a small one still passes; once the first answer ends its bytes are
    given back and the same body is answered."""
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 600_000}]}).encode()
    small = json.dumps(CHAT).encode()
    json_type = {"content-type": "application/json"}

    async def chunked() -> AsyncIterator[bytes]:
        for at in range(0, len(big), 65536):
            yield big[at : at + 65536]

    async def run() -> dict[str, Any]:
        service = Held()
        api = HttpApi(service, model="m", ready=lambda: True, max_body_bytes=1 << 21,  # type: ignore[arg-type]
                      body_bytes_in_flight=1 << 20)  # fmt: skip
        runner, port = await start(api, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        seen: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession() as held_session:
                first = asyncio.ensure_future(held_session.post(url, data=big, headers=json_type))
                await service.started.get()
                seen["held"] = api.bodies.held
                for name, data in (("declared", big), ("chunked", chunked())):
                    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=json_type) as r:
                        seen[name] = (r.status, dict(r.headers), json.loads(await r.read()))
                # A small body fits beside it: its answer starts (and waits, as the first's does).
                second = asyncio.ensure_future(held_session.post(url, data=small, headers=json_type))
                await service.started.get()
                service.go.set()
                for name, answer in (("first", first), ("small", second)):
                    async with await answer as r:
                        seen[name] = r.status
            async with aiohttp.ClientSession() as session, session.post(url, data=big, headers=json_type) as r:
                seen["after"] = r.status
            # Alone, a chunked body over the bound goes through: its own chunks do not count against it.
            lone = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 1_200_000}]}).encode()

            async def lone_chunks() -> AsyncIterator[bytes]:
                for at in range(0, len(lone), 65536):
                    yield lone[at : at + 65536]

            async with (
                aiohttp.ClientSession() as session,
                session.post(url, data=lone_chunks(), headers=json_type) as r,
            ):
                seen["lone"] = r.status
            seen["end"] = api.bodies.held
        finally:
            await runner.cleanup()
        return seen

    seen = asyncio.run(run())
    assert seen["held"] == len(big)
    for name in ("declared", "chunked"):
        status, headers, body = seen[name]
        assert status == 429, (name, body)
        assert body["error"]["code"] == "OVERLOADED"
        assert "--max-body-bytes-in-flight" in body["error"]["message"]
        assert headers["x-should-retry"] == "true"
        assert headers["Retry-After"]
    assert (seen["first"], seen["small"], seen["after"], seen["end"]) == (200, 200, 200, 0)
    assert seen["lone"] == 200


class Streaming:
    """A service whose answers send one delta, then wait for `go`."""

    tokenizer = None

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
        request.take()  # handed over, as the service takes it (`Call.hand_over`)
        yield pb.GenerateResponse(delta=pb.TextDelta(text="hi"))
        await self.go.wait()
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=1, completion_tokens=1))


def test_a_body_counts_until_its_answer_starts_unless_the_answer_keeps_its_input() -> None:
    """Once an answer streams its media are prepared and let go, so its
    body's bytes are given back to --max-body-bytes-in-flight then, not at
    its end: another 600 KB body is answered beside a streaming one within
    a 1 MB budget. A stored Responses answer keeps its input (for
    `previous_response_id`) until it ends: its bytes still count."""
    text = "x" * 600_000
    chat = {**CHAT, "messages": [{"role": "user", "content": text}], "stream": True}
    responses = {"model": "m", "input": text, "stream": True}

    async def run() -> dict[str, Any]:
        service = Streaming()
        api = HttpApi(service, model="m", ready=lambda: True, max_body_bytes=1 << 21,  # type: ignore[arg-type]
                      body_bytes_in_flight=1 << 20, store=ResponseStore(8 << 20))  # fmt: skip
        runner, port = await start(api, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}/v1"
        seen: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession() as session:
                for name, route, body in (("chat", "chat/completions", chat), ("responses", "responses", responses)):
                    service.go = asyncio.Event()
                    async with session.post(f"{base}/{route}", json=body) as streaming:
                        assert streaming.status == 200
                        await streaming.content.readline()  # the answer has started
                        seen[f"{name} held"] = api.bodies.held
                        async with session.post(f"{base}/chat/completions", json=chat) as other:
                            seen[f"beside {name}"] = other.status  # a stream's headers come with its first event
                            service.go.set()
                            await other.read()
                        await streaming.read()
                seen["end"] = api.bodies.held
        finally:
            await runner.cleanup()
        return seen

    seen = asyncio.run(run())
    assert seen["chat held"] == 0, seen
    assert seen["responses held"] > 600_000, seen
    assert (seen["beside chat"], seen["beside responses"], seen["end"]) == (200, 429, 0), seen
