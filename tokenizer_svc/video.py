"""Decoding untrusted video bytes into sampled RGB frames (runs in a CPU worker).

The decoder is PyAV (FFmpeg's libraries, shipped inside the `av` wheel, so it
installs offline and needs no system FFmpeg). Rules:

- the bytes are read from memory: nothing is written to disk, so there is no
  temporary file to lose on a failure, a timeout, a cancel or a killed worker;
- only known containers are probed (FFmpeg's ``format_whitelist``, so a
  playlist or concat script that names other files or URLs is refused before
  it opens anything) and only the video codecs in `CODECS` are decoded;
- the limits are checked before pixels are decoded: the declared frame size,
  the declared duration and frame count, then a demux-only pass (no decoding)
  that counts the real packets and their timestamps;
- frames are sampled by `sample_indices` (documented there), and only the
  chosen frames are converted to RGB; a frame whose size differs from the
  first chosen one is scaled to it;
- the worker's deadline is checked between packets, so a slow video gives
  PREPROCESS_TIMEOUT and frees its worker instead of running on;
- bytes that look like an accepted container but do not open or decode are
  MEDIA_DECODE_FAILED; bytes of no accepted container, audio-only files and
  other codecs are MEDIA_UNSUPPORTED; over a limit is MEDIA_TOO_LARGE.

Rotation metadata is not applied: frames come as they are stored.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from PIL import Image

try:
    import av
    import av.logging
except ImportError:  # a pinned requirement; absent only where the wheel was not carried (the GPU checks)
    av = None  # type: ignore[assignment]

from tokenizer_svc.errors import MediaDecodeFailed, MediaTooLarge, MediaUnsupported, PreprocessTimeout

# Streams a video file may hold (each is probed when the file is opened).
MAX_STREAMS = 16
# What FFmpeg logs when a frame is over the decoder's max_pixels.
OVER_MAX_PIXELS = "exceeds specified max pixel count"

# FFmpeg demuxer names (the mov demuxer also reads mp4, m4v, 3gp, mj2).
CONTAINERS = ("mov", "matroska", "avi", "mpegts", "ogg", "flv")
CODECS = frozenset(
    {"h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4", "mpeg2video", "mpeg1video", "mjpeg", "theora"}
)


@dataclass(frozen=True)
class VideoLimits:
    max_pixels: int  # per frame, width x height
    max_duration_s: float
    max_frames: int  # frames in the file (not sampled frames)
    deadline: float  # time.monotonic() by which decoding must be done


@dataclass(frozen=True)
class Sampling:
    """Which frames become the item: `fps` per second of video, at least
    `min_frames` and at most `max_frames`, in multiples of
    `temporal_patch_size`; `how` the model family's rule
    (`Family.frame_sampling`: "stride", "spread" or "centered"; see
    `sample_indices`)."""

    fps: float
    min_frames: int
    max_frames: int
    temporal_patch_size: int
    how: str = "stride"


@dataclass
class Video:
    frames: list[Image.Image]
    indices: list[int]
    total_frames: int
    # Frames per second of the file (its average rate, else frames / duration).
    fps: float
    width: int
    height: int

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames (what transformers'
        VideoMetadata.sampled_fps gives; Qwen2.5-VL's time scale)."""
        return len(self.indices) / self.total_frames * self.fps

    def patch_times(self, temporal_patch_size: int) -> tuple[float, ...]:
        """The time in seconds of each temporal patch: the mean of its first
        and last frame's times (the last frame repeated to fill the final
        patch), as transformers' Qwen3-VL processor writes it before each
        frame's placeholders."""
        tps = temporal_patch_size
        indices = self.indices + [self.indices[-1]] * (-len(self.indices) % tps)
        return tuple((indices[i] + indices[i + tps - 1]) / 2 / self.fps for i in range(0, len(indices), tps))


def sample_indices(total: int, fps: float, rule: Sampling) -> list[int]:
    """The frames kept, by index. The rule of transformers' Qwen2-VL video
    processor (`sample_frames` with fps): ``n = total / fps * rule.fps``,
    raised to `min_frames`, capped at `max_frames` and at the frames there
    are, rounded down to a multiple of the temporal patch size; frame
    ``floor(i * total / n)`` for i < n (exact integers here, where transformers
    steps a float range). Videos with fewer frames than one temporal patch
    keep all of them (transformers fails on those); the model side repeats
    the last frame to fill the patch.

    "spread" (Qwen3-VL's video processor) and "centered" (InternVL's): ``n =
    int(total / fps * rule.fps)`` within the same bounds but not rounded to
    whole patches; "spread" from the first frame to the last (``round(i *
    (total - 1) / (n - 1))``, numpy's linspace rounded half to even),
    "centered" each in the middle of its n-th of the video (``floor((2i + 1)
    * total / 2n)``: transformers' ``arange(total / n / 2, total, total /
    n)`` with `initial_shift`, in exact integers; InternVL's own
    `get_index` picks the same middles)."""
    tps = rule.temporal_patch_size
    if rule.how in ("spread", "centered"):
        kept = min(max(int(total / fps * rule.fps) if fps > 0 else 0, rule.min_frames), rule.max_frames, total)
        if rule.how == "centered":
            return [(2 * i + 1) * total // (2 * kept) for i in range(kept)]
        if kept <= 1:
            return [0] * kept
        return [round(i * (total - 1) / (kept - 1)) for i in range(kept)]
    if total < tps:
        return list(range(total))
    cap = (min(rule.max_frames, total) // tps) * tps
    wanted = total / fps * rule.fps if fps > 0 else float(rule.min_frames)
    n = min(max(wanted, rule.min_frames), cap, total)
    n = max(tps, math.floor(n / tps) * tps)
    return [i * total // n for i in range(n)]


def decode_video(
    data: bytes,
    limits: VideoLimits,
    rule: Sampling,
    *,
    on_frame: Callable[[Image.Image], None] | None = None,
) -> Video:
    if av is None:
        raise MediaUnsupported("this server cannot decode video (PyAV is not installed)")
    if not data:
        raise MediaDecodeFailed("video is empty (0 bytes)")

    try:
        total, fps, width, height = _probe(data, limits)
        indices = sample_indices(total, fps, rule)
        frames, decoded = _frames(data, indices, limits, on_frame)
        if len(frames) < len(indices):
            # Fewer frames decoded than packets counted (a codec that packs
            # two fields or frames per packet, or a damaged stream): sample
            # again over the frames that really decode.
            if decoded == 0:
                raise MediaDecodeFailed("no frame of the video could be decoded")
            total = decoded
            indices = sample_indices(total, fps, rule)
            frames, _ = _frames(data, indices, limits, on_frame)
            if len(frames) < len(indices):
                raise MediaDecodeFailed("the video decodes differently on a second pass")
    except (MediaDecodeFailed, MediaTooLarge, MediaUnsupported, PreprocessTimeout):
        raise
    except MemoryError as exc:
        raise MediaTooLarge("the video needs more memory to decode than is available") from exc
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError, ZeroDivisionError) as exc:
        raise MediaDecodeFailed(f"video could not be decoded: {type(exc).__name__}: {exc}") from exc
    return Video(frames, indices, total, fps, width, height)


def _open(data: bytes, limits: VideoLimits) -> Any:
    try:
        # (PyAV's stubs type stream_options as strings; it takes a dict per stream.)
        container = av.open(  # type: ignore[call-overload]
            io.BytesIO(data),
            mode="r",
            options={"format_whitelist": ",".join(CONTAINERS)},
            # Opening decodes a few frames of each stream to learn their
            # parameters: under the frame-size limit too (by stream index;
            # a file with more streams than this is refused below).
            stream_options=[{"max_pixels": str(limits.max_pixels)}] * MAX_STREAMS,
            metadata_errors="ignore",
        )
    except (av.InvalidDataError, av.ArgumentError, av.FFmpegError) as exc:
        kind = sniff(data)
        if kind is not None:
            raise MediaDecodeFailed(f"{kind} data could not be opened (corrupt or truncated)") from exc
        raise MediaUnsupported(f"not a video in an accepted container ({', '.join(CONTAINERS)})") from exc
    return container


def _stream(container: Any, limits: VideoLimits) -> Any:
    if len(container.streams) > MAX_STREAMS:
        raise MediaUnsupported(f"the file holds {len(container.streams)} streams, over {MAX_STREAMS}")
    if not container.streams:
        raise MediaDecodeFailed("the file holds no streams (no frames)")
    if not container.streams.video:
        raise MediaUnsupported("the file has no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise MediaUnsupported(f"video codec {codec!r} is not accepted ({', '.join(sorted(CODECS))})")
    stream.codec_context.thread_count = 1  # one worker, one core
    # The frame-size limit inside the decoder: a frame over it (a size the
    # headers never declared: MJPEG carries one per packet, H.264 can send a
    # new SPS, VP9 can change size on any frame) fails before its buffer is
    # allocated, where a check after decoding came after the memory.
    stream.codec_context.options = {"max_pixels": str(limits.max_pixels)}
    return stream


def _probe(data: bytes, limits: VideoLimits) -> tuple[int, float, int, int]:
    """Checks on the headers, then a demux-only pass: (frames, fps, width, height)."""
    with _open(data, limits) as container:
        stream = _stream(container, limits)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width < 0 or height < 0:
            raise MediaDecodeFailed(f"video claims size {width}x{height}")
        if width * height > limits.max_pixels:
            raise MediaTooLarge(f"video frames are {width}x{height} pixels, over the limit of {limits.max_pixels}")
        declared = _seconds(stream.duration, stream.time_base)
        if declared is None and container.duration is not None:
            declared = container.duration / 1_000_000
        if declared is not None and declared > limits.max_duration_s:
            raise MediaTooLarge(f"video lasts {declared:.1f}s, over the limit of {limits.max_duration_s:g}s")
        if stream.frames > limits.max_frames:
            raise MediaTooLarge(f"video declares {stream.frames} frames, over the limit of {limits.max_frames}")
        count, first, last = 0, None, None
        for packet in container.demux(stream):
            _check_deadline(limits)
            if packet.size == 0:
                continue  # the demuxer's end-of-stream marker
            count += 1
            if count > limits.max_frames:
                raise MediaTooLarge(f"video holds over {limits.max_frames} frames")
            t = _seconds(packet.pts, packet.time_base)
            if t is not None:
                first = t if first is None else min(first, t)
                last = t if last is None else max(last, t)
                if last - first > limits.max_duration_s:
                    raise MediaTooLarge(f"video lasts over {limits.max_duration_s:g}s")
        if count == 0:
            raise MediaDecodeFailed("the video stream holds no frames")
        fps = float(stream.average_rate) if stream.average_rate else 0.0
        if fps <= 0 and first is not None and last is not None and last > first:
            fps = (count - 1) / (last - first)
        fps = fps or 1.0
        if declared is not None and first is not None and last is not None:
            # A streamable container (WebM, MPEG-TS) cut short still opens
            # and plays its first part; the duration its header declares
            # tells the cut (two frames or 5% of slack).
            covered = last - first + 1 / fps
            if covered < declared - max(2 / fps, 0.05 * declared):
                raise MediaDecodeFailed(
                    f"video is truncated: it holds {covered:.2f}s of the {declared:.2f}s it declares"
                )
        return count, fps, width, height


def _frames(
    data: bytes,
    indices: list[int],
    limits: VideoLimits,
    on_frame: Callable[[Image.Image], None] | None,
) -> tuple[list[Image.Image], int]:
    """The chosen frames as RGB images, and how many frames were decoded."""
    wanted = set(indices)
    frames: list[Image.Image] = []
    size: tuple[int, int] | None = None
    decoded = 0
    with _open(data, limits) as container:
        stream = _stream(container, limits)
        for frame in _decode(container, stream, limits):
            index, decoded = decoded, decoded + 1
            # Every frame, sampled or not (the decoder's own bound holds first).
            if frame.width * frame.height > limits.max_pixels:
                raise MediaTooLarge(f"a frame is {frame.width}x{frame.height} pixels, over {limits.max_pixels}")
            if index not in wanted:
                continue
            if size is None:
                size = (frame.width, frame.height)
            image = frame.to_image(width=size[0], height=size[1])
            if on_frame is not None:
                on_frame(image)
            # Repeated indices (fewer frames than samples) share one image.
            frames.extend([image] * indices.count(index))
            if len(frames) == len(indices):
                break
    return frames, decoded


def _decode(container: Any, stream: Any, limits: VideoLimits) -> Iterator[Any]:
    # FFmpeg says why it refused a frame only in its log: captured for the
    # whole decode (at ERROR, so a frame over the decoder's limit is named),
    # never passed on to the worker's stderr. Once per video, not per packet.
    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture() as logs:
            for packet in container.demux(stream):
                _check_deadline(limits)
                try:
                    frames = packet.decode()
                except av.FFmpegError as exc:
                    said = " ".join(message for _, _, message in logs) + str(exc)
                    if OVER_MAX_PIXELS in said:
                        size = said.split("Picture size ", 1)[-1].split(" ", 1)[0]
                        raise MediaTooLarge(f"a frame is {size} pixels, over the limit of {limits.max_pixels}") from exc
                    raise
                yield from frames
    finally:
        av.logging.set_level(level)


def _check_deadline(limits: VideoLimits) -> None:
    if time.monotonic() > limits.deadline:
        raise PreprocessTimeout("video decoding ran past its budget")


def _seconds(value: int | None, base: Fraction | None) -> float | None:
    if value is None or base is None:
        return None
    return float(value * base)


def sniff(data: bytes) -> str | None:
    """The accepted container `data` claims to be by its magic bytes, if any."""
    if data[4:8] == b"ftyp" or data[4:8] in (b"moov", b"mdat", b"free", b"wide"):
        return "MP4/QuickTime"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "Matroska/WebM"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    if data.startswith(b"OggS"):
        return "Ogg"
    if data.startswith(b"FLV"):
        return "FLV"
    if len(data) >= 377 and data[0] == data[188] == data[376] == 0x47:
        return "MPEG-TS"
    return None
