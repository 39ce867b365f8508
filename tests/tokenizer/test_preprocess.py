"""The worker's image path gives the tensors the model's own processor gives."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from mmsplit_cli import samples
from tokenizer_svc.decode import decode_image
from tokenizer_svc.preprocess import rgb_as_is


def _png_with_a_transparent_colour() -> bytes:
    """An RGB PNG whose tRNS chunk makes one colour transparent: still mode
    RGB after decoding, and the processors composite that colour."""
    pixels = np.zeros((40, 60, 3), dtype=np.uint8)
    pixels[:, :30] = (10, 20, 30)
    pixels[:, 30:] = (200, 100, 50)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG", transparency=(10, 20, 30))
    return buffer.getvalue()


@pytest.mark.parametrize("family", ["llava", "llava-next", "qwen2-vl"])
def test_skipping_the_rgb_copy_changes_no_tensor(family: str, family_models: Callable[[str], Path]) -> None:
    processor = AutoImageProcessor.from_pretrained(family_models(family))
    pictures = [
        samples.encode(samples.gradient(1280, 720, seed=2), "JPEG", quality=90),
        samples.encode(samples.gradient(300, 500, seed=3), "PNG"),
        samples.good_png(),
    ]
    for data in pictures:
        image = decode_image(data, max_pixels=40_000_000)
        assert rgb_as_is(image) == {"do_convert_rgb": False}
        skipped = processor(images=image, return_tensors="np", **rgb_as_is(image))
        stock = processor(images=image, return_tensors="np")
        assert skipped.keys() == stock.keys()
        for name in stock:
            assert np.array_equal(np.asarray(skipped[name]), np.asarray(stock[name])), name
            assert np.asarray(skipped[name]).dtype == np.asarray(stock[name]).dtype, name


def test_an_rgb_image_with_a_transparency_key_is_left_to_the_processor() -> None:
    image = decode_image(_png_with_a_transparent_colour(), max_pixels=40_000_000)
    assert image.mode == "RGB"
    assert image.info.get("transparency") is not None
    assert rgb_as_is(image) == {}
