"""A request cancelled while one of the tokenizer's threads writes its item
into shared memory (`TokenizerService._off_loop`): the thread cannot be
stopped, so what it wrote must be released when it ends, not kept by
nobody. The cache's hits take that path (`_materialize`: the cached bytes
written into the slab, or a segment of their own with the slab off).

The service here is the real one around a stand-in pool and media loader
(nothing else is on this path), and its `_materialize` is held up after it
has written, so that the cancel lands inside the thread's run every time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tests.support.leaks import PROJECT_PREFIX, project_segments, wait_until
from tokenizer_svc.conversation import Located
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.preprocess import ItemResult, ItemTensor, Job
from tokenizer_svc.server import _load_processor
from tokenizer_svc.service import TokenizerService
from tokenizer_svc.settings import TokenizerSettings

PIXELS = np.arange(3 * 64 * 64, dtype=np.float32).reshape(1, 3, 64, 64)
# Well under the writer's hand-off timeout (60 s), which would let the
# slice go in the end even if nobody released it.
RELEASED_WITHIN_S = 5.0


class Media:
    async def load(self, medium: Any) -> bytes:
        return b"the same image every time"


class Pool:
    """Answers every job with the same item, its pixels inline (what the
    cache keeps)."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []

    async def preprocess(self, job: Job, *, timeout_s: float, request_id: str) -> ItemResult:
        self.jobs.append(job)
        pixels = ItemTensor("pixel_values", "float32", PIXELS.shape, PIXELS.nbytes, inline=PIXELS.tobytes())
        return ItemResult(common_pb2.MODALITY_IMAGE, (pixels,), tokens=4, content_hash=b"", width=64, height=64)


def service_for(tiny_model: Path, slab_bytes: int) -> tuple[TokenizerService, Pool]:
    settings = TokenizerSettings(model_dir=tiny_model, shm_prefix=PROJECT_PREFIX, shm_slab_bytes=slab_bytes)
    family, tokenizer, template = _load_processor(settings)
    pool = Pool()
    service = TokenizerService(settings, family, tokenizer, Media(), pool, None, chat_template=template)  # type: ignore[arg-type]
    return service, pool


class HeldUp:
    """`service._materialize`, made to wait after it has written until
    told to go on; what it returned."""

    def __init__(self, service: TokenizerService) -> None:
        self.written, self.go_on = threading.Event(), threading.Event()
        self.returned: list[ItemResult] = []
        self._real = service._materialize
        service._materialize = self  # type: ignore[method-assign]

    def __call__(self, *args: Any) -> ItemResult:
        result = self._real(*args)
        self.written.set()
        self.go_on.wait(30)
        self.returned.append(result)
        return result


async def cancelled_while_written(service: TokenizerService, pool: Pool) -> ItemResult:
    """One request fills the cache; the next hits it and is cancelled while
    its thread has written the item; what that thread wrote."""
    image = tokenizer_pb2.Image(url="file:///image.jpg")
    first = await service._one(image, "first", common_pb2.TRANSPORT_SHM)
    assert len(pool.jobs) == 1
    assert not first.claims  # pixels inline: nothing in shared memory yet
    held = HeldUp(service)
    request = asyncio.create_task(service._one(image, "second", common_pb2.TRANSPORT_SHM))
    assert await asyncio.to_thread(held.written.wait, 30), "the cache hit never wrote its item"
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert len(pool.jobs) == 1, "the second request was not a cache hit"
    held.go_on.set()
    assert await asyncio.to_thread(lambda: wait_until(lambda: bool(held.returned), timeout=30))
    return held.returned[0]


def test_a_slab_slice_written_for_a_cancelled_request_is_released(tiny_model: Path) -> None:
    async def main() -> None:
        service, pool = service_for(tiny_model, 16 << 20)
        try:
            item = await cancelled_while_written(service, pool)
            assert service.slab is not None
            (pixels,) = item.slab_slices  # the cached bytes went into the slab
            assert pixels.segment == service.slab.name
            owned = service.slab
            gone = await asyncio.to_thread(lambda: wait_until(lambda: owned.used_bytes() == 0, RELEASED_WITHIN_S))
            assert gone, f"{owned.used_bytes()} bytes of the slab stayed held after the request was cancelled"
        finally:
            await service.close_pools()

    asyncio.run(main())


def test_a_segment_written_for_a_cancelled_request_is_removed(tiny_model: Path) -> None:
    async def main() -> None:
        service, pool = service_for(tiny_model, 0)  # no slab: a segment per tensor
        try:
            item = await cancelled_while_written(service, pool)
            (segment,) = item.segments
            gone = await asyncio.to_thread(lambda: wait_until(lambda: not project_segments(), RELEASED_WITHIN_S))
            assert gone, f"{project_segments()} stayed in /dev/shm after the request was cancelled"
            assert segment not in project_segments()
        finally:
            await service.close_pools()

    asyncio.run(main())


def test_the_item_of_a_request_that_was_not_cancelled_is_held_for_hand_over(tiny_model: Path) -> None:
    """The other side of the above: the same hit, not cancelled, is held by
    this process (its lock taken) until it is handed over or let go."""

    async def main() -> None:
        service, pool = service_for(tiny_model, 16 << 20)
        try:
            image = tokenizer_pb2.Image(url="file:///image.jpg")
            await service._one(image, "first", common_pb2.TRANSPORT_SHM)
            prepared = await service._one(image, "second", common_pb2.TRANSPORT_SHM)
            assert len(pool.jobs) == 1
            assert service.slab is not None
            assert service.slab.used_bytes() > 0
            assert [piece for piece, _ in prepared.claims] == prepared.result.slab_slices
            prepared.release()
            owned = service.slab
            assert await asyncio.to_thread(lambda: wait_until(lambda: owned.used_bytes() == 0, RELEASED_WITHIN_S))
        finally:
            await service.close_pools()

    asyncio.run(main())


class Siblings(Media):
    """Media whose loads the test orders: "bad" fails once "go" is set;
    "slow" waits for it too and, when cancelled, takes until "unwound" to
    wind down (as a fetch or a worker's task does)."""

    def __init__(self) -> None:
        self.go, self.unwound, self.winding = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def load(self, medium: Any) -> bytes:
        if medium.url.endswith("bad.jpg"):
            await self.go.wait()
            raise InvalidRequest("not an image")
        if medium.url.endswith("slow.jpg"):
            try:
                await self.go.wait()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.winding.set()
                await self.unwound.wait()
                raise
        return await super().load(medium)


def test_a_ready_sibling_is_released_when_the_request_is_cancelled_while_the_others_wind_down(
    tiny_model: Path,
) -> None:
    """One image ready and held, a sibling fails, and the client leaves while
    a third is still winding down: the ready one's slice is released all the
    same (the cancel storm's slice held forever, issue 38)."""

    async def main() -> None:
        service, _ = service_for(tiny_model, 16 << 20)
        media = Siblings()
        service.media = media  # type: ignore[assignment]
        try:
            ready = tokenizer_pb2.Image(url="file:///image.jpg")
            await service._one(ready, "warm", common_pb2.TRANSPORT_SHM)  # the next is a cache hit: a slab slice
            located = [Located(tokenizer_pb2.Image(url=f"file:///{name}.jpg"), f"images[{i}]")
                       for i, name in enumerate(["image", "bad", "slow"])]  # fmt: skip
            request = asyncio.create_task(service._prepare_media(located, "r", common_pb2.TRANSPORT_SHM))
            assert service.slab is not None
            owned = service.slab
            assert await asyncio.to_thread(lambda: wait_until(lambda: owned.used_bytes() > 0, 30))
            media.go.set()  # "bad" fails; the request cancels "slow" and waits for it
            await asyncio.wait_for(media.winding.wait(), 30)
            request.cancel()  # the client leaves meanwhile
            media.unwound.set()
            with pytest.raises(asyncio.CancelledError):
                await request
            gone = await asyncio.to_thread(lambda: wait_until(lambda: owned.used_bytes() == 0, RELEASED_WITHIN_S))
            assert gone, f"{owned.used_bytes()} bytes of the slab stayed held after the request was cancelled"
        finally:
            await service.close_pools()

    asyncio.run(main())
