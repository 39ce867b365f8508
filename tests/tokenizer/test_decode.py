"""The decode boundary: every failure is one of our three media errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from mmsplit_cli import samples
from tokenizer_svc.decode import decode_image
from tokenizer_svc.errors import MediaDecodeFailed, MediaTooLarge, MediaUnsupported

LIMIT = 10_000_000


def encode(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_good_images_decode_to_rgb() -> None:
    for data in (samples.good_png(), samples.good_jpeg()):
        im = decode_image(data, max_pixels=LIMIT)
        assert im.mode == "RGB"
        assert im.size == (640, 480)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", MediaDecodeFailed),
        (samples.corrupt_png(), MediaDecodeFailed),
        (samples.good_png()[:200], MediaDecodeFailed),
        (samples.good_jpeg()[:300], MediaDecodeFailed),
        (b"<html><body>not an image</body></html>", MediaUnsupported),
        (bytes(range(256)) * 8, MediaUnsupported),
        (b'<svg xmlns="http://www.w3.org/2000/svg"></svg>', MediaUnsupported),
    ],
)
def test_bad_bytes_get_typed_errors(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_image(data, max_pixels=LIMIT)


def test_pixel_limit_is_checked_before_decoding() -> None:
    big = encode(Image.new("L", (4000, 3000)), "PNG")
    with pytest.raises(MediaTooLarge):
        decode_image(big, max_pixels=1_000_000)


def test_transparency_is_composited_over_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    im = decode_image(encode(rgba, "PNG"), max_pixels=LIMIT)
    assert im.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_an_rgb_image_comes_back_whole_and_readable(fmt: str) -> None:
    """RGB needing no turn is returned as decoded, not copied: its pixels
    must still be there (closing a PIL image drops them)."""
    data = encode(samples.gradient(64, 48), fmt)
    out = decode_image(data, max_pixels=LIMIT)
    with Image.open(io.BytesIO(data)) as reference:
        expected = np.asarray(reference.convert("RGB"))
    assert np.array_equal(np.asarray(out), expected)


def test_an_animated_rgb_webp_gives_its_first_frame_readable() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], lossless=True)
    out = decode_image(buf.getvalue(), max_pixels=LIMIT)
    assert out.mode == "RGB"
    assert out.getpixel((4, 4)) == (255, 0, 0)


def test_sixteen_bit_grayscale_keeps_its_range() -> None:
    arr = np.full((4, 4), 40000, dtype=np.uint16)
    im = decode_image(encode(Image.fromarray(arr), "PNG"), max_pixels=LIMIT)
    assert im.getpixel((0, 0)) == (156, 156, 156)  # 40000 >> 8


def test_exif_orientation_is_applied() -> None:
    im = Image.new("RGB", (40, 20), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    out = decode_image(encode(im, "JPEG", exif=exif.tobytes()), max_pixels=LIMIT)
    assert out.size == (20, 40)


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    r, g, _ = decode_image(buf.getvalue(), max_pixels=LIMIT).getpixel((0, 0))
    assert r > 200
    assert g < 50
