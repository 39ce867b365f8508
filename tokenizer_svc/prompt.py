"""Prompt → token ids with image placeholders expanded."""

from __future__ import annotations

from typing import Any

from tokenizer_svc.errors import InvalidRequest


class PromptBuilder:
    """Expands each image marker into the number of image tokens the model
    expects for that image's pixel tensor (LLaVA: one per vision patch)."""

    def __init__(self, processor: Any) -> None:
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.patch_size: int = processor.patch_size
        self.extra_tokens: int = getattr(processor, "num_additional_image_tokens", 0) or 0
        self.drops_cls = getattr(processor, "vision_feature_select_strategy", "default") == "default"

    def tokens_per_image(self, shape: tuple[int, ...]) -> int:
        height, width = shape[-2], shape[-1]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens - int(self.drops_cls)

    def build(self, prompt: str, image_shapes: list[tuple[int, ...]]) -> list[int]:
        markers = prompt.count(self.image_token)
        if markers == 0 and image_shapes:
            prompt = f"{self.image_token}\n" * len(image_shapes) + prompt
        elif markers != len(image_shapes):
            raise InvalidRequest(
                f"the prompt has {markers} {self.image_token} marker(s) for {len(image_shapes)} image(s)"
            )
        parts = prompt.split(self.image_token)
        ids: list[int] = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        for i, part in enumerate(parts):
            if part:
                ids.extend(self.tokenizer.encode(part, add_special_tokens=False))
            if i < len(image_shapes):
                ids.extend([self.image_token_id] * self.tokens_per_image(image_shapes[i]))
        return ids
