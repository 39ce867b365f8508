"""Troublesome videos, made at test time (no binary files in git).

`corpus()` gives each case's bytes and its documented outcome (README
"Video"): an ErrorInfo reason, or "ok" for odd-but-valid videos that must
work. The limits they are judged by are the tokenizer's defaults.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

from mmsplit_cli import samples
from tests.support.bad_videos import resized_midstream


@dataclass(frozen=True)
class Case:
    name: str
    expected: str  # "ok" or an ErrorInfo reason
    data: bytes


def zero_frames() -> bytes:
    """An MP4 whose video track was started and closed with no frame."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=6)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"  # type: ignore[union-attr]
        out.start_encoding()
    return buf.getvalue()


def huge_declared_size() -> bytes:
    """An MPEG-2 stream whose sequence header claims 4095x4095 frames (the
    pixels that follow are 96x64): refused from the header, before decoding."""
    data = samples.video(container="mpegts", codec="mpeg2video", width=96, height=64)
    at = data.index(b"\x00\x00\x01\xb3") + 4
    return data[:at] + b"\xff\xff\xff" + data[at + 3 :]


def corpus() -> list[Case]:
    clip = samples.video(frames=12)
    webm = samples.video(container="webm", codec="libvpx-vp9")
    playlist = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n"
    return [
        Case("short clip (H.264 in MP4)", "ok", clip),
        Case("one frame", "ok", samples.video(frames=1)),
        Case("variable frame rate", "ok", samples.video(frames=10, frame_ms=[50, 400])),
        Case("VP9 in WebM", "ok", webm),
        Case("with an audio track", "ok", samples.video(audio=True)),
        Case("MPEG-4 Part 2 in AVI", "ok", samples.video(container="avi", codec="mpeg4")),
        Case("empty", "MEDIA_DECODE_FAILED", b""),
        Case("truncated MP4", "MEDIA_DECODE_FAILED", clip[: len(clip) // 2]),
        Case("truncated WebM", "MEDIA_DECODE_FAILED", webm[: len(webm) * 2 // 3]),
        Case("zero frames", "MEDIA_DECODE_FAILED", zero_frames()),
        Case("huge declared frame size", "MEDIA_TOO_LARGE", huge_declared_size()),
        Case("longer than the limit (800 s)", "MEDIA_TOO_LARGE", samples.video(frames=20, fps=Fraction(1, 40))),
        # Headers that understate a frame (64x64 declared, one 4096x4096 frame):
        # refused by the decoder's own limit (tests/tokenizer/test_video_bounds.py
        # measures the memory).
        *(
            Case(f"a frame larger than declared ({codec})", "MEDIA_TOO_LARGE", resized_midstream(codec, big=4096, at=1))
            for codec in ("mjpeg", "h264", "vp9")
        ),
        Case("wrong container (a PNG)", "MEDIA_UNSUPPORTED", samples.good_png()),
        Case("random bytes", "MEDIA_UNSUPPORTED", bytes(range(256)) * 8),
        Case("audio only (M4A)", "MEDIA_UNSUPPORTED", samples.audio_only()),
        Case("unaccepted codec (FFV1)", "MEDIA_UNSUPPORTED", samples.video(container="matroska", codec="ffv1")),
        Case("playlist naming a local file", "MEDIA_UNSUPPORTED", playlist),
    ]
