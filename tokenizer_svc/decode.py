"""Decoding untrusted image bytes into an RGB PIL image (runs in a CPU worker).

The one boundary where PIL's exceptions become ours. Rules:
- the pixel count is checked from the header, before any pixel is decoded;
- the image is decoded eagerly (`load()`), so lazy-decode failures surface here;
- EXIF orientation is applied;
- animated images (GIF, WebP, APNG): the first frame is used;
- bytes that start like an accepted format but do not open are
  MEDIA_DECODE_FAILED; bytes of no accepted format are MEDIA_UNSUPPORTED;
- transparency is composited over white; 16-bit and other modes become RGB.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tokenizer_svc.errors import MediaDecodeFailed, MediaTooLarge, MediaUnsupported

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
BACKGROUND = (255, 255, 255)


def decode_image(data: bytes, *, max_pixels: int, check: Callable[[int, int], None] | None = None) -> Image.Image:
    """`data` decoded as an RGB image. `check`: called with the width and
    height the header states, once they are within `max_pixels` and before
    any pixel is decoded; what it raises goes to the caller."""
    if not data:
        raise MediaDecodeFailed("image is empty (0 bytes)")
    # PIL's own bomb guard raises at 2x its limit and only warns below it; ours
    # is explicit, so make PIL's agree with it.
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
            rgb: Image.Image | None = None
            try:
                width, height = im.size
                if width <= 0 or height <= 0:
                    raise MediaDecodeFailed(f"image claims size {width}x{height}")
                if width * height > max_pixels:
                    raise MediaTooLarge(f"image is {width}x{height} pixels, over the limit of {max_pixels}")
                if check is not None:
                    check(width, height)
                im.seek(0)
                im.load()
                # In place: without it an image that needs no turn is copied
                # whole (6 MB for a 1920x1080 photo, 2-4 % of a worker's time).
                ImageOps.exif_transpose(im, in_place=True)
                rgb = _to_rgb(im)
            finally:
                if rgb is not im:  # closing drops the pixels: only what is not returned
                    im.close()
    except (MediaDecodeFailed, MediaTooLarge, MediaUnsupported):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaTooLarge(f"decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        # PIL could not open it. If it starts like a format we accept, it is
        # a broken instance of that format; otherwise it is something else.
        fmt = sniff(data)
        if fmt is not None:
            raise MediaDecodeFailed(f"{fmt} data could not be decoded (corrupt or truncated header)") from exc
        raise MediaUnsupported(f"not an image in an accepted format ({', '.join(FORMATS)})") from exc
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error, IndexError, KeyError) as exc:
        raise MediaDecodeFailed(f"image could not be decoded: {type(exc).__name__}: {exc}") from exc
    except MemoryError as exc:
        raise MediaTooLarge("image needs more memory to decode than is available") from exc
    return rgb


_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)


def sniff(data: bytes) -> str | None:
    """The accepted format `data` claims to be by its magic bytes, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, fmt in _SIGNATURES:
        if data.startswith(magic):
            return fmt
    return None


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        return _scale16(im)
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    try:
        return im.convert("RGB")
    except ValueError as exc:
        raise MediaUnsupported(f"image mode {im.mode} cannot be converted to RGB") from exc


def _scale16(im: Image.Image) -> Image.Image:
    """16-bit grayscale (PIL modes I;16* and I) to 8 bits: keep the high byte
    rather than clipping everything above 255 to white."""
    arr = np.clip(np.asarray(im).astype(np.int64), 0, 65535) >> 8
    return Image.fromarray(arr.astype(np.uint8), "L").convert("RGB")
