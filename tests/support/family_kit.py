"""Requests for any model family, made the way the tokenizer service makes
them (image processor → the family's item tensors → prompt expansion), as
scheduler messages with inline tensors; and the same request turned into a
`NewRequest` by the scheduler's own admission checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmsplit.common.v1 import common_pb2
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit_server import families
from mmsplit_server.handoff.reference import NUMPY_TO_DTYPE
from tests.support import hf_loaded
from tokenizer_svc.prompt import Media, PromptBuilder

MARKERS = {
    "llava": "<image>",
    "llava-next": "<image>",
    "qwen2-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3-vl-moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "internvl": "<IMG_CONTEXT>",
    "internvl3.5": "<IMG_CONTEXT>",
}
# A video's marker where it is not the Qwen families' (`greedy.VIDEO_MARKER`).
VIDEO_MARKERS = {"internvl": "<video>", "internvl3.5": "<video>"}


def ships_template(family: str) -> bool:
    """Whether the family's tiny model always has its chat template (`mmsplit
    tiny-model` writes the LLaVA ones' only when asked)."""
    return family.startswith(("qwen", "internvl"))


@dataclass
class Kit:
    model_dir: Path
    family: families.Family
    tokenizer: Any
    image_processor: Any
    prompts: PromptBuilder

    @property
    def marker(self) -> str:
        return MARKERS[self.family.name]

    def items(self, images: list[Any], *, one_frame: bool = False) -> list[tuple[dict[str, np.ndarray], int]]:
        """Per image: its item tensors and placeholder count; `one_frame`:
        its rows of one frame where the family repeats it (`image_options`)."""
        out = []
        for image in images:
            options = self.family.image_options(one_frame=one_frame)
            raw = self.image_processor(images=image, return_tensors="np", **options)
            rows = self.family.item_rows({k: np.asarray(v) for k, v in raw.items()})
            shapes = {n: tuple(a.shape) for n, a in rows.items() if families.is_encoder_input(n)}
            side = {n: a for n, a in rows.items() if n not in shapes}
            out.append((rows, self.family.count(families.IMAGE, shapes, side)))
        return out

    def message(
        self, rid: str, text: str, images: list[Any], max_tokens: int, *, one_frame: bool = False
    ) -> scheduler_pb2.GenerateRequest:
        made = self.items(images, one_frame=one_frame)
        prompt = self.prompts.build(text, [Media(families.IMAGE, n) for _, n in made])
        items = [
            common_pb2.MultimodalItem(
                modality=common_pb2.MODALITY_IMAGE,
                tensors={name: inline(array) for name, array in rows.items()},
                placeholders=[common_pb2.PlaceholderRange(offset=o, length=n) for o, n in runs],
            )
            for (rows, _), runs in zip(made, prompt.runs, strict=True)
        ]
        return scheduler_pb2.GenerateRequest(
            request_id=rid,
            input_ids=prompt.input_ids,
            items=items,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        )


def inline(array: np.ndarray) -> common_pb2.TensorRef:
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
    array = np.ascontiguousarray(array)
    return common_pb2.TensorRef(dtype=NUMPY_TO_DTYPE[str(array.dtype)], shape=array.shape, inline=array.tobytes())


def kit(model_dir: Path) -> Kit:
    processor = hf_loaded.image_processor(model_dir)
    family = families.load(model_dir, frozenset(processor.model_input_names))
    tokenizer = hf_loaded.tokenizer(model_dir)
    return Kit(model_dir, family, tokenizer, processor, PromptBuilder(family, tokenizer))


def admit(model_dir: Path, message: scheduler_pb2.GenerateRequest, **settings: Any) -> Any:
    """The scheduler's admission checks on `message`, under `settings`
    (SchedulerSettings fields), before the queue: the request, or what they raise."""
    from scheduler_svc.frontend import Frontend
    from scheduler_svc.settings import SchedulerSettings

    frontend = Frontend(None, SchedulerSettings(model_dir=model_dir, **settings), _infos(model_dir))  # type: ignore[arg-type]
    request = frontend._validate(message)
    frontend._check_prefill(request)
    return request


_info_cache: dict[Path, Any] = {}


def _infos(model_dir: Path) -> Any:
    from scheduler_svc.model import model_info

    if model_dir not in _info_cache:
        _info_cache[model_dir] = model_info(model_dir)
    return _info_cache[model_dir]
