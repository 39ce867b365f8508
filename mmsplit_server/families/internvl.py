"""InternVL (transformers' `internvl`: InternVL3 and 3.5 as "-hf"
checkpoints): an image is cut into square tiles of the vision tower's size
(the grid whose aspect ratio is closest to the image's, within the image
processor's min_patches..max_patches, plus a thumbnail of the whole image
when there is more than one tile). Item tensors: ``pixel_values [tiles, C,
S, S]``. Each tile fills `image_seq_length` placeholders ((S / patch)² times
downsample_ratio², the pixel shuffle's), and the run is wrapped as
`InternVLProcessor` writes it: ``<img>`` + placeholders + ``</img>``."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmsplit_server.families.base import IMAGE, BadItem, Family, Placeholders, need

MODEL_TYPES = ("internvl",)
# InternVL's image processor makes at most this many tiles (its max_patches
# is 12 in the released checkpoints; the thumbnail adds one).
MAX_TILES = 64


class InternVL(Family):
    @property
    def vision(self) -> dict[str, Any]:
        return dict(self.config.get("vision_config") or {})

    @property
    def side(self) -> int:
        size = self.vision.get("image_size", 448)
        return int(size[0] if isinstance(size, list | tuple) else size)

    @property
    def channels(self) -> int:
        return int(self.vision.get("num_channels", 3))

    def tokens_per_tile(self) -> int:
        """Placeholders of one tile: its patches after the pixel shuffle."""
        patch = self.vision.get("patch_size", 14)
        patch = int(patch[0] if isinstance(patch, list | tuple) else patch)
        ratio = float(self.config.get("downsample_ratio", 0.5))
        return int((self.side // patch) ** 2 * ratio**2)

    def image_options(self, *, one_frame: bool, pixels: Any = None) -> dict[str, Any]:
        # InternVLProcessor tiles every image whatever its image processor's
        # own crop_to_patches says (its images_kwargs default): so do the workers.
        return {"crop_to_patches": True}

    def rules(self) -> dict[str, Any]:
        return {**super().rules(), "side": self.side, "channels": self.channels, "per_tile": self.tokens_per_tile()}

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        if modality != IMAGE:
            raise BadItem(f"{self.name} takes images only")
        shape = need(shapes, "pixel_values", 4)
        if not (1 <= shape[0] <= MAX_TILES) or shape[1:] != (self.channels, self.side, self.side):
            raise BadItem(
                f"pixel_values must have shape [tiles 1..{MAX_TILES}, {self.channels}, {self.side}, {self.side}], "
                f"got {list(shape)}"
            )
        return shape[0] * self.tokens_per_tile()

    # transformers' InternVLModel takes the encoder outputs precomputed
    # (`mm_encoder_outputs`), as one tensor of every image's rows in order.
    @property
    def caches_encoder_outputs(self) -> bool:
        return True

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        pixels = torch.cat([item["pixel_values"] for item in items])
        tiles = body.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=self.config.get("vision_feature_layer", -1),
            vision_feature_select_strategy=self.config.get("vision_feature_select_strategy", "default"),
            return_dict=True,
        ).pooler_output  # [tiles, per tile, hidden]
        sizes = [int(item["pixel_values"].shape[0]) for item in items]
        return [out.reshape(-1, out.shape[-1]) for out in torch.split(tiles, sizes)]

    def encoded_kwargs(self, features: list[tuple[int, Any]]) -> dict[str, Any]:
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        rows = torch.cat([output for _, output in features])
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=rows)}}


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    token_id = int(config.get("image_token_id", 151667))
    token = str(processor_config.get("image_token", "<IMG_CONTEXT>"))
    start = str(processor_config.get("start_image_token", "<img>"))
    end = str(processor_config.get("end_image_token", "</img>"))
    return InternVL(
        name="internvl",
        model_type=model_type,
        placeholders={IMAGE: Placeholders(token=token, token_id=token_id, before=start, after=end)},
        input_names=names,
        config=config,
    )
