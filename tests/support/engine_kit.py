"""Driving a scheduler `Engine` in the test process: a group of one, a
reader of inline tensors, and plans made the way the step loop makes them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff.reference import TensorSpec
from mmsplit_server.sampling import Sampling
from scheduler_svc.engine import Engine
from scheduler_svc.plan import Item, NewRequest, Plan
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


def solo_engine(model: torch.nn.Module, **settings: Any) -> Engine:
    """An engine of a group of one on the CPU, over inline tensors, with
    `settings` (Engine's keyword arguments) and the model's EOS."""
    eos = frozenset([int(model.config.text_config.eos_token_id)])  # type: ignore[union-attr,arg-type]
    return Engine(
        model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=eos, token_chunk=32, **settings
    )


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


def reference(model: torch.nn.Module, req: NewRequest) -> list[int]:
    """Greedy by full recomputation, stopping at EOS like the scheduler."""
    eos = model.config.text_config.eos_token_id
    seq = list(req.input_ids)
    images = [torch.frombuffer(bytearray(s.inline or b""), dtype=torch.float32).reshape(s.shape) for s in req.specs]
    extra = {"pixel_values": torch.cat(images)} if images else {}
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < req.sampling.max_tokens:
            token = int(model(input_ids=torch.tensor([seq]), **extra).logits[0, -1].argmax())  # type: ignore[operator]
            out.append(token)
            if token == eos:
                break
            seq.append(token)
    return out


def drive(
    engine: Engine, arrivals: dict[int, list[NewRequest]], eos: int, cached: dict[str, int] | None = None
) -> dict[str, list[int] | str]:
    """Run plans the way the step loop makes them: joins at their step,
    each running request fed its last token, finished or failed ones dropped
    in the next plan (the finished ones kept by the prefix cache). Returns
    each request's tokens, or its error (a running row ended by a failed
    decode: "ended:<code>"); `cached` gets each joiner's prompt
    tokens taken from the prefix cache."""
    results: dict[str, list[int] | str] = {}
    limits: dict[str, int] = {}
    feeds: dict[str, int] = {}
    drop: list[str] = []
    keep: list[str] = []
    step = 0
    while step <= max(arrivals) or feeds or drop or engine.prefilling:
        new = tuple(arrivals.get(step, ()))
        limits.update({r.request_id: r.sampling.max_tokens for r in new})
        plan = Plan(step=step, new=new, drop=tuple(drop), feed=tuple(feeds.items()), keep=tuple(keep))
        outcome = engine.step(plan)
        if cached is not None:
            cached.update(outcome.cached)
        drop, feeds, keep = [], {}, []
        for rid, failure in outcome.failed.items():
            results[rid] = f"failed:{failure.code}"
        for rid, why in outcome.rejected.items():
            results[rid] = f"rejected:{why}"
            drop.append(rid)
        for rid, failure in outcome.ended.items():
            results[rid] = f"ended:{failure.code}"
            drop.append(rid)
        for rid, token in outcome.sampled.items():
            made = results.setdefault(rid, [])
            assert isinstance(made, list)
            made.append(token)
            if token == eos or len(made) >= limits[rid]:
                drop.append(rid)
                keep.append(rid)
            else:
                feeds[rid] = token
        step += 1
    assert not engine.rows, "every request left"
    return results


def image_prompt(model: torch.nn.Module, n_images: int, text: list[int]) -> list[int]:
    return [1, *([model.config.image_token_id] * 64 * n_images), *text]
