"""What one request does on the tokenizer's event loop is bounded: big
prompts are built one per turn of the loop (`TokenizerService._built`), a
big body is read in a thread (`http_api._Body`), and /detokenize takes at
most a prompt's ids."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from tokenizer_svc import openai_api
from tokenizer_svc.conversation import Parsed
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.http_api import _Body
from tokenizer_svc.service import BIG_PROMPT, TokenizerService


def test_big_prompts_are_built_one_per_turn_of_the_loop_and_small_ones_at_once() -> None:
    async def run() -> tuple[list[tuple[str, int]], int]:
        turn = 0
        ticking = True

        def tick() -> None:  # counts the loop's turns
            nonlocal turn
            turn += 1
            if ticking:
                asyncio.get_running_loop().call_soon(tick)

        built: list[tuple[str, int]] = []

        def prompt(parsed: Parsed, media: Any) -> str:
            built.append((parsed.prompt, turn))
            return parsed.prompt

        service = SimpleNamespace(_one_big_prompt_at_a_time=asyncio.Lock(), _prompt=prompt)
        asyncio.get_running_loop().call_soon(tick)
        await asyncio.sleep(0)
        sizes = {"big": BIG_PROMPT + 1, "small": BIG_PROMPT}
        asks = [f"{kind}{i}" for i in range(4) for kind in sizes]
        got = await asyncio.gather(
            *(TokenizerService._built(service, Parsed(a, None, [], size=sizes[a[:-1]]), []) for a in asks)  # type: ignore[arg-type]
        )
        ticking = False
        assert got == asks  # each its own prompt
        return built, turn

    built, _ = asyncio.run(run())
    big = [t for name, t in built if name.startswith("big")]
    small = [t for name, t in built if name.startswith("small")]
    assert len(set(big)) == 4, built  # never two big builds in one turn
    assert len(set(small)) == 1, built  # the small ones, at once in the first turn
    assert min(big) == small[0]  # the first big one as soon as it comes


def test_a_request_s_own_chat_template_renders_off_the_loop_and_tokenizes_on_it() -> None:
    """A conversation with the request's own template (which may loop as
    long as it likes) is rendered on a thread, the loop free meanwhile, and
    tokenized on the loop (the tokenizer is not shared between threads);
    one with the server's template is built on the loop, as any prompt."""
    from tokenizer_svc.conversation import Turn
    from tokenizer_svc.prompt import Rendered

    async def run(template: str | None) -> dict[str, bool]:
        loop_thread = threading.current_thread()
        on_loop: dict[str, bool] = {}
        rendered = Rendered("text", [])

        def render_chat(*args: Any, **kwargs: Any) -> Rendered:
            on_loop["render"] = threading.current_thread() is loop_thread
            return rendered

        def tokenize_chat(got: Rendered, media: Any) -> str:
            assert got is rendered
            on_loop["tokenize"] = threading.current_thread() is loop_thread
            return "built"

        service = SimpleNamespace(
            prompts=SimpleNamespace(render_chat=render_chat, tokenize_chat=tokenize_chat),
            _one_big_prompt_at_a_time=asyncio.Lock(),
        )
        service._rendered = lambda parsed, media: TokenizerService._rendered(service, parsed, media)  # type: ignore[arg-type]
        service._prompt = lambda parsed, media: TokenizerService._prompt(service, parsed, media)  # type: ignore[arg-type]
        parsed = Parsed("", [Turn("user", (("text", "hi"),))], [], chat_template=template)
        assert await TokenizerService._built(service, parsed, []) == "built"  # type: ignore[arg-type]
        return on_loop

    assert asyncio.run(run("{{ messages }}")) == {"render": False, "tokenize": True}
    assert asyncio.run(run(None)) == {"render": True, "tokenize": True}


def test_a_big_body_is_read_off_the_event_loop() -> None:
    async def where(big: bool) -> bool:
        loop_thread = threading.get_ident()
        return await _Body({}, big).read(lambda: threading.get_ident() != loop_thread)

    assert asyncio.run(where(True))
    assert not asyncio.run(where(False))


def test_detokenize_takes_at_most_a_prompt_s_ids() -> None:
    assert openai_api.parse_detokenize({"tokens": [1] * 10}, max_ids=10) == [1] * 10
    with pytest.raises(InvalidRequest, match="tokens has 11 ids, at most 10"):
        openai_api.parse_detokenize({"tokens": [1] * 11}, max_ids=10)


def test_a_client_that_sends_half_a_request_is_cut_off_and_others_are_served() -> None:
    """--http-request-timeout-s: headers that never end, or an idle
    connection, are closed; a body that never ends is a 408 (Request
    Timeout) saying why;
    meanwhile a whole request is answered."""
    from tokenizer_svc.http_api import HttpApi, start

    async def run() -> tuple[bytes, bytes, bytes, int]:
        api = HttpApi(None, model="m", ready=lambda: True, max_body_bytes=1 << 20, request_timeout_s=1.0)  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        try:
            opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            (headless, w1), (bodiless, w2), (idle, _) = opened
            w1.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
            w2.write(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model"')
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            health = int((await reader.readline()).split()[1])
            # Each waits for the server to act (well past the 1 s), not for a time.
            read = [
                asyncio.wait_for(headless.read(), 30),
                asyncio.wait_for(bodiless.readuntil(b"(--http-request-timeout-s)"), 30),  # then it lingers
                asyncio.wait_for(idle.read(), 30),
            ]
            first, second, third = await asyncio.gather(*read)
            for _, w in [*opened, (reader, writer)]:
                w.close()
            return first, second, third, health
        finally:
            await runner.cleanup()

    headless, bodiless, idle, health = asyncio.run(run())
    assert health == 200
    assert headless == b""  # closed, nothing said
    assert idle == b""
    assert bodiless.startswith(b"HTTP/1.1 408")
    assert b"did not arrive within 1 s (--http-request-timeout-s)" in bodiless
