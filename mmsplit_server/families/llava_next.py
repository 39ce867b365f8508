"""LLaVA-NeXT (anyres): an image is a base view plus the tiles of the grid
resolution that fits it best. Item tensors: ``pixel_values [views, C, S, S]``
(the processor's padded 5-D form with the padding dropped: the joined 4-D
form gives identical features, measured) and ``image_sizes [1, 2]`` (the
original height and width, int64). The placeholder count follows
`LlavaNextProcessor._get_number_of_features`: base view + unpadded grid
features + one newline per grid row."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmsplit_server.families.base import IMAGE, BadItem, Family, ints, need
from mmsplit_server.families.llava import Llava
from mmsplit_server.families.llava import build as build_llava

MODEL_TYPES = ("llava_next",)
MAX_SIDE = 1 << 15


def best_resolution(size: tuple[int, int], candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """The grid resolution that keeps the most of the image's pixels and
    wastes the least (transformers' `select_best_resolution`)."""
    height, width = size
    best, best_fit, least_waste = candidates[0], -1, float("inf")
    for h, w in candidates:
        scale = min(w / width, h / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        waste = (w * h) - effective
        if effective > best_fit or (effective == best_fit and waste < least_waste):
            best, best_fit, least_waste = (h, w), effective, waste
    return best


class LlavaNext(Llava):
    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        # The views of every image in one tower call; transformers splits the
        # result per image and packs each (unpadded grid, newlines), which is
        # what the placeholders hold.
        import torch

        pixels = torch.cat([item["pixel_values"] for item in items])
        sizes = torch.cat([item["image_sizes"] for item in items])
        return list(body.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True).pooler_output)

    def rules(self) -> dict[str, Any]:
        return {**super().rules(), "pinpoints": self.pinpoints}

    @property
    def pinpoints(self) -> list[tuple[int, int]]:
        return [(int(h), int(w)) for h, w in self.config.get("image_grid_pinpoints") or []]

    def views(self, height: int, width: int) -> tuple[int, int, int]:
        """(views, grid rows, grid columns) of an image of this size."""
        if not self.pinpoints:
            raise BadItem("the model's config has no image_grid_pinpoints")
        best_h, best_w = best_resolution((height, width), self.pinpoints)
        rows, cols = best_h // self.side, best_w // self.side
        return 1 + rows * cols, rows, cols

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        if modality != IMAGE:
            raise BadItem(f"{self.name} takes images only")
        height, width = (int(v) for v in ints(side, "image_sizes", (1, 2))[0])
        if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
            raise BadItem(f"image_sizes {[height, width]} must be within 1..{MAX_SIDE}")
        views, rows, cols = self.views(height, width)
        shape = need(shapes, "pixel_values", 4)
        if shape != (views, self.channels, self.side, self.side):
            raise BadItem(
                f"pixel_values must have shape {[views, self.channels, self.side, self.side]} "
                f"for an image of {height}x{width}, got {list(shape)}"
            )
        patches = self.side // int(self.vision.get("patch_size", 14))
        cur_h, cur_w = patches * rows, patches * cols
        # The grid features of the unpadded part of the image, one newline per row.
        if width / height > cur_w / cur_h:
            new_h = int(round(height * (cur_w / width), 7))
            cur_h -= ((cur_h - new_h) // 2) * 2
        else:
            new_w = int(round(width * (cur_h / height), 7))
            cur_w -= ((cur_w - new_w) // 2) * 2
        return cur_h * cur_w + cur_h + self.tokens_per_view()

    def item_rows(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = super().item_rows(outputs)
        pixels = rows["pixel_values"]
        if pixels.ndim == 5:  # [1, max views, C, S, S] padded for batching: this image's views only
            views = self.views(*(int(v) for v in rows["image_sizes"][0]))[0]
            rows["pixel_values"] = np.ascontiguousarray(pixels[0, :views])
        rows["image_sizes"] = rows["image_sizes"].astype(np.int64)
        return rows


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    base = build_llava(model_type, config, processor_config, names)
    return LlavaNext(
        name="llava-next",
        model_type=model_type,
        placeholders=base.placeholders,
        input_names=names,
        config=config,
    )
