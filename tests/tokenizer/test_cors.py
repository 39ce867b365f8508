"""CORS (`--cors-allow-origins`): a page of an allowed origin may call the
HTTP API from a browser — its preflight answered before authentication (a
preflight carries no credentials), every response (errors and streams
included) naming the origin — and a page of any other origin gets no CORS
header, so the browser refuses it the answer. Off by default. The requests
are what a browser sends (Origin, Access-Control-Request-*)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from mmsplit_server.serving import SecretFile
from tokenizer_svc.http_api import HttpApi, start

PAGE = "https://chat.example.com"


class Answers:
    tokenizer = None

    async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
        yield pb.GenerateResponse(delta=pb.TextDelta(text="hi"))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=1, completion_tokens=1))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


async def _exchange(api: HttpApi, origin: str) -> dict[str, Any]:
    """A browser page at `origin`: the preflight, then the call (plain and streamed), with its key."""
    runner, port = await start(api, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    seen: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession() as session:
            preflight = {
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
            }
            async with session.options(url, headers=preflight) as r:
                seen["preflight"] = (r.status, dict(r.headers))
            call = {"Origin": origin, "Authorization": "Bearer k"}
            async with session.post(url, json=CHAT, headers=call) as r:
                seen["call"] = (r.status, dict(r.headers), await r.json())
            async with session.post(url, json={**CHAT, "stream": True}, headers=call) as r:
                seen["stream"] = (r.status, dict(r.headers), await r.text())
            async with session.post(url, json=CHAT, headers={"Origin": origin, "Authorization": "Bearer wrong"}) as r:
                seen["refused"] = (r.status, dict(r.headers))
    finally:
        await runner.cleanup()
    return seen


def _api(tmp_path: Path, origins: tuple[str, ...]) -> HttpApi:
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    return HttpApi(
        Answers(),  # type: ignore[arg-type]
        model="m",
        ready=lambda: True,
        max_body_bytes=1 << 20,
        api_keys=SecretFile(str(keys)),
        cors_origins=origins,
    )


def test_an_allowed_origin_s_page_may_call_with_its_key_and_read_every_answer(tmp_path: Path) -> None:
    seen = asyncio.run(_exchange(_api(tmp_path, ("http://other.example", PAGE)), PAGE))
    status, headers = seen["preflight"]
    assert status == 204, headers  # not 401: a preflight has no key to show
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in headers["Access-Control-Allow-Methods"]
    # Authorization must be named: a wildcard does not cover it.
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
    assert "Origin" in headers["Vary"]
    status, headers, body = seen["call"]
    assert (status, body["choices"][0]["message"]["content"]) == (200, "hi")
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert "x-request-id" in headers["Access-Control-Expose-Headers"]
    status, headers, text = seen["stream"]
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert text.rstrip().endswith("data: [DONE]")
    status, headers = seen["refused"]
    assert status == 401
    assert headers["Access-Control-Allow-Origin"] == PAGE  # the page may read why


def test_any_other_origin_and_the_default_get_no_cors_header(tmp_path: Path) -> None:
    for origins, origin in (((PAGE,), "https://evil.example"), ((), PAGE)):
        seen = asyncio.run(_exchange(_api(tmp_path, origins), origin))
        status, headers = seen["preflight"]
        assert status in (401, 405), headers  # the key asked for, or no OPTIONS route: the browser stops here
        assert "Access-Control-Allow-Origin" not in headers
        status, headers, _ = seen["call"]
        assert status == 200  # not a browser's concern here: without the header, no page reads it
        assert "Access-Control-Allow-Origin" not in headers


def test_a_wildcard_allows_any_page_without_naming_it(tmp_path: Path) -> None:
    seen = asyncio.run(_exchange(_api(tmp_path, ("*",)), "https://any.example"))
    assert seen["preflight"][0] == 204
    assert seen["preflight"][1]["Access-Control-Allow-Origin"] == "*"
    assert seen["call"][1]["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in seen["call"][1]
