"""Images made on the spot for the demo and the tests (no binary files in git)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def gradient(width: int = 640, height: int = 480, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 32, size=base.shape)
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")


def encode(image: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def good_png(seed: int = 0) -> bytes:
    return encode(gradient(seed=seed), "PNG")


def good_jpeg(seed: int = 0) -> bytes:
    return encode(gradient(seed=seed), "JPEG", quality=90)


def corrupt_png() -> bytes:
    """A PNG whose header (signature, IHDR) is valid, so `Image.open` succeeds,
    but whose IDAT holds garbage that is not a zlib stream: decoding the
    pixels fails."""
    png = good_png()
    pos = png.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", png[pos : pos + 4])
    garbage = bytes((i * 37 + 11) % 256 for i in range(length))
    chunk = b"IDAT" + garbage
    crc = struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF)  # a valid CRC: only the pixels are bad
    return png[:pos] + struct.pack(">I", length) + chunk + crc + png[pos + 12 + length :]
