"""LLaVA-1.5: one fixed-size pixel tensor per image, ``[1, C, S, S]``; each
image fills (S/patch)² placeholders (+1 with the "full" feature strategy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmsplit_server.families.base import IMAGE, BadItem, Family, Placeholders, need

MODEL_TYPES = ("llava",)


class Llava(Family):
    @property
    def vision(self) -> dict[str, Any]:
        return dict(self.config.get("vision_config") or {})

    @property
    def side(self) -> int:
        return int(self.vision.get("image_size", 336))

    @property
    def channels(self) -> int:
        return int(self.vision.get("num_channels", 3))

    def tokens_per_view(self) -> int:
        """Placeholders of one SxS view: one per patch, plus the CLS
        position when the feature strategy keeps it."""
        patches = (self.side // int(self.vision.get("patch_size", 14))) ** 2
        full = self.config.get("vision_feature_select_strategy", "default") == "full"
        return patches + int(full)

    def rules(self) -> dict[str, Any]:
        strategy = self.config.get("vision_feature_select_strategy", "default")
        patch = int(self.vision.get("patch_size", 14))
        return {**super().rules(), "side": self.side, "channels": self.channels, "patch": patch, "strategy": strategy}

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        if modality != IMAGE:
            raise BadItem(f"{self.name} takes images only")
        shape = need(shapes, "pixel_values", 4)
        if shape != (1, self.channels, self.side, self.side):
            raise BadItem(f"pixel_values must have shape {[1, self.channels, self.side, self.side]}, got {list(shape)}")
        return self.tokens_per_view()

    # Encoder outputs: transformers' LlavaModel takes them precomputed
    # (`mm_encoder_outputs`), per image, exactly as its forward would make them.
    @property
    def caches_encoder_outputs(self) -> bool:
        return True

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        pixels = torch.cat([item["pixel_values"] for item in items])
        return list(body.get_image_features(pixel_values=pixels, return_dict=True).pooler_output)


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    token_id = int(config.get("image_token_id", config.get("image_token_index", 32000)))
    token = str(processor_config.get("image_token", "<image>"))
    return Llava(
        name="llava",
        model_type=model_type,
        placeholders={IMAGE: Placeholders(token=token, token_id=token_id)},
        input_names=names,
        config=config,
    )
