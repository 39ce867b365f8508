"""A request that falls behind its tokens catches up a message at a time:
tokens that queued up while its last ones were relayed go on joined, both
from the scheduler's stream (`tokenizer_svc.multiplex`) and to the client
(`TokenizerService._run_in_own_task`), with nothing lost, reordered or
joined across a choice or past the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tests.tokenizer.test_abandoned import service_for
from tokenizer_svc.multiplex import DEADLINE, CallEnded, _Call
from tokenizer_svc.service import joined_deltas


class FakeCall:
    """A `GenerateStream` call: the test sends the scheduler's messages,
    the call records what the tokenizer wrote."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[scheduler_pb2.GenerateStreamResponse | None] = asyncio.Queue()
        self.written: list[scheduler_pb2.GenerateStreamRequest] = []

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> scheduler_pb2.GenerateStreamResponse:
        message = await self.incoming.get()
        if message is None:
            raise StopAsyncIteration
        return message

    async def write(self, message: scheduler_pb2.GenerateStreamRequest) -> None:
        self.written.append(message)

    def cancel(self) -> None:
        self.incoming.put_nowait(None)


def tokens(rid: str, *ids: int) -> scheduler_pb2.RequestEvent:
    logprobs = [common_pb2.TokenLogprob(logprob=-float(i)) for i in ids]
    return scheduler_pb2.RequestEvent(request_id=rid, tokens=scheduler_pb2.Tokens(token_ids=ids, logprobs=logprobs))


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


async def opened(*events: scheduler_pb2.RequestEvent) -> tuple[FakeCall, _Call, AsyncGenerator, asyncio.Future]:  # type: ignore[type-arg]
    """A call with request "r" on it, its first read awaited, and `events`
    sent by the scheduler in one message."""
    fake = FakeCall()
    call = _Call(fake)  # type: ignore[arg-type]
    gen = call.generate(scheduler_pb2.GenerateRequest(request_id="r", input_ids=[1]), None)
    first = asyncio.ensure_future(anext(gen))
    await until(lambda: fake.written, "the request was sent")
    fake.incoming.put_nowait(scheduler_pb2.GenerateStreamResponse(events=events))
    return fake, call, gen, first


async def closed(call: _Call) -> None:
    call.close()
    await asyncio.gather(call._reader, call._writer, return_exceptions=True)


def run_call(events: list[scheduler_pb2.RequestEvent]) -> list[object]:
    """What `_Call.generate` yields (or raises, last) for request "r" when
    every one of `events` has arrived before it reads the first after
    Accepted."""

    async def main() -> list[object]:
        fake, call, gen, first = await opened(
            scheduler_pb2.RequestEvent(request_id="r", accepted=scheduler_pb2.Accepted())
        )
        out: list[object] = [await first]
        fake.incoming.put_nowait(scheduler_pb2.GenerateStreamResponse(events=events))
        await until(lambda: call.routes["r"].qsize() == len(events), "every event was routed")
        try:
            async for response in gen:
                out.append(response)
        except Exception as exc:
            out.append(exc)
        await closed(call)
        return out

    return asyncio.run(main())


def test_tokens_queued_behind_each_other_come_as_one_response_in_order() -> None:
    finished = scheduler_pb2.RequestEvent(
        request_id="r", finished=scheduler_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    )
    out = run_call([tokens("r", 5), tokens("r", 6, 7), tokens("r", 8), finished])
    assert [r.WhichOneof("event") for r in out] == ["accepted", "tokens", "finished"]  # type: ignore[attr-defined]
    joined = out[1].tokens  # type: ignore[attr-defined]
    assert list(joined.token_ids) == [5, 6, 7, 8]
    assert [lp.logprob for lp in joined.logprobs] == [-5.0, -6.0, -7.0, -8.0]


def test_a_failure_after_queued_tokens_is_raised_after_them() -> None:
    failed = scheduler_pb2.RequestEvent(
        request_id="r", failed=scheduler_pb2.RequestFailed(reason="INTERNAL", message="rank 1 died")
    )
    out = run_call([tokens("r", 5), tokens("r", 6), failed, tokens("r", 99)])
    assert list(out[1].tokens.token_ids) == [5, 6]  # type: ignore[attr-defined]
    assert isinstance(out[2], RemoteError)
    assert "rank 1 died" in str(out[2])
    assert len(out) == 3  # nothing after the failure


def test_a_call_ending_after_queued_tokens_ends_the_request_after_them() -> None:
    async def main() -> list[object]:
        fake, call, gen, first = await opened(tokens("r", 1), tokens("r", 2))
        fake.incoming.put_nowait(None)  # the scheduler ends the call
        await until(lambda: call.ended is not None, "the call ended")
        out: list[object] = [await first]
        with pytest.raises(CallEnded) as ended:
            await anext(gen)
        out.append(ended.value)
        return out

    out = asyncio.run(main())
    assert list(out[0].tokens.token_ids) == [1, 2]  # type: ignore[attr-defined]
    assert "ended the stream" in str(out[1])


def delta(text: str, *ids: int, index: int = 0) -> tokenizer_pb2.GenerateResponse:
    logprobs = [common_pb2.TokenLogprob(logprob=-float(i)) for i in ids]
    return tokenizer_pb2.GenerateResponse(
        request_id="r", index=index, delta=tokenizer_pb2.TextDelta(text=text, token_ids=ids, logprobs=logprobs)
    )


def finished() -> tokenizer_pb2.GenerateResponse:
    return tokenizer_pb2.GenerateResponse(
        request_id="r", finished=tokenizer_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP)
    )


def test_joined_deltas_join_runs_of_one_choice_and_never_past_the_end() -> None:
    items = [delta("He", 1), delta("", 2), delta("llo", 3), delta("A", 9, index=1), delta("!", 4), finished(), None]
    out = joined_deltas(items)
    assert [(r.index, r.delta.text, list(r.delta.token_ids)) for r in out[:3]] == [  # type: ignore[union-attr]
        (0, "Hello", [1, 2, 3]),
        (1, "A", [9]),
        (0, "!", [4]),
    ]
    assert [lp.logprob for lp in out[0].delta.logprobs] == [-1.0, -2.0, -3.0]  # type: ignore[union-attr]
    assert out[3].HasField("finished")  # type: ignore[union-attr]
    assert out[4] is None
    assert joined_deltas([None]) == [None]


def test_a_client_behind_its_tokens_gets_them_joined_and_every_one(tiny_model: Path) -> None:
    service, _ = service_for(tiny_model, slab_bytes=0)

    async def source() -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        for i in range(10):
            yield delta(f"<{i}>", i)
        yield finished()

    async def main() -> list[tokenizer_pb2.GenerateResponse]:
        relay = service._run_in_own_task(source())
        first = await anext(relay)
        # The client is busy while the whole request is made.
        await until(lambda: all(t.done() for t in service.tasks), "the request's work ended")
        return [first, *[r async for r in relay]]

    out = asyncio.run(main())
    text = "".join(r.delta.text for r in out)
    ids = [t for r in out for t in r.delta.token_ids]
    assert text == "".join(f"<{i}>" for i in range(10))
    assert ids == list(range(10))
    assert len(out) <= 3
    assert out[-1].HasField("finished")


def test_a_deadline_that_passes_behind_queued_tokens_is_raised_after_them() -> None:
    async def main() -> list[object]:
        fake, call, gen, first = await opened(tokens("r", 1), tokens("r", 2))
        await until(lambda: call.routes["r"].qsize() == 2, "both were routed")
        call.routes["r"].put_nowait(DEADLINE)  # as the request's timer does
        out: list[object] = [await first]
        with pytest.raises(RemoteError) as late:
            await anext(gen)
        out.append(late.value)
        await until(lambda: len(fake.written) == 2, "the cancel was sent")
        out.append(fake.written[1])
        await closed(call)
        return out

    joined, late, cancel = asyncio.run(main())
    assert list(joined.tokens.token_ids) == [1, 2]  # type: ignore[attr-defined]
    assert late.error_code == E.ERROR_CODE_DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert cancel.cancel.request_id == "r"  # type: ignore[attr-defined]
