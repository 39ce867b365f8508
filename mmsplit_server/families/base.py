"""What every model family adapter provides (DESIGN.md §2, §6).

A family is one small module that knows, for one kind of checkpoint, how
processor outputs become multimodal items and how items become forward
arguments. Both services build the same `Family` from the same model
directory, so the rule that gives an item's placeholder count is one piece of
code: the tokenizer uses it to expand the prompt, the scheduler to check what
it is sent.

Conventions shared by every family:
- an item's tensors hold its rows along dim 0; the scheduler joins the items
  of a forward name by name with ``cat(dim=0)`` in prompt order;
- encoder inputs are the tensors named ``pixel_values*`` (float, cast to the
  model's dtype); every other tensor is a side tensor (sizes, grids,
  timings), small, kept in its wire dtype, and travels inline;
- `count` validates an item's shapes and side values and returns the number
  of placeholder tokens it fills; any inconsistency is a `BadItem`, raised
  before anything reaches a model forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mmsplit.common.v1 import common_pb2

IMAGE: int = common_pb2.MODALITY_IMAGE
VIDEO: int = common_pb2.MODALITY_VIDEO


class BadItem(ValueError):
    """An item that does not fit the model (the sender's fault)."""


def is_encoder_input(name: str) -> bool:
    return name.startswith("pixel_values")


@dataclass(frozen=True)
class Placeholders:
    """The token that marks where a medium goes in a prompt and is repeated
    once per placeholder position, and the text around a run."""

    token: str
    token_id: int
    # Text around the run when the marker is expanded (Qwen: vision start/end).
    before: str = ""
    after: str = ""
    # What the chat template writes for the medium, where that is not the
    # placeholder token itself (InternVL's ``<video>``, expanded into frames
    # of image placeholders: `Family.expand`).
    marker: str = ""

    @property
    def mark(self) -> str:
        """The medium's marker in a prompt: `marker`, else the placeholder token."""
        return self.marker or self.token

    def expand(self, count: int) -> str:
        return self.before + self.token * count + self.after


class TileBudget(NamedTuple):
    """The fewest and most tiles an image processor cuts an image into
    (InternVL's `min_patches`, `max_patches`; the thumbnail beside several
    tiles not counted)."""

    least: int
    most: int


class PixelBudget(NamedTuple):
    """The fewest and most pixels an image processor resizes an image to
    (Qwen's `min_pixels`, `max_pixels`: its `size` shortest and longest
    edge)."""

    least: int
    most: int

    def at_most(self, most: int) -> PixelBudget:
        """This budget with `most` as its most (its least taken down to it
        where over): a request's max_pixels without a min_pixels."""
        return PixelBudget(min(self.least, most), most)


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    # Modality -> how its placeholders look.
    placeholders: dict[int, Placeholders]
    # Forward names an item may carry (the processor's model_input_names).
    input_names: frozenset[str]
    config: dict[str, Any] = field(repr=False, default_factory=dict)
    # The checkpoint's video_preprocessor_config.json (empty when it has none).
    video_config: dict[str, Any] = field(repr=False, default_factory=dict)
    # Its preprocessor_config.json: the image processor's settings.
    image_config: dict[str, Any] = field(repr=False, default_factory=dict)

    # ---- both sides ----
    def rules(self) -> dict[str, Any]:
        """What this family's item checks follow from (`mmsplit.pairing`):
        its name, its placeholders, the tensors an item may carry, and (in
        each family) the config values its counts and shapes read. A
        tokenizer and a scheduler must agree on all of it."""
        return {
            "family": self.name,
            "placeholders": {
                str(modality): [p.token, p.token_id, p.before, p.after, *([p.marker] if p.marker else [])]
                for modality, p in sorted(self.placeholders.items())
            },
            "inputs": sorted(self.input_names),
        }

    def count(self, modality: int, shapes: dict[str, tuple[int, ...]], side: dict[str, np.ndarray]) -> int:
        """Check one item's tensor shapes and side values; return the number
        of placeholder tokens it fills. Raise BadItem."""
        raise NotImplementedError

    def check_runs(self, items: list[Any]) -> None:
        """Family-specific rules for the placeholder runs of a prompt's items
        (in order, each with its ``modality``, ``side`` tensors and
        ``placeholders`` runs; already checked ordered, non-overlapping, on
        placeholder tokens and of the right total). Raise BadItem."""

    # ---- tokenizer side ----
    def item_rows(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The image processor's outputs for ONE image as that item's tensors
        (rows along dim 0), keeping only the forward names."""
        return {name: np.ascontiguousarray(outputs[name]) for name in self.input_names if name in outputs}

    def expand(self, modality: int, tokens: int, times: tuple[float, ...] = ()) -> str:
        """A media marker's text in the prompt: the item's `tokens`
        placeholders and the text around them. `times`: a video's seconds
        per temporal patch (`Video.patch_times`), for families that write
        them into the prompt."""
        return self.placeholders[modality].expand(tokens)

    @property
    def image_frames(self) -> int:
        """How many times an image's rows hold its one frame: a family whose
        patches span several frames (Qwen's ``temporal_patch_size``) repeats
        a still image to fill them. 1 for the others."""
        return 1

    def image_options(
        self, *, one_frame: bool, pixels: PixelBudget | None = None, tiles: TileBudget | None = None
    ) -> dict[str, Any]:
        """The image processor's keywords for an item's rows: `one_frame`,
        rows holding the image's frame once where `image_frames` > 1 (the
        scheduler repeats it: `full_rows`), for a scheduler that takes them
        (ServerInfo.one_frame_image_rows); `pixels`, a request's own budget
        (`image_pixels` bounds it), for a family that has one; `tiles`, a
        request's own bounds on the tiles (`image_tiles` bounds them)."""
        return {}

    @property
    def image_tiles(self) -> TileBudget | None:
        """The checkpoint's bounds on the tiles an image is cut into, for a
        family that tiles (InternVL); None for the others."""
        return None

    @property
    def image_pixels(self) -> PixelBudget | None:
        """The checkpoint's budget of pixels per image, for a family whose
        processor sizes each image by one (its placeholders then follow the
        image's size); None where every image becomes the same size."""
        return None

    @property
    def image_row_pixels(self) -> int:
        """The pixels each row of an image's encoder input holds, for a
        family with a pixel budget (a Qwen patch: 14x14); 0 for the others."""
        return 0

    def image_rows(self, width: int, height: int, pixels: PixelBudget) -> int:
        """The rows the image processor makes of an image of this size
        within `pixels`, for a family with `image_row_pixels` (ValueError
        for a shape the processor refuses); 0 for the others."""
        return 0

    def image_row_values(self, *, one_frame: bool) -> int:
        """Values in each row of an image's encoder input (one frame's, or
        every frame's), for a family with `image_row_pixels`; 0 for the others."""
        return 0

    @property
    def least_image_pixels(self) -> int:
        """The fewest pixels any image becomes (a budget under it means nothing)."""
        return 1

    @property
    def frame_sampling(self) -> str:
        """How a video's frames are picked (`tokenizer_svc.video.sample_indices`):
        "stride", at a stride in whole temporal patches (Qwen2-VL's and
        Qwen2.5-VL's processors); "spread", from the first frame to the last
        (Qwen3-VL's); "centered", each in the middle of its equal part of the
        video (InternVL's)."""
        return "stride"

    @property
    def takes_video(self) -> bool:
        return VIDEO in self.placeholders and any(n.endswith("_videos") for n in self.input_names)

    @property
    def temporal_patch_size(self) -> int:
        """Frames that make one temporal patch (videos are padded to a multiple)."""
        return 1

    def video_rows(self, processor: Any, frames: list[Any], sampled_fps: float) -> dict[str, np.ndarray]:
        """One video's item tensors from its sampled RGB frames (PIL images
        of one size), made with the model's image processor."""
        raise BadItem(f"{self.name} takes no video")

    # ---- scheduler side ----
    def tp_plan_overrides(self) -> dict[str, str]:
        """Rules that replace the model's own tensor-parallel plan's (module
        or parameter pattern -> transformers' style), where that plan does
        not load or run as shipped."""
        return {}

    @property
    def splits_experts_after_load(self) -> bool:
        """Whether `tp_plan_overrides` loads fused experts whole on every
        rank for the scheduler to split over the ranks once loaded
        (`scheduler_svc.experts`)."""
        return False

    def one_frame_rows(self, modality: int, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether an item's encoder inputs (their shapes) are an image's rows
        of one frame (`image_options`), which `full_rows` repeats."""
        return False

    def full_rows(self, modality: int, name: str, tensor: Any) -> Any:
        """An item's encoder input as the model takes it: an image's rows of
        one frame (`image_options`) with the frame repeated `image_frames`
        times (a new tensor, on the input's device), else `tensor` itself."""
        return tensor

    @property
    def uses_mrope(self) -> bool:
        return False

    def rope_positions(self, model: Any, input_ids: list[int], items: list[Any]) -> tuple[Any, int]:
        """M-RoPE families: ``([3, len(input_ids)] positions, rope delta)``
        of one prompt; the delta is added to every later position."""
        raise NotImplementedError

    @property
    def caches_encoder_outputs(self) -> bool:
        """Whether the scheduler may run the encoder item by item (`encode`)
        and give the model the outputs (`encoded_kwargs`), so that outputs of
        items seen before come from its cache."""
        return False

    def encoded_width(self, hidden: int) -> int:
        """The width of an item's encoder output (`encode`), whose rows are
        its placeholders': the text model's hidden size, unless the family
        hands the model more per placeholder."""
        return hidden

    def encode(self, body: Any, modality: int, items: list[dict[str, Any]]) -> list[Any]:
        """Each item's encoder output ``[placeholder tokens, encoded_width]``, for
        items of one modality: each a dict of its encoder inputs (on the
        model's device and dtype) and side tensors (on the device)."""
        raise NotImplementedError

    def encoded_kwargs(self, features: list[tuple[int, Any]]) -> dict[str, Any]:
        """Forward keywords that hand the model these outputs ((modality,
        output) in prompt order) in place of its encoder inputs."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        by_kind: dict[str, list[Any]] = {}
        for modality, output in features:
            by_kind.setdefault("video" if modality == VIDEO else "image", []).append(output)
        # transformers types pooler_output as one tensor; the forwards read a list, one per item.
        outputs = {kind: BaseModelOutputWithPooling(pooler_output=out) for kind, out in by_kind.items()}  # type: ignore[arg-type]
        return {"mm_encoder_outputs": outputs}


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def need(shapes: dict[str, tuple[int, ...]], name: str, ndim: int) -> tuple[int, ...]:
    shape = shapes.get(name)
    if shape is None:
        raise BadItem(f"the item has no {name}")
    if len(shape) != ndim:
        raise BadItem(f"{name} must have {ndim} dimensions, got shape {list(shape)}")
    return shape


def ints(side: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = side.get(name)
    if value is None:
        raise BadItem(f"the item has no {name}")
    if value.dtype.kind not in "iu" or tuple(value.shape) != shape:
        raise BadItem(f"{name} must be integers of shape {list(shape)}, got {value.dtype} {list(value.shape)}")
    return value.astype(np.int64)


def rgb_as_is(image: Any) -> dict[str, bool]:
    """The processor's keyword to skip its RGB conversion where that would
    only copy: the tokenizer's `decode_image` returns RGB (alpha composited
    over white), video frames are decoded as RGB, and for an RGB image with
    no transparency key the processors' conversion is
    PIL's convert to the same mode, a copy of every pixel (6 MB and ~2 ms
    for a 1920x1080 photo, ~6 % of a LLaVA-1.5 worker's time). An RGB image
    that does carry a transparency key (a PNG's tRNS) is left to the
    processor, which composites it. The tensors are the same either way
    (tests/tokenizer/test_preprocess.py)."""
    if image.mode == "RGB" and image.info.get("transparency") is None:
        return {"do_convert_rgb": False}
    return {}
