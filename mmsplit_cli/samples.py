"""Images made on the spot for the demo and the tests (no binary files in git)."""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction
from typing import Any

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


def video(
    frames: int = 12,
    width: int = 96,
    height: int = 64,
    fps: int | Fraction = 6,
    *,
    container: str = "mp4",
    codec: str = "libx264",
    seed: int = 0,
    frame_ms: list[int] | None = None,
    audio: bool = False,
) -> bytes:
    """A small encoded video of moving blocks, made with PyAV in memory.
    `frame_ms` gives each frame's duration (a variable frame rate); `audio`
    adds a short tone track."""
    import av

    rng = np.random.default_rng(seed)
    colors = rng.integers(0, 255, (4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        odd = width % 2 or height % 2  # 4:2:0 needs even sizes
        stream.pix_fmt = {"ffv1": "yuv444p", "mjpeg": "yuvj420p"}.get(codec, "yuv444p" if odd else "yuv420p")
        ms = Fraction(1, 1000)
        if frame_ms is not None:
            stream.codec_context.time_base = ms
        sound = out.add_stream("aac", rate=8000) if audio else None
        t = 0
        for i in range(frames):
            pixels = np.zeros((height, width, 3), dtype=np.uint8)
            pixels[:] = colors[i % 4]
            x = (i * 7) % max(1, width - 16)
            pixels[height // 4 : height // 4 + 16, x : x + 16] = 255 - colors[(i + 1) % 4]
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if frame_ms is not None:
                frame.pts, frame.time_base = t, ms
                t += frame_ms[i % len(frame_ms)]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _tone(out, sound, seconds=float(frames / fps))
    return buf.getvalue()


def audio_only(seconds: float = 1.0) -> bytes:
    """An AAC track in an MP4 (M4A) container: no video stream."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        _tone(out, out.add_stream("aac", rate=8000), seconds=seconds)
    return buf.getvalue()


def _tone(out: object, stream: object, *, seconds: float) -> None:
    import av

    rate = 8000
    samples = (np.sin(np.arange(int(rate * seconds)) * 2 * np.pi * 440 / rate) * 0.3).astype(np.float32)
    for start in range(0, len(samples), 1024):
        chunk = samples[start : start + 1024]
        frame = av.AudioFrame.from_ndarray(chunk[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):  # type: ignore[attr-defined]
            out.mux(packet)  # type: ignore[attr-defined]
    for packet in stream.encode():  # type: ignore[attr-defined]
        out.mux(packet)  # type: ignore[attr-defined]
