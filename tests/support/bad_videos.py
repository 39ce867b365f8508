"""Videos whose headers understate their frames (the hostile review's M1):
a stream declared 64x64 that carries one frame of another size, encoded
apart and muxed into it, as MJPEG (a size in every packet), H.264 (a new
SPS mid-stream) and VP9 (any keyframe may change size) can."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

# codec -> (container, encoder options)
KINDS = {
    "mjpeg": ("avi", {}),
    "h264": ("mpegts", {"preset": "ultrafast", "tune": "zerolatency"}),
    "vp9": ("matroska", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}),
}
ENCODERS = {"mjpeg": "mjpeg", "h264": "libx264", "vp9": "libvpx-vp9"}
SMALL = 64


def _context(codec: str, side: int) -> av.CodecContext:
    context = av.CodecContext.create(ENCODERS[codec], "w")
    context.width = context.height = side
    context.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    context.time_base = Fraction(1, 10)
    context.framerate = Fraction(10)
    context.options = dict(KINDS[codec][1])
    return context


def _packets(codec: str, side: int, count: int, first_pts: int) -> list[av.Packet]:
    context = _context(codec, side)
    out = []
    for i in range(count):
        pixels = np.full((side, side, 3), (40 * (first_pts + i)) % 255, np.uint8)
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format=context.pix_fmt)
        frame.pts = first_pts + i
        frame.time_base = context.time_base
        out.extend(context.encode(frame))
    out.extend(context.encode(None))
    return out


def resized_midstream(codec: str, *, big: int, at: int, frames: int = 8) -> bytes:
    """`frames` frames of SMALL x SMALL, the one at index `at` big x big."""
    container_format = KINDS[codec][0]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as out:
        stream = out.add_stream(ENCODERS[codec], rate=10)
        stream.width = stream.height = SMALL
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.time_base = Fraction(1, 10)
        runs = [(SMALL, at, 0), (big, 1, at), (SMALL, frames - at - 1, at + 1)]
        for side, count, first in runs:
            if not count:
                continue
            for packet in _packets(codec, side, count, first):
                packet.stream = stream
                packet.time_base = Fraction(1, 10)
                out.mux(packet)
    return buffer.getvalue()
