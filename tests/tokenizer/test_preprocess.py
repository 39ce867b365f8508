"""The worker's image path gives the tensors the model's own processor gives:
with the RGB copy skipped (`rgb_as_is`), with the resize and lookup
shortcuts (`pil_shortcuts`), and as an image's rows of one frame that the
scheduler repeats (`Family.image_options`, `Family.full_rows`)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, BatchFeature

from mmsplit_cli import samples
from mmsplit_server import families
from tokenizer_svc import pil_shortcuts
from tokenizer_svc.decode import decode_image
from tokenizer_svc.preprocess import pixels_as, rgb_as_is


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


# Round trips each family skips per image with `pil_shortcuts`: its copy of
# the decoded image made into a PIL image again (LLaVA-NeXT: best-fit grid
# and base image), and "resizes" to the same size (NeXT: base image and every
# 336x336 patch, at least 3 for the pictures below; InternVL: its resize to
# the tile grid and its thumbnail). Every family rescales and normalizes by
# lookup, once per image (NeXT: once per patch; InternVL: once per tile).
SHORTCUTS = {"llava": (1, 0), "llava-next": (2, 3), "qwen2-vl": (1, 0), "qwen2.5-vl": (1, 0), "qwen3-vl": (1, 0),
             "internvl": (2, 0)}  # fmt: skip


@pytest.mark.parametrize("family", list(SHORTCUTS))
def test_the_shortcuts_change_no_tensor(family: str, family_models: Callable[[str], Path]) -> None:
    processor = AutoImageProcessor.from_pretrained(family_models(family))
    assert pil_shortcuts.install(processor)
    # The family's own keywords, as the workers call it (InternVL: its tiles).
    own = families.load(family_models(family), frozenset(processor.model_input_names)).image_options(one_frame=False)
    pictures = [
        samples.encode(samples.gradient(1920, 1080, seed=4), "JPEG", quality=90),
        samples.encode(samples.gradient(640, 480, seed=5), "JPEG", quality=90),
        samples.encode(samples.gradient(300, 500, seed=3), "PNG"),
        samples.encode(samples.gradient(336, 336, seed=6), "PNG"),
    ]
    from_decoded, same_size = SHORTCUTS[family]
    for data in pictures:
        image = decode_image(data, max_pixels=40_000_000)
        before = dict(pil_shortcuts.skipped)
        with pil_shortcuts.processing():
            fast = processor(images=image, return_tensors="np", **rgb_as_is(image), **own)
        taken = {kind: pil_shortcuts.skipped[kind] - before[kind] for kind in before}
        stock = processor(images=image, return_tensors="np", **rgb_as_is(image), **own)  # outside: stock
        assert pil_shortcuts.skipped == before | {k: before[k] + taken[k] for k in taken}, "a shortcut outside"
        assert taken["from_decoded"] == from_decoded, image.size
        assert taken["same_size"] >= same_size, image.size
        patches = {"llava-next": fast["pixel_values"].shape[1], "internvl": fast["pixel_values"].shape[0]}.get(
            family, 1
        )
        assert taken["looked_up"] == patches, image.size
        _assert_same(fast, stock)
    # Edges: sizes where a shortcut may or may not apply, a 3x3 image (its
    # array's shape reads either way), extreme aspect ratios, a grayscale
    # image and an EXIF-rotated photo (both RGB once decoded).
    rng = np.random.default_rng(0)
    edges = [_png(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in ((1, 1), (3, 3), (4000, 100), (17, 999))]
    edges += [_png(rng.integers(0, 255, (200, 300), dtype=np.uint8)), _rotated_jpeg(rng)]
    for data in edges:
        image = decode_image(data, max_pixels=40_000_000)
        with pil_shortcuts.processing():
            fast = processor(images=image, return_tensors="np", **rgb_as_is(image), **own)
        _assert_same(fast, processor(images=image, return_tensors="np", **rgb_as_is(image), **own))
    # Rescale or normalize turned off by the call (or a checkpoint's
    # config): no lookup, the stock steps.
    image = decode_image(pictures[1], max_pixels=40_000_000)
    for off in ({"do_normalize": False}, {"do_rescale": False}):
        before = pil_shortcuts.skipped["looked_up"]
        with pil_shortcuts.processing():
            fast = processor(images=image, return_tensors="np", **rgb_as_is(image), **own, **off)
        assert pil_shortcuts.skipped["looked_up"] == before, off
        _assert_same(fast, processor(images=image, return_tensors="np", **rgb_as_is(image), **own, **off))


@pytest.mark.parametrize("family", ["llava", "llava-next", "qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_an_image_s_rows_of_one_frame_repeated_are_the_processor_s_rows(
    family: str, family_models: Callable[[str], Path]
) -> None:
    """Qwen's rows hold a still image's frame `temporal_patch_size` times;
    rows of one frame, repeated by the scheduler, are those rows exactly,
    and either form passes the family's count (nothing else does). Families
    whose rows hold the frame once keep their rows as they are."""
    model_dir = family_models(family)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    fam = families.load(model_dir, frozenset(processor.model_input_names))
    options = fam.image_options(one_frame=True)
    assert fam.image_options(one_frame=False) == {}
    if not family.startswith("qwen"):
        assert (fam.image_frames, options) == (1, {})
        return
    assert (fam.image_frames, options) == (2, {"temporal_patch_size": 1})
    pictures = [
        samples.encode(samples.gradient(1920, 1080, seed=4), "JPEG", quality=90),
        samples.encode(samples.gradient(300, 500, seed=3), "PNG"),
        samples.good_png(),
    ]
    pil_shortcuts.install(processor)
    for data in pictures:
        image = decode_image(data, max_pixels=40_000_000)
        with pil_shortcuts.processing():  # as the workers make them
            one = processor(images=image, return_tensors="np", **rgb_as_is(image), **options)
        stock = processor(images=image, return_tensors="np")
        rows, full = np.asarray(one["pixel_values"]), np.asarray(stock["pixel_values"])
        assert rows.shape == (full.shape[0], full.shape[1] // 2), image.size
        assert np.array_equal(np.asarray(one["image_grid_thw"]), np.asarray(stock["image_grid_thw"]))
        shapes = {"pixel_values": rows.shape}
        assert fam.one_frame_rows(families.IMAGE, shapes)
        assert not fam.one_frame_rows(families.IMAGE, {"pixel_values": full.shape})
        repeated = fam.full_rows(families.IMAGE, "pixel_values", torch.from_numpy(rows))
        assert torch.equal(repeated, torch.from_numpy(full)), image.size
        whole = torch.from_numpy(full)
        assert fam.full_rows(families.IMAGE, "pixel_values", whole) is whole
        side = {"image_grid_thw": np.asarray(stock["image_grid_thw"])}
        count = fam.count(families.IMAGE, {"pixel_values": full.shape}, side)
        assert fam.count(families.IMAGE, shapes, side) == count
        for width in (full.shape[1] // 4, full.shape[1] // 2 + 1, full.shape[1] * 2):
            with pytest.raises(families.BadItem, match="must have shape"):
                fam.count(families.IMAGE, {"pixel_values": (full.shape[0], width)}, side)
        # A video's rows never are one frame's: its patches hold two frames.
        assert not fam.one_frame_rows(families.VIDEO, {"pixel_values_videos": rows.shape})
        with pytest.raises(families.BadItem, match="must have shape"):
            fam.count(families.VIDEO, {"pixel_values_videos": rows.shape}, {"video_grid_thw": side["image_grid_thw"]})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pixels_in_the_model_s_dtype_are_the_values_a_rank_would_cast_to(dtype: str) -> None:
    """`pixels_as`: what a scheduler whose model runs in float16 or bfloat16
    is sent instead of float32 rows; bit for bit the rank's own cast
    (`torch.Tensor.to`), ties, subnormals and values past the type's range
    included, bfloat16 as its bits."""
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, -1e-8, 6.1e-5, 3.0e38, 1.00390625, 1.005859375, -2.017578125]
    values = np.concatenate([rng.normal(0, 2, 4096), np.array(edges)]).astype(np.float32).reshape(-1, 4)
    rows, name = pixels_as(values, dtype)
    expected = torch.from_numpy(values).to(getattr(torch, dtype))
    assert name == dtype
    assert rows.shape == values.shape
    assert rows.nbytes == values.nbytes // 2
    got = torch.from_numpy(rows).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(rows)
    assert got.dtype == expected.dtype
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    same, same_name = pixels_as(values, "float32")
    assert same_name == "float32"
    assert np.array_equal(same, values)


def _assert_same(fast: Any, stock: Any) -> None:
    assert fast.keys() == stock.keys()
    for name in stock:
        assert np.array_equal(np.asarray(fast[name]), np.asarray(stock[name])), name
        assert np.asarray(fast[name]).dtype == np.asarray(stock[name]).dtype, name


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _rotated_jpeg(rng: np.random.Generator) -> bytes:
    """A 200x120 JPEG whose EXIF says: turn 90 degrees (decoded as 120x200)."""
    image = Image.fromarray(rng.integers(0, 255, (120, 200, 3), dtype=np.uint8))
    exif = image.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif.tobytes())
    return buffer.getvalue()


def test_an_image_the_processor_converts_is_not_resized_from_the_decoded_one(
    family_models: Callable[[str], Path],
) -> None:
    """With a transparency key the processor composites first: its array is
    not the decoded image, so that image must not stand in for it."""
    processor = AutoImageProcessor.from_pretrained(family_models("llava"))
    pil_shortcuts.install(processor)
    image = decode_image(_png_with_a_transparent_colour(), max_pixels=40_000_000)
    before = pil_shortcuts.skipped["from_decoded"]
    with pil_shortcuts.processing():
        fast = processor(images=image, return_tensors="np", **rgb_as_is(image))
    assert pil_shortcuts.skipped["from_decoded"] == before
    stock = processor(images=image, return_tensors="np")
    assert np.array_equal(fast["pixel_values"], stock["pixel_values"])


def test_a_processor_whose_rescale_does_not_lead_to_its_normalize_gets_the_stock_rescale(
    family_models: Callable[[str], Path],
) -> None:
    """Steps other than the known ones (here a rescale with no normalize
    after it, though normalizing is on): the call is made again with the
    stock steps rather than hand on unscaled pixels."""
    processor = AutoImageProcessor.from_pretrained(family_models("llava"))

    def rescale_only(images: list[np.ndarray], **kwargs: Any) -> BatchFeature:
        pixels = [processor.rescale(im, kwargs["rescale_factor"]) for im in images]
        return BatchFeature({"pixel_values": pixels}, tensor_type="np")

    processor._preprocess = rescale_only
    image = decode_image(samples.good_jpeg(seed=3), max_pixels=40_000_000)
    stock = processor(images=image, return_tensors="np")
    assert stock["pixel_values"].dtype == np.float32
    assert pil_shortcuts.install(processor)
    with pil_shortcuts.processing():
        fast = processor(images=image, return_tensors="np")
    _assert_same(fast, stock)
