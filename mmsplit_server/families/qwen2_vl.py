"""Qwen2-VL and Qwen2.5-VL: flattened patches plus a (t, h, w) grid per item,
and M-RoPE positions.

Item tensors: images ``pixel_values [t*h*w, C*T*P*P]`` and
``image_grid_thw [1, 3]``; videos ``pixel_values_videos`` and
``video_grid_thw`` the same way, and (2.5) ``second_per_grid_ts [1]``. An
item fills ``t*h*w / merge²`` placeholders between vision start and end.

Positions: each prompt's 3-D positions and its rope delta come from the
model's own `get_rope_index` over that prompt alone; decode passes
``position = length + delta`` for every row explicitly. The model's
``rope_deltas`` attribute (one value kept on the module, reused by later
calls without positions) is never relied on: with requests interleaved in
one batch it belongs to whichever prompt ran last.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmsplit_server.families.base import IMAGE, VIDEO, BadItem, Family, PixelBudget, Placeholders, ints, need, rgb_as_is

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
GRID_NAMES: dict[int, tuple[str, str]] = {
    IMAGE: ("pixel_values", "image_grid_thw"),
    VIDEO: ("pixel_values_videos", "video_grid_thw"),
}
# Placeholders of one item at most (a 4K image at Qwen's patch sizes is ~11k).
MAX_ITEM_TOKENS = 1 << 15
# Pixel bounds of an image when the checkpoint names none (transformers' Qwen2VLImageProcessor's).
DEFAULT_IMAGE_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
# Pixel bounds of one video frame when the checkpoint names none (transformers' defaults).
DEFAULT_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}


class QwenVL(Family):
    patch_default = 14  # pixels a patch's side, when the vision config names none

    @property
    def vision(self) -> dict[str, Any]:
        return dict(self.config.get("vision_config") or {})

    def rules(self) -> dict[str, Any]:
        return {
            **super().rules(),
            "merge": self.merge,
            "row_width": self.row_width(),
            "temporal_patch": self.temporal_patch_size,
        }

    @property
    def merge(self) -> int:
        return int(self.vision.get("spatial_merge_size", 2))

    def row_width(self) -> int:
        v = self.vision
        return (
            int(v.get("in_channels", v.get("in_chans", 3)))
            * int(v.get("temporal_patch_size", 2))
            * int(v.get("patch_size", self.patch_default)) ** 2
        )

    @property
    def temporal_patch_size(self) -> int:
        return int(self.vision.get("temporal_patch_size", 2))

    @property
    def image_frames(self) -> int:
        return self.temporal_patch_size

    def image_options(self, *, one_frame: bool, pixels: PixelBudget | None = None, tiles: Any = None) -> dict[str, Any]:
        # Patchified as a patch of one frame: the rows of `temporal_patch_size`
        # copies hold each pixel that many times (a 1920x1080 photo at the
        # default budget: 50.6 MB of float32 instead of 25.3).
        options: dict[str, Any] = {"temporal_patch_size": 1} if one_frame and self.image_frames > 1 else {}
        if pixels is not None:  # the processor's `size` for this call only
            options["size"] = {"shortest_edge": pixels.least, "longest_edge": pixels.most}
        return options

    @property
    def image_pixels(self) -> PixelBudget:
        """As transformers' processor reads preprocessor_config.json: its
        top-level `min_pixels` and `max_pixels` over `size`'s shortest and
        longest edge, else the class's own (tests/tokenizer/test_image_budget.py)."""
        config = self.image_config
        size = dict(config.get("size") or {})

        def bound(edge: str, old: str) -> int:
            value: Any = config.get(old)
            if value is None:
                value = size.get(edge, DEFAULT_IMAGE_SIZE[edge])
            return int(value)

        return PixelBudget(bound("shortest_edge", "min_pixels"), bound("longest_edge", "max_pixels"))

    @property
    def image_row_pixels(self) -> int:
        side = int(self.vision.get("patch_size", self.patch_default))
        return side * side

    def image_rows(self, width: int, height: int, pixels: PixelBudget) -> int:
        # The processor's own resize rule, with its patch and merge sizes: what
        # its get_number_of_image_patches counts (tests/tokenizer/test_image_budget.py).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        config = self.image_config
        patch = int(config.get("patch_size", self.vision.get("patch_size", self.patch_default)))
        factor = patch * int(config.get("merge_size", self.merge))
        h, w = smart_resize(height, width, factor, min_pixels=pixels.least, max_pixels=pixels.most)
        return (h // patch) * (w // patch)

    def image_row_values(self, *, one_frame: bool) -> int:
        return self.row_width() // (self.image_frames if one_frame else 1)

    @property
    def least_image_pixels(self) -> int:
        # One merged patch: the smallest image the processor makes.
        return self.image_row_pixels * self.merge * self.merge

    def one_frame_rows(self, modality: int, shapes: dict[str, tuple[int, ...]]) -> bool:
        shape = shapes.get(GRID_NAMES[IMAGE][0], ())
        frames = self.image_frames
        return modality == IMAGE and frames > 1 and len(shape) == 2 and shape[1] == self.row_width() // frames

    def full_rows(self, modality: int, name: str, tensor: Any) -> Any:
        """Rows of one frame ``[patches, C*P*P]`` as the model's ``[patches,
        C*T*P*P]``: each channel's ``P*P`` block repeated ``T`` times in
        place, the ``(C, T, P, P)`` order the processor writes an image's
        copies in (a test holds them equal to its rows)."""
        if name != GRID_NAMES[IMAGE][0] or not self.one_frame_rows(modality, {name: tuple(tensor.shape)}):
            return tensor
        frames = self.image_frames
        patches, channels = tensor.shape[0], self.row_width() // frames // self._patch_area
        per_frame = tensor.reshape(patches, channels, 1, self._patch_area)
        return per_frame.expand(patches, channels, frames, self._patch_area).reshape(patches, -1)

    def video_rows(self, processor: Any, frames: list[Any], sampled_fps: float) -> dict[str, np.ndarray]:
        """The rows of Qwen's video processor, built from its image processor:
        each frame is resized (to the video processor's pixel bounds),
        rescaled, normalized and patchified exactly as an image is; an image
        row holds its frame ``temporal_patch_size`` times, a video row holds
        that many consecutive frames instead (the last frame repeated to fill
        the final patch), in the same ``(C, T, P, P)`` order. Each frame is
        patchified as a patch of one frame (``temporal_patch_size=1``: the
        image rows' first copy, without making the others), and an RGB frame
        is taken as it is (its conversion to RGB would be a copy)."""
        if not frames:
            raise BadItem("a video item needs at least one frame")
        tps = self.temporal_patch_size
        frames, kwargs = self.sized_frames(frames)
        per_frame: list[np.ndarray] = []
        grid_hw: tuple[int, int] | None = None
        for frame in frames:
            out = processor(images=frame, **kwargs, **rgb_as_is(frame), temporal_patch_size=1, return_tensors="np")
            rows = np.asarray(out["pixel_values"], dtype=np.float32)
            _, gh, gw = (int(v) for v in np.asarray(out["image_grid_thw"])[0])
            if grid_hw not in (None, (gh, gw)):
                raise BadItem("the frames of a video must all have one size")
            grid_hw = (gh, gw)
            per_frame.append(rows.reshape(rows.shape[0], -1, self._patch_area))  # [h*w, C, P*P]
        per_frame.extend([per_frame[-1]] * (-len(per_frame) % tps))
        stacked = np.stack(per_frame)  # [frames, h*w, C, P*P]
        n, positions, channels, area = stacked.shape
        grid_t = n // tps
        video = stacked.reshape(grid_t, tps, positions, channels, area).transpose(0, 2, 3, 1, 4)
        assert grid_hw is not None
        out_rows: dict[str, np.ndarray] = {
            "pixel_values_videos": np.ascontiguousarray(video.reshape(grid_t * positions, channels * tps * area)),
            "video_grid_thw": np.array([[grid_t, *grid_hw]], dtype=np.int64),
        }
        if "second_per_grid_ts" in self.input_names:
            out_rows["second_per_grid_ts"] = np.array([tps / sampled_fps], dtype=np.float32)
        return out_rows

    def sized_frames(self, frames: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """The frames as the image processor is to take them, and its
        keywords: each frame resized by the processor itself, within the
        video processor's pixel bounds per frame."""
        return frames, {"size": dict(self.video_config.get("size") or DEFAULT_VIDEO_SIZE)}

    @property
    def _patch_area(self) -> int:
        return int(self.vision.get("patch_size", self.patch_default)) ** 2

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        if modality not in GRID_NAMES or modality not in self.placeholders:
            kinds = " and ".join("images" if m == IMAGE else "videos" for m in sorted(self.placeholders))
            raise BadItem(f"{self.name} takes {kinds} only")
        pixels_name, grid_name = GRID_NAMES[modality]
        t, h, w = (int(v) for v in ints(side, grid_name, (1, 3))[0])
        if min(t, h, w) < 1 or h % self.merge or w % self.merge:
            raise BadItem(f"{grid_name} {[t, h, w]} must be positive with h and w multiples of {self.merge}")
        if modality == IMAGE and t != 1:
            raise BadItem(f"{grid_name} of an image must have t = 1, got {t}")
        tokens = t * h * w // self.merge**2
        if tokens > MAX_ITEM_TOKENS:
            raise BadItem(f"{grid_name} {[t, h, w]} gives {tokens} placeholders, at most {MAX_ITEM_TOKENS}")
        shape = need(shapes, pixels_name, 2)
        widths = [self.row_width()]
        if modality == IMAGE and self.image_frames > 1:
            widths.append(self.row_width() // self.image_frames)  # rows of one frame (`image_options`)
        if shape[0] != t * h * w or shape[1] not in widths:
            allowed = " or ".join(str([t * h * w, width]) for width in widths)
            raise BadItem(f"{pixels_name} must have shape {allowed} for {grid_name} {[t, h, w]}, got {list(shape)}")
        if "second_per_grid_ts" in side:
            seconds = side["second_per_grid_ts"]
            if modality != VIDEO or seconds.shape != (1,) or seconds.dtype.kind != "f":
                raise BadItem("second_per_grid_ts must be one float of a video item")
            if not np.isfinite(seconds).all() or not 0 < float(seconds[0]) <= 3600:
                raise BadItem("second_per_grid_ts must be within (0, 3600]")
        return tokens

    def check_runs(self, items: list[Any]) -> None:
        """M-RoPE numbers each item's placeholders as one (t, h, w) block,
        found as a maximal run of vision tokens: an item must be one run
        (`item_runs`), and no two runs may touch (they would read as one
        block, and `get_rope_index` fails inside the forward)."""
        end = -1
        for i, item in enumerate(items):
            expected = self.item_runs(item)
            if len(item.placeholders) != expected:
                raise BadItem(
                    f"item {i}: an item of {self.name} fills {expected} placeholder run(s), "
                    f"not {len(item.placeholders)}"
                )
            lengths = {length for _, length in item.placeholders}
            if len(lengths) != 1:
                raise BadItem(f"item {i}: its placeholder runs must be of one length, got {sorted(lengths)}")
            for offset, length in item.placeholders:
                if offset == end:
                    raise BadItem(f"item {i}: a placeholder run touches the one before it")
                end = offset + length

    def item_runs(self, item: Any) -> int:
        """The placeholder runs an item fills: one."""
        return 1

    @property
    def uses_mrope(self) -> bool:
        return True

    def rope_positions(self, model: Any, input_ids: list[int], items: list[Any]) -> tuple[Any, int]:
        import torch

        ids = torch.tensor([input_ids], dtype=torch.long)
        types = torch.zeros_like(ids, dtype=torch.int32)
        grids: dict[int, list[np.ndarray]] = {IMAGE: [], VIDEO: []}
        seconds: list[float] = []
        for item in items:
            for start, length in item.placeholders:
                types[0, start : start + length] = 1 if item.modality == IMAGE else 2
            grids[item.modality].append(item.side[GRID_NAMES[item.modality][1]])
            if item.modality == VIDEO:
                seconds.append(float(item.side["second_per_grid_ts"][0]) if "second_per_grid_ts" in item.side else 1.0)
        kwargs: dict[str, Any] = {}
        for modality, name in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
            if grids[modality]:
                kwargs[name] = torch.from_numpy(np.concatenate(grids[modality]))
        if seconds and self.model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor(seconds)
        positions, delta = model.model.get_rope_index(ids, types, **kwargs)
        return positions[:, 0], int(delta.reshape(-1)[0])

    # Encoder outputs: transformers' Qwen2-VL and Qwen2.5-VL models take them
    # precomputed (`mm_encoder_outputs`), one per image or video; positions
    # are the engine's own (M-RoPE above), so the grids are needed only here.
    @property
    def caches_encoder_outputs(self) -> bool:
        return True

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        return list(self.vision_output(body, modality, items).pooler_output)

    def vision_output(self, body: Any, modality: int, items: list[dict[str, Any]]) -> Any:
        """The model's own image or video features of `items` in one call
        (its `pooler_output` one tensor per item)."""
        import torch

        pixels_name, grid_name = GRID_NAMES[modality]
        pixels = torch.cat([item[pixels_name] for item in items])
        grids = torch.cat([item[grid_name] for item in items])
        features = body.get_video_features if modality == VIDEO else body.get_image_features
        return features(pixels, grids, return_dict=True)


def placeholders(config: dict[str, Any]) -> dict[int, Placeholders]:
    """The Qwen families' markers: an image's and a video's pad token
    between vision start and end."""
    start, end = "<|vision_start|>", "<|vision_end|>"
    return {
        IMAGE: Placeholders(
            token="<|image_pad|>", token_id=int(config.get("image_token_id", 151655)), before=start, after=end
        ),
        VIDEO: Placeholders(
            token="<|video_pad|>", token_id=int(config.get("video_token_id", 151656)), before=start, after=end
        ),
    }


def build(model_type: str, config: dict[str, Any], processor_config: dict[str, Any], names: frozenset[str]) -> Family:
    return QwenVL(
        name="qwen2-vl" if model_type == "qwen2_vl" else "qwen2.5-vl",
        model_type=model_type,
        placeholders=placeholders(config),
        input_names=names,
        config=config,
    )
