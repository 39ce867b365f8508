"""Driving a scheduler `Engine` in the test process: a group of one, a
reader of inline tensors, and plans made the way the step loop makes them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff.reference import TensorSpec
from mmsplit_server.sampling import Sampling
from scheduler_svc.plan import Item, NewRequest
from scheduler_svc.reader import SharedMemoryReader

IMAGE_SHAPE = (1, 3, 224, 224)
# The tiny LLaVA's image token (the first token added to the tokenizer).
IMAGE_TOKEN_ID = 32000


class SoloGroup:
    """A process group of one rank: every collective is the identity."""

    rank = 0
    world_size = 1

    def broadcast_from_0(self, obj: Any) -> Any:
        return obj

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        return row[None]

    def gather_to_0(self, obj: Any) -> list[Any]:
        return [obj]


class InlineReader(SharedMemoryReader):
    """The services' reader, given inline tensors only (what these tests
    send): it lends their bytes in place, read-only, as it does in service.
    Counts the steps it was told ended."""

    def __init__(self) -> None:
        super().__init__(rank=0, prefix="mmsplittest", max_bytes=1 << 30)
        self.steps_ended = 0

    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        assert spec.inline is not None
        return super().read(request_id, spec)

    def end_step(self) -> None:
        self.steps_ended += 1
        super().end_step()


def pixels(seed: int, *, fill: float | None = None) -> TensorSpec:
    array = np.random.default_rng(seed).standard_normal(IMAGE_SHAPE, dtype=np.float32)
    if fill is not None:
        array[:] = fill
    return TensorSpec(common_pb2.DTYPE_FLOAT32, IMAGE_SHAPE, inline=array.tobytes())


def request(rid: str, ids: list[int], images: list[TensorSpec] | None = None, **sampling: Any) -> NewRequest:
    """A tiny-LLaVA request: each image fills the next equal share of the
    image tokens in `ids` (one run each)."""
    params = Sampling(**{"max_tokens": 16, **sampling})
    images = images or []
    positions = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    share = len(positions) // len(images) if images else 0
    items = tuple(
        Item(common_pb2.MODALITY_IMAGE, (("pixel_values", spec),), {}, ((positions[k * share], share),))
        for k, spec in enumerate(images)
    )
    return NewRequest(rid, tuple(ids), items, params)
