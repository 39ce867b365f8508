from __future__ import annotations

from pathlib import Path

import pytest

from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.prompt import PromptBuilder


@pytest.fixture(scope="module")
def processor(tiny_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model)


def test_markers_expand_to_one_token_per_patch(processor) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(processor)
    assert builder.tokens_per_image((3, 224, 224)) == 64
    ids = builder.build("<image> then <image>", [(3, 224, 224), (3, 224, 224)])
    assert ids[0] == processor.tokenizer.bos_token_id
    assert ids.count(builder.image_token_id) == 128
    # The HF processor expands the same prompt to the same ids.
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    hf = processor(images=[img, img], text="<image> then <image>", return_tensors="np")["input_ids"][0].tolist()
    assert ids[1:] == [t for t in hf if t != processor.tokenizer.bos_token_id]


def test_images_without_markers_go_first(processor) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(processor)
    ids = builder.build("hello", [(3, 224, 224)])
    assert ids[1 : 1 + 64] == [builder.image_token_id] * 64


def test_marker_count_mismatch_is_invalid(processor) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest):
        PromptBuilder(processor).build("<image><image>", [(3, 224, 224)])
