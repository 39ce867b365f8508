"""InternVL (transformers' `internvl`: InternVL3 and 3.5 as "-hf"
checkpoints): an image is cut into square tiles of the vision tower's size
(the grid whose aspect ratio is closest to the image's, within the image
processor's min_patches..max_patches, plus a thumbnail of the whole image
when there is more than one tile). Item tensors: ``pixel_values [tiles, C,
S, S]``. Each tile fills `image_seq_length` placeholders ((S / patch)² times
downsample_ratio², the pixel shuffle's), and the run is wrapped as
`InternVLProcessor` writes it: ``<img>`` + placeholders + ``</img>``.

A video (the chat template's ``<video>``) is its sampled frames, each one
tile of the vision tower's size (no grid, no thumbnail: ``pixel_values
[frames, C, S, S]``), written as `InternVLProcessor.replace_video_token`
writes them: ``Frame1: <img>`` + one tile's placeholders + ``</img>``, one
line a frame. The frames are picked in the middle of equal parts of the
video (`frame_sampling` "centered", the video processor's `initial_shift`)
and made by the image processor with its tiling off (vLLM's way: the same
resize, rescale and normalization as a tile), with the video processor's
mean and standard deviation where the checkpoint has a
video_preprocessor_config.json. The model reads both as image
placeholders, in prompt order."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmsplit_server.families.base import IMAGE, VIDEO, BadItem, Family, Placeholders, TileBudget, need, rgb_as_is

MODEL_TYPES = ("internvl",)
# InternVL's image processor makes at most this many tiles (its max_patches
# is 12 in the released checkpoints; the thumbnail adds one).
MAX_TILES = 64
# The most frames of one video item (the tokenizer samples at most its
# --video-max-frames, 32 unless raised).
MAX_FRAMES = 1024


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

    def image_options(self, *, one_frame: bool, pixels: Any = None, tiles: TileBudget | None = None) -> dict[str, Any]:
        # InternVLProcessor tiles every image whatever its image processor's
        # own crop_to_patches says (its images_kwargs default): so do the workers.
        bounds = {} if tiles is None else {"min_patches": tiles.least, "max_patches": tiles.most}
        return {"crop_to_patches": True, **bounds}

    @property
    def image_tiles(self) -> TileBudget:
        """The image processor's min_patches and max_patches (GotOcr2's
        defaults, 1 and 12, where its config names none)."""
        return TileBudget(int(self.image_config.get("min_patches", 1)), int(self.image_config.get("max_patches", 12)))

    def rules(self) -> dict[str, Any]:
        return {**super().rules(), "side": self.side, "channels": self.channels, "per_tile": self.tokens_per_tile()}

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        shape = need(shapes, "pixel_values", 4)
        most, what = (MAX_TILES, "tiles") if modality == IMAGE else (MAX_FRAMES, "frames")
        if not (1 <= shape[0] <= most) or shape[1:] != (self.channels, self.side, self.side):
            raise BadItem(
                f"pixel_values must have shape [{what} 1..{most}, {self.channels}, {self.side}, {self.side}], "
                f"got {list(shape)}"
            )
        return shape[0] * self.tokens_per_tile()

    def check_runs(self, items: list[Any]) -> None:
        """An image's placeholders are one run; a video's one run per frame,
        each of one tile's placeholders."""
        per_tile = self.tokens_per_tile()
        for i, item in enumerate(items):
            lengths = [length for _, length in item.placeholders]
            if item.modality == IMAGE and len(lengths) != 1:
                raise BadItem(f"item {i}: an image of {self.name} fills one placeholder run, not {len(lengths)}")
            if item.modality == VIDEO and any(length != per_tile for length in lengths):
                raise BadItem(f"item {i}: each frame of a video fills a run of {per_tile} placeholders")

    # ---- video ----
    @property
    def takes_video(self) -> bool:
        return VIDEO in self.placeholders

    @property
    def frame_sampling(self) -> str:
        return "centered"

    def expand(self, modality: int, tokens: int, times: tuple[float, ...] = ()) -> str:
        if modality != VIDEO:
            return super().expand(modality, tokens, times)
        per_tile = self.tokens_per_tile()
        if tokens % per_tile:
            raise BadItem(f"a video of {tokens} placeholders is not whole frames of {per_tile}")
        frame = self.placeholders[IMAGE].expand(per_tile)
        return "\n".join(f"Frame{i + 1}: {frame}" for i in range(tokens // per_tile))

    def video_rows(self, processor: Any, frames: list[Any], sampled_fps: float) -> dict[str, np.ndarray]:
        if not frames:
            raise BadItem("a video item needs at least one frame")
        own = {k: self.video_config[k] for k in ("image_mean", "image_std") if k in self.video_config}
        # One call for every frame (decoded as RGB, all of one size): a tile each.
        out = processor(images=frames, crop_to_patches=False, **own, **rgb_as_is(frames[0]), return_tensors="np")
        return {"pixel_values": np.ascontiguousarray(out["pixel_values"], dtype=np.float32)}

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
    video = str(processor_config.get("video_token", "<video>"))
    return InternVL(
        name="internvl",
        model_type=model_type,
        placeholders={
            IMAGE: Placeholders(token=token, token_id=token_id, before=start, after=end),
            # A video's frames are image placeholders, each wrapped as an image is (`expand`).
            VIDEO: Placeholders(token=token, token_id=token_id, marker=video),
        },
        input_names=names,
        config=config,
    )
