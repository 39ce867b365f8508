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
