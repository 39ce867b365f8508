"""The reference for every model family: the model's own Hugging Face
processor and single-process `generate`, on the same text and images.

Qwen2-VL's processor cannot be constructed here as shipped: its video
processor needs torchvision, which does not import beside this torch. It is
built from the directory's tokenizer and image processor with the video
processor left out (only its class check is skipped); images and text go
through exactly the code a user of transformers runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def processor(model_dir: Path) -> Any:
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, processing_utils

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    if model_type not in ("qwen2_vl", "qwen2_5_vl"):
        return AutoProcessor.from_pretrained(model_dir)
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    cls = Qwen2VLProcessor if model_type == "qwen2_vl" else Qwen2_5_VLProcessor
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    processing_utils.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
        lambda self, name, arg: None if arg is None else check(self, name, arg)
    )
    try:
        return cls(
            image_processor=AutoImageProcessor.from_pretrained(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            video_processor=None,
        )
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


def prompt_ids(proc: Any, text: str, images: list[Any]) -> list[int]:
    out = proc(images=images or None, text=text, return_tensors="pt")
    return out["input_ids"][0].tolist()


def generate(model_dir: Path, proc: Any, text: str, images: list[Any], max_tokens: int) -> list[int]:
    """Greedy tokens of single-process `generate` (EOS as the model directory says)."""
    from transformers import AutoModelForImageTextToText

    model = _models.get(model_dir)
    if model is None:
        model = _models[model_dir] = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = proc(images=images or None, text=text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


_models: dict[Path, Any] = {}


def with_markers(proc: Any, text: str, n_images: int) -> str:
    """The services' rule for a prompt without image markers (each image
    first, on its own line), applied before handing text to the processor."""
    token = proc.image_token
    if n_images and token not in text:
        wrapped = "<|vision_start|>" + token + "<|vision_end|>" if token == "<|image_pad|>" else token
        text = (wrapped + "\n") * n_images + text
    return text


def inputs(proc: Any, text: str, images: list[Any]) -> dict[str, Any]:
    """What the model's own processor gives for `text` and PIL `images`."""
    out = proc(images=images or None, text=with_markers(proc, text, len(images)), return_tensors="pt")
    return dict(out)
