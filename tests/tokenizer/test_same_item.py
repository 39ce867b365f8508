"""One item brought by several requests while it is being preprocessed
(`TokenizerService._one`): the workers preprocess it once and the others
take the cache's copy; if the one preprocessing it is cancelled, or fails,
the others go on by themselves and nothing is left held.

The service here is the real one around a stand-in pool (whose work waits
until the test lets it finish) and media loader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tests.support.cycles import uncollected
from tests.tokenizer.test_abandoned import Media
from tokenizer_svc.conversation import Located
from tokenizer_svc.errors import MediaDecodeFailed
from tokenizer_svc.preprocess import ItemResult, ItemTensor, Job
from tokenizer_svc.server import _load_processor
from tokenizer_svc.service import TokenizerService, merged
from tokenizer_svc.settings import TokenizerSettings

PIXELS = np.arange(3 * 64 * 64, dtype=np.float32).reshape(1, 3, 64, 64)
IMAGE = tokenizer_pb2.Image(url="file:///image.jpg")


class GatedPool:
    """Answers a job once `go` is set (or fails it, `fail`), counting jobs."""

    def __init__(self) -> None:
        self.jobs = 0
        self.running = self.most_at_once = 0
        self.started = asyncio.Event()
        self.go = asyncio.Event()
        self.fail = False

    async def preprocess(self, job: Job, *, timeout_s: float, request_id: str) -> ItemResult:
        self.jobs += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.started.set()
        try:
            await self.go.wait()
            await asyncio.sleep(0)  # the others that would run at once have started by now
        finally:
            self.running -= 1
        if self.fail:
            raise MediaDecodeFailed("image could not be decoded")
        pixels = ItemTensor("pixel_values", "float32", PIXELS.shape, PIXELS.nbytes, inline=PIXELS.tobytes())
        return ItemResult(common_pb2.MODALITY_IMAGE, (pixels,), tokens=4, content_hash=b"", width=64, height=64)


def service_for(tiny_model: Path, cache_bytes: int | None = None) -> tuple[TokenizerService, GatedPool]:
    more = {} if cache_bytes is None else {"preprocess_cache_bytes": cache_bytes}
    settings = TokenizerSettings(model_dir=tiny_model, shm_slab_bytes=0, **more)
    family, tokenizer, template = _load_processor(settings)
    pool = GatedPool()
    service = TokenizerService(settings, family, tokenizer, Media(), pool, None, chat_template=template)  # type: ignore[arg-type]
    return service, pool


async def requests(service: TokenizerService, n: int) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.create_task(service._one(IMAGE, f"r{i}", common_pb2.TRANSPORT_INLINE)) for i in range(n)]
    await asyncio.sleep(0)  # each reaches its key, the first its job
    return tasks


def run(
    tiny_model: Path, body: Callable[[TokenizerService, GatedPool], Awaitable[None]], cache_bytes: int | None = None
) -> None:
    """`body` on a new service, whose pools are closed after; nothing is left under way."""

    async def main() -> None:
        service, pool = service_for(tiny_model, cache_bytes)
        try:
            await body(service, pool)
            assert not service._under_way
        finally:
            await service.close_pools()

    asyncio.run(main())


def test_requests_that_bring_one_item_together_preprocess_it_once(tiny_model: Path) -> None:
    async def body(service: TokenizerService, pool: GatedPool) -> None:
        tasks = await requests(service, 4)
        await pool.started.wait()
        pool.go.set()
        items = await asyncio.gather(*tasks)
        assert pool.jobs == 1
        assert all(item.result.tensors[0].inline == PIXELS.tobytes() for item in items)

    run(tiny_model, body)


def test_when_the_one_preprocessing_it_is_cancelled_the_others_go_on(tiny_model: Path) -> None:
    async def body(service: TokenizerService, pool: GatedPool) -> None:
        first, *others = await requests(service, 3)
        await pool.started.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        pool.go.set()
        items = await asyncio.gather(*others)
        assert pool.jobs == 2, "one of the others preprocessed it, the last took its copy"
        assert len(items) == 2

    run(tiny_model, body)


def test_when_preprocessing_it_fails_each_tries_and_fails_alike(tiny_model: Path) -> None:
    async def body(service: TokenizerService, pool: GatedPool) -> None:
        pool.fail = True
        pool.go.set()
        outcomes = await asyncio.gather(*await requests(service, 3), return_exceptions=True)
        assert all(isinstance(o, MediaDecodeFailed) for o in outcomes), outcomes
        assert pool.jobs == 3, "failures are not cached: each tried it, one after the other"

    run(tiny_model, body)


def test_an_item_the_cache_cannot_keep_is_waited_for_once_then_made_by_each_at_once(tiny_model: Path) -> None:
    """An item larger than the whole cache is made but not kept: the
    requests that waited for it then each make it at the same time, not one
    after another (that would add a preprocessing to each one's wait)."""

    async def body(service: TokenizerService, pool: GatedPool) -> None:
        tasks = await requests(service, 3)
        await pool.started.wait()
        pool.go.set()
        items = await asyncio.gather(*tasks)
        assert pool.jobs == 3
        assert pool.most_at_once == 2, "the two that waited made it together"
        assert all(item.result.tensors[0].inline == PIXELS.tobytes() for item in items)

    run(tiny_model, body, cache_bytes=PIXELS.nbytes // 2)


def _cycles_after(fail: Callable[[], Awaitable[None]]) -> list[str]:
    """The exceptions and frames only a collection could free once `fail`
    raised and its exception was let go (reference counting frees the
    rest), collected while the event loop still runs (its own objects are
    not garbage then)."""

    async def main() -> list[str]:
        with uncollected() as found:
            with pytest.raises(MmsplitError):
                await fail()
            for _ in range(3):  # what was cancelled winds down
                await asyncio.sleep(0)
        return found

    return asyncio.run(main())


def test_a_failed_request_s_frames_are_freed_without_waiting_for_a_collection(tiny_model: Path) -> None:
    """A failure raised from a frame that holds the task it came from (as
    `await asyncio.gather(*tasks)` and `task.result()` do) is a reference
    cycle: the failure's traceback holds the frame, the frame the task, the
    task the failure. It kept every frame of the request alive, their locals
    with them (a 9 MB data: URL a few times over), until a full collection:
    a tokenizer that had answered 48 such requests held ~1 GB more than at
    rest. The media's and the request's own tasks let go of theirs."""
    service, pool = service_for(tiny_model)
    pool.fail = True
    pool.go.set()

    async def media() -> None:
        try:
            await service._prepare_media([Located(IMAGE, "images[0]")], "r", common_pb2.TRANSPORT_INLINE)
        finally:
            await service.close_pools()

    async def failing() -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
        yield tokenizer_pb2.GenerateResponse()
        raise MediaDecodeFailed("image could not be decoded")

    async def own_task() -> None:
        async for _ in service._run_in_own_task(failing()):
            pass

    async def choices() -> None:  # a request's n choices, one of which fails (`merged`)
        async def fine() -> AsyncGenerator[tokenizer_pb2.GenerateResponse, None]:
            yield tokenizer_pb2.GenerateResponse()
            await asyncio.Event().wait()  # until cancelled
            yield tokenizer_pb2.GenerateResponse()

        async with contextlib.aclosing(merged([fine(), failing()])) as responses:
            async for _ in responses:
                pass

    assert _cycles_after(media) == []
    assert _cycles_after(own_task) == []
    assert _cycles_after(choices) == []
