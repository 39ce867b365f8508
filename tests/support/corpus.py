"""A corpus of troublesome media, made at test time (no binary files in git).

`corpus()` returns cases of bytes (or a URL) with the documented outcome: an
ErrorInfo reason, or "ok" for unusual-but-valid images that must work. The
rules behind the outcomes are in README.md ("Media rules").
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmsplit_cli import samples


@dataclass(frozen=True)
class Case:
    name: str
    expected: str  # "ok" or an ErrorInfo reason
    data: bytes = b""
    url: str = ""


def _enc(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)


def png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG header (valid CRCs) claiming a size, with one tiny IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + _png_chunk(b"IEND", b"")
    )


def bomb_png(side: int = 12000) -> bytes:
    """A real, fully valid grayscale PNG of side x side zero pixels: a few KB
    compressed, `side`² bytes decompressed."""
    raw = zlib.compress(b"\0" * (side + 1) * side, 9)  # one filter byte per row
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", raw) + _png_chunk(b"IEND", b"")


def _bad_crc_png() -> bytes:
    png = bytearray(samples.good_png())
    ihdr_crc = 8 + 4 + 4 + 13  # signature, length, type, IHDR payload
    png[ihdr_crc] ^= 0xFF
    return bytes(png)


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


def _exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return _enc(samples.gradient(64, 32), "JPEG", exif=exif.tobytes())


def _palette_with_transparency() -> bytes:
    im = Image.new("P", (32, 32), 0)
    im.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    im.info["transparency"] = 0
    return _enc(im, "PNG", transparency=0)


def corpus() -> list[Case]:
    png, jpeg = samples.good_png(), samples.good_jpeg()
    gif = _enc(samples.gradient(64, 48).convert("P"), "GIF")
    webp = _enc(samples.gradient(64, 48), "WEBP")
    tiff = _enc(samples.gradient(64, 48), "TIFF")
    rng = np.random.default_rng(7)
    return [
        # Not decodable: MEDIA_DECODE_FAILED.
        Case("zero bytes", "MEDIA_DECODE_FAILED", data=b""),
        Case("PNG signature only", "MEDIA_DECODE_FAILED", data=png[:8]),
        Case("PNG truncated after the header", "MEDIA_DECODE_FAILED", data=png[:100]),
        Case("PNG truncated in half", "MEDIA_DECODE_FAILED", data=png[: len(png) // 2]),
        Case("PNG header valid, pixels corrupt", "MEDIA_DECODE_FAILED", data=samples.corrupt_png()),
        Case("PNG with a bad CRC", "MEDIA_DECODE_FAILED", data=_bad_crc_png()),
        Case("JPEG truncated", "MEDIA_DECODE_FAILED", data=jpeg[: len(jpeg) // 3]),
        Case("JPEG start-of-image marker only", "MEDIA_DECODE_FAILED", data=jpeg[:4]),
        Case("GIF truncated", "MEDIA_DECODE_FAILED", data=gif[: len(gif) // 2]),
        Case("WebP truncated", "MEDIA_DECODE_FAILED", data=webp[: len(webp) // 2]),
        Case("TIFF truncated", "MEDIA_DECODE_FAILED", data=tiff[: len(tiff) // 2]),
        # Not an image we accept: MEDIA_UNSUPPORTED.
        Case("random bytes", "MEDIA_UNSUPPORTED", data=rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()),
        Case("plain text", "MEDIA_UNSUPPORTED", data=b"just some words, not an image\n" * 10),
        Case(
            "HTML posing as an image", "MEDIA_UNSUPPORTED", data=b"<!DOCTYPE html><html><body><img src=x></body></html>"
        ),
        Case("SVG", "MEDIA_UNSUPPORTED", data=b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'),
        Case("PDF", "MEDIA_UNSUPPORTED", data=b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF"),
        Case("ICO (a format not accepted)", "MEDIA_UNSUPPORTED", data=_enc(Image.new("RGB", (16, 16)), "ICO")),
        Case("1x20000 strip (aspect ratio)", "MEDIA_UNSUPPORTED", data=_enc(Image.new("L", (1, 20000)), "PNG")),
        # Too big: MEDIA_TOO_LARGE.
        Case("header claiming 100000x100000", "MEDIA_TOO_LARGE", data=png_claiming(100_000, 100_000)),
        Case("decompression bomb (12000² zeros)", "MEDIA_TOO_LARGE", data=bomb_png()),
        Case("over the byte limit", "MEDIA_TOO_LARGE", data=b"\x89PNG" + b"\0" * (21 * 1024 * 1024)),
        # Where the bytes come from.
        Case("data: URL that is not base64", "INVALID_REQUEST", url="data:image/png;base64,***"),
        Case("ftp:// URL", "MEDIA_SOURCE_FORBIDDEN", url="ftp://example.invalid/cat.png"),
        Case("path outside the allowed directory", "MEDIA_SOURCE_FORBIDDEN", url="/etc/hostname"),
        Case("file that does not exist", "MEDIA_NOT_FOUND", url="no-such-file.png"),
        # Unusual but valid: must work.
        Case("1x1 pixel", "ok", data=_enc(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG")),
        Case("16-bit grayscale PNG", "ok", data=_enc(Image.fromarray(np.full((32, 32), 50000, np.uint16)), "PNG")),
        Case("CMYK JPEG", "ok", data=_enc(samples.gradient(48, 32).convert("CMYK"), "JPEG")),
        Case("palette with transparency", "ok", data=_palette_with_transparency()),
        Case("RGBA PNG", "ok", data=_enc(samples.gradient(48, 32).convert("RGBA"), "PNG")),
        Case("LA (gray + alpha) PNG", "ok", data=_enc(samples.gradient(48, 32).convert("LA"), "PNG")),
        Case("bilevel (mode 1) PNG", "ok", data=_enc(samples.gradient(48, 32).convert("1"), "PNG")),
        Case("animated GIF (first frame)", "ok", data=_animated_gif()),
        Case("EXIF-rotated JPEG", "ok", data=_exif_rotated_jpeg()),
        Case("progressive JPEG", "ok", data=_enc(samples.gradient(64, 48), "JPEG", progressive=True)),
        Case("WebP", "ok", data=webp),
        Case("TIFF", "ok", data=tiff),
        Case(
            "PNG sent as a data: URL declaring image/jpeg",
            "ok",
            url="data:image/jpeg;base64," + base64.b64encode(png).decode(),
        ),
    ]
