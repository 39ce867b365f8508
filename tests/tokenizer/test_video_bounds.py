"""Video frames are bounded in the decoder, not after it (the hostile
review's M1): a stream declaring 64x64 that carries one frame far larger —
MJPEG (a size per packet), H.264 (a new SPS mid-stream), VP9 (a keyframe of
another size) — sampled or not, fails MEDIA_TOO_LARGE with the decoding
process's peak resident memory (VmHWM, reset before decoding) under 64
MiB above where it started. Each case runs
in a process of its own (peak memory only grows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bad_videos import resized_midstream
from tests.support.services import ROOT

LIMIT = 3840 * 2160  # the default --max-video-frame-pixels
BOUND_MIB = 64

DECODE = r"""
import json, sys, time
from tokenizer_svc import video
data = open(sys.argv[1], "rb").read()
limits = video.VideoLimits(
    max_pixels=int(sys.argv[2]), max_duration_s=600, max_frames=36000, deadline=time.monotonic() + 60
)
rule = video.Sampling(fps=2.0, min_frames=4, max_frames=8, temporal_patch_size=2)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])  # KiB
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from now
base = status("VmRSS")
try:
    video.decode_video(data, limits, rule)
    outcome = "ok"
except Exception as exc:
    outcome = getattr(exc, "reason", type(exc).__name__) + ": " + str(exc)
grew = (status("VmHWM") - base) / 1024
print(json.dumps({"outcome": outcome, "grew_mib": grew}))
"""


def decode(path: Path, limit: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", DECODE, str(path), str(limit)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("at", [0, 1], ids=["sampled", "not sampled"])
@pytest.mark.parametrize(("codec", "big"), [("mjpeg", 8000), ("h264", 8000), ("vp9", 4096)])
def test_a_frame_larger_than_declared_is_refused_before_its_memory(
    codec: str, big: int, at: int, tmp_path: Path
) -> None:
    path = tmp_path / f"{codec}.bin"
    path.write_bytes(resized_midstream(codec, big=big, at=at))
    got = decode(path, LIMIT)
    assert str(got["outcome"]).startswith("MEDIA_TOO_LARGE"), got
    assert f"{big}x{big}" in str(got["outcome"]), got
    assert float(got["grew_mib"]) < BOUND_MIB, got  # type: ignore[arg-type]


def test_the_bound_is_what_keeps_the_memory_down(tmp_path: Path) -> None:
    """The same MJPEG file with a limit that admits its big frame: decoded,
    at a cost over the bound (so the check above can fail)."""
    path = tmp_path / "mjpeg.bin"
    path.write_bytes(resized_midstream("mjpeg", big=8000, at=0))
    got = decode(path, 8000 * 8000)
    assert got["outcome"] == "ok", got
    assert float(got["grew_mib"]) > BOUND_MIB, got  # type: ignore[arg-type]
