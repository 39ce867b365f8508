"""Rank 0's stream of a request's events (`scheduler_svc.frontend.responses`):
one Tokens message per step while the receiver keeps up, and the tokens
that queued up meanwhile in one message when it falls behind."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.errors import InvalidTensorRef
from scheduler_svc.frontend import responses
from scheduler_svc.loop import Event, Failed, Finished, Token


def kinds(messages: list[object]) -> list[str]:
    return [m.WhichOneof("event") for m in messages]  # type: ignore[attr-defined]


def test_a_receiver_that_keeps_up_gets_a_message_per_token() -> None:
    async def scenario() -> list[object]:
        events: asyncio.Queue[Event] = asyncio.Queue()
        stream = responses(events)
        got = []
        for token in (5, 6, 7):
            events.put_nowait(Token(token))
            got.append(await anext(stream))
        events.put_nowait(Finished(reason=1, prompt_tokens=3, completion_tokens=3))
        got += [m async for m in stream]
        return got

    got = asyncio.run(scenario())
    assert kinds(got) == ["tokens", "tokens", "tokens", "finished"]
    assert [list(m.tokens.token_ids) for m in got[:3]] == [[5], [6], [7]]  # type: ignore[attr-defined]


def test_tokens_that_queued_up_go_in_one_message_and_the_end_follows() -> None:
    async def scenario() -> list[object]:
        events: asyncio.Queue[Event] = asyncio.Queue()
        for token in (5, 6, 7, 8):
            events.put_nowait(Token(token))
        events.put_nowait(Finished(reason=1, prompt_tokens=3, completion_tokens=4))
        return [m async for m in responses(events)]

    got = asyncio.run(scenario())
    assert kinds(got) == ["tokens", "finished"]
    assert list(got[0].tokens.token_ids) == [5, 6, 7, 8]  # type: ignore[attr-defined]
    assert got[1].finished.completion_tokens == 4  # type: ignore[attr-defined]


def test_a_failure_after_queued_tokens_sends_the_tokens_then_raises() -> None:
    async def scenario() -> list[object]:
        events: asyncio.Queue[Event] = asyncio.Queue()
        events.put_nowait(Token(5))
        events.put_nowait(Token(6))
        events.put_nowait(Failed(InvalidTensorRef("gone")))
        stream = responses(events)
        got = [await anext(stream)]
        with pytest.raises(InvalidTensorRef, match="gone"):
            await anext(stream)
        return got

    got = asyncio.run(scenario())
    assert kinds(got) == ["tokens"]
    assert list(got[0].tokens.token_ids) == [5, 6]  # type: ignore[attr-defined]


def test_an_interval_sends_the_first_token_at_once_then_every_n_and_the_rest_at_the_end() -> None:
    async def scenario() -> list[object]:
        events: asyncio.Queue[Event] = asyncio.Queue(maxsize=1)
        stream = responses(events, interval=3)
        got: list[object] = []

        async def produce() -> None:
            for token in range(8):  # one per step: room for one, so never two queued
                await events.put(Token(token))
            await events.put(Finished(reason=1, prompt_tokens=3, completion_tokens=8))

        producer = asyncio.create_task(produce())
        got.append(await anext(stream))
        assert not producer.done(), "the first token waited for others"
        got += [m async for m in stream]
        await producer
        return got

    got = asyncio.run(scenario())
    assert kinds(got) == ["tokens", "tokens", "tokens", "tokens", "finished"]
    assert [list(m.tokens.token_ids) for m in got[:4]] == [[0], [1, 2, 3], [4, 5, 6], [7]]  # type: ignore[attr-defined]
