"""What the services must match: the same requests run in this process by the
plain transformers model with `generate` (greedy), no tensor parallelism, no
services, the model's own image processor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Ask:
    prompt: str
    images: tuple[bytes, ...]
    max_tokens: int


def greedy(model_dir: Path, asks: list[Ask]) -> list[list[int]]:
    from tests.support import hf_family, hf_loaded
    from tokenizer_svc.decode import decode_image

    processor, model = hf_family.processor(model_dir), hf_loaded.model(model_dir)
    out = []
    with torch.inference_mode():
        for ask in asks:
            images = [decode_image(b, max_pixels=10**8) for b in ask.images]
            extra = hf_family.inputs(processor, ask.prompt, images)
            ids = extra.pop("input_ids")
            extra.pop("attention_mask")
            made = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=ask.max_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
            out.append([int(t) for t in made[0, ids.shape[1] :]])
    return out
