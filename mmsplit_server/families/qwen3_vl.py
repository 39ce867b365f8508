"""Qwen3-VL: Qwen2.5-VL's items and M-RoPE, and DeepStack.

Items are Qwen2-VL's (flattened patches of 16 pixels and a (t, h, w)
grid; an item fills ``t*h*w / merge²`` placeholders between vision start
and end) and positions come from the model's own `get_rope_index`, as in
`qwen2_vl`. What differs is the encoder's output: besides the merged
patches it hands the language model, the vision tower gives DeepStack
features from some of its layers (`vision_config.deepstack_visual_indexes`),
which the first layers of the language model add at the item's
placeholders. An item's encoder output, as the scheduler caches and slices
it, is therefore ``[placeholders, (1 + levels) * hidden]``: the merged
patches, then each level's features, side by side (`encoded_width`); a
chunk of a long prompt takes the rows of its placeholders from all of them.

Videos are not taken yet: Qwen3-VL's processor writes a timestamp before
each frame's run (``<t seconds><|vision_start|>...<|vision_end|>``), so
a video is several runs, which the prompt builder does not make.
"""

from __future__ import annotations

from typing import Any

from mmsplit_server.families.base import IMAGE, Family, Placeholders
from mmsplit_server.families.qwen2_vl import QwenVL

MODEL_TYPES = ("qwen3_vl",)


class Qwen3VL(QwenVL):
    patch_default = 16

    @property
    def levels(self) -> int:
        """DeepStack's levels: the vision layers whose features join the text model's."""
        return len(self.vision.get("deepstack_visual_indexes") or ())

    def rules(self) -> dict[str, Any]:
        return {**super().rules(), "deepstack_levels": self.levels}

    def encoded_width(self, hidden: int) -> int:
        return hidden * (1 + self.levels)

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        pixels = torch.cat([item["pixel_values"] for item in items])
        grids = torch.cat([item["image_grid_thw"] for item in items])
        out = body.get_image_features(pixels, grids, return_dict=True)
        # Per item: its merged patches and each level's features, side by side.
        return [
            torch.cat([main, *levels], dim=1)
            for main, *levels in zip(out.pooler_output, *out.deepstack_features, strict=True)
        ]

    def encoded_kwargs(self, features: list[tuple[int, Any]]) -> dict[str, Any]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        parts = [output.chunk(1 + self.levels, dim=1) for _, output in features]
        image = BaseModelOutputWithDeepstackFeatures(
            pooler_output=[p[0] for p in parts],  # type: ignore[arg-type]  # a list, one per item, as the forward reads
            deepstack_features=[[p[1 + level] for p in parts] for level in range(self.levels)],  # type: ignore[misc]
        )
        return {"mm_encoder_outputs": {"image": image}}


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    holders = {
        IMAGE: Placeholders(
            token="<|image_pad|>",
            token_id=int(config.get("image_token_id", 151655)),
            before="<|vision_start|>",
            after="<|vision_end|>",
        ),
    }
    # Its image items only (a checkpoint's video processor adds video names).
    images = frozenset(name for name in names if "video" not in name)
    return Qwen3VL(name="qwen3-vl", model_type=model_type, placeholders=holders, input_names=images, config=config)
