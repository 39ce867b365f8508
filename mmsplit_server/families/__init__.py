"""Model families as adapters, one module each, chosen by `config.model_type`.

Adding a family is adding one module here (a `MODEL_TYPES` tuple and a
`build(model_type, config, processor_config, names)`), listing it in
`MODULES`, and a test; see README "Model families".
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from mmsplit_server.families.base import (
    IMAGE,
    VIDEO,
    BadItem,
    Family,
    PixelBudget,
    Placeholders,
    TileBudget,
    is_encoder_input,
    read_json,
)

MODULES = ("llava", "llava_next", "qwen2_vl", "qwen3_vl", "internvl")
VIDEO_CONFIG = "video_preprocessor_config.json"
IMAGE_CONFIG = "preprocessor_config.json"
__all__ = [
    "IMAGE",
    "VIDEO",
    "BadItem",
    "Family",
    "PixelBudget",
    "Placeholders",
    "TileBudget",
    "from_config",
    "is_encoder_input",
    "load",
    "supported",
]


def supported() -> dict[str, str]:
    """model_type -> adapter module."""
    out: dict[str, str] = {}
    for module in MODULES:
        for model_type in importlib.import_module(f"mmsplit_server.families.{module}").MODEL_TYPES:
            out[model_type] = module
    return out


def load(model_dir: Path, input_names: frozenset[str] | None = None) -> Family:
    """The adapter of the checkpoint in `model_dir`. `input_names` is the
    processor's model_input_names; read from the directory's image processor
    when not given (the tokenizer's workers already hold that processor)."""
    config = read_json(model_dir / "config.json")
    processor_config = read_json(model_dir / "processor_config.json")
    video_config = read_json(model_dir / VIDEO_CONFIG)
    image_config = read_json(model_dir / IMAGE_CONFIG)
    if input_names is None:
        _module(config)  # an unsupported model fails here, before loading its processor
        input_names = _input_names(model_dir)
    if video_config:
        input_names = input_names | video_names(str(config.get("model_type", "")))
    family = from_config(config, processor_config, input_names)
    return dataclasses.replace(family, video_config=video_config, image_config=image_config)


def from_config(
    config: dict[str, Any], processor_config: dict[str, Any] | None = None, input_names: frozenset[str] = frozenset()
) -> Family:
    """The adapter for a model config (as config.json holds it)."""
    module = _module(config)
    family: Family = module.build(str(config["model_type"]), config, processor_config or {}, input_names)
    return family


def _module(config: dict[str, Any]) -> Any:
    model_type = str(config.get("model_type", ""))
    modules = supported()
    if model_type not in modules:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(sorted(modules))}")
    return importlib.import_module(f"mmsplit_server.families.{modules[model_type]}")


def _input_names(model_dir: Path) -> frozenset[str]:
    from transformers import AutoImageProcessor

    return frozenset(AutoImageProcessor.from_pretrained(model_dir).model_input_names)


def video_names(model_type: str) -> frozenset[str]:
    """The forward names of a video item, for a checkpoint that ships a video
    processor (its class needs torchvision to load, so they are fixed here)."""
    names = {"pixel_values_videos", "video_grid_thw"}
    if model_type == "qwen2_5_vl":
        names.add("second_per_grid_ts")
    return frozenset(names)
