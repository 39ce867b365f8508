"""The model's image processor alone, as it comes against as the CPU
workers call it (`tokenizer_svc.pil_shortcuts`: no numpy round trip around
a resize, and rescale + normalize as one table lookup), in one process.
Three arms: stock, the resize shortcuts alone, and both.

For each family's processor (the tiny models' configurations, and Qwen2-VL
also at its real default pixel budget, 3,136 to 12,845,056 pixels, where a
photo keeps most of its pixels) and each JPEG size: the processor's time
per image in each arm, the arms called in turn --reps times and the
fastest call of each kept (this host's speed drifts within
seconds), and the tensors compared (they must be equal). Decoding is not
timed (both start from the same decoded image).

And a Qwen2-VL video at its default per-frame budget (100,352 to 602,112
pixels; a copy of the tiny model's directory with that budget): the rows
of a 640x480 clip of 8 and 20 sampled frames as the workers made them
before ("as images": each frame patchified as an image, its temporal copy
made and dropped), as `video_rows` makes them (each frame patchified as a
patch of one frame), and that with the shortcuts; the rows compared.

    python bench/processor_steps.py [--families llava,llava-next,qwen2-vl] [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MODELS_DIR, ROOT, build_model, scratch_dir, table

from mmsplit_cli import samples
from tokenizer_svc import pil_shortcuts
from tokenizer_svc.decode import decode_image
from tokenizer_svc.preprocess import rgb_as_is

SIZES = [(640, 480), (1280, 720), (1920, 1080)]
# Qwen2-VL's own preprocessor_config.json (min_pixels, max_pixels); the tiny
# models keep 50,176 at most, so their images are small whatever is sent.
QWEN_DEFAULT_BUDGET = {"shortest_edge": 3136, "longest_edge": 12845056}


def _call(processor: Any, image: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = processor(images=image, return_tensors="np", **rgb_as_is(image))
    return time.perf_counter() - start, out


def _fastest(arms: list[Any], image: Any, reps: int) -> list[float]:
    """The fastest of `reps` calls of each processor, called in turn (the
    first stock, the others within `processing()`); their tensors equal."""
    best = [float("inf")] * len(arms)
    for _ in range(reps):
        seconds, expected = _call(arms[0], image)
        best[0] = min(best[0], seconds)
        for i, processor in enumerate(arms[1:], 1):
            with pil_shortcuts.processing():
                seconds, got = _call(processor, image)
            best[i] = min(best[i], seconds)
            for name in expected:
                if not np.array_equal(np.asarray(got[name]), np.asarray(expected[name])):
                    raise AssertionError(f"{name} differs with the shortcuts")
    return best


def run(family_names: list[str], reps: int, workdir: Path) -> str:
    from transformers import AutoImageProcessor

    pictures = {
        size: decode_image(samples.encode(samples.gradient(*size, seed=i), "JPEG", quality=90), max_pixels=10**8)
        for i, size in enumerate(SIZES)
    }
    configs: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in family_names]
    if "qwen2-vl" in family_names:
        configs.append(("qwen2-vl", {"size": QWEN_DEFAULT_BUDGET}))
    rows = []
    for name, options in configs:
        model = _model(name, workdir)
        arms = [AutoImageProcessor.from_pretrained(model, **options) for _ in range(3)]
        if not (pil_shortcuts.install(arms[1], lookup=False) and pil_shortcuts.install(arms[2])):
            raise SystemExit(f"{name}: not a PIL-backend processor")
        label = name + (", default budget" if options else "")
        totals = [0.0, 0.0, 0.0]
        for (w, h), image in pictures.items():
            best = _fastest(arms, image, reps)
            totals = [t + b for t, b in zip(totals, best, strict=True)]
            rows.append([label, f"{w}x{h}", *_figures(best)])
        rows.append([label, "all three", *_figures(totals)])
    header = ["processor", "JPEG", "stock ms", "resizes ms", "+ lookup ms", "lookup / resizes", "both / stock"]
    return f"the image processor alone, fastest of {reps} calls each, in turn; tensors equal\n" + table(header, rows)


def video_rows_as_images(family: Any, processor: Any, frames: list[Any]) -> np.ndarray:
    """The video rows as the workers made them before: each frame through
    the image processor as an image (its patches repeated for the temporal
    patch), the first copy taken, then the frames stacked in temporal pairs
    as `video_rows` orders them."""
    tps, area = family.temporal_patch_size, family._patch_area
    frames, kwargs = family.sized_frames(frames)
    per_frame = []
    for frame in frames:
        rows = np.asarray(processor(images=frame, **kwargs, return_tensors="np")["pixel_values"], dtype=np.float32)
        per_frame.append(rows.reshape(rows.shape[0], -1, tps, area)[:, :, 0])
    per_frame.extend([per_frame[-1]] * (-len(per_frame) % tps))
    stacked = np.stack(per_frame)
    n, positions, channels, _ = stacked.shape
    video = stacked.reshape(n // tps, tps, positions, channels, area).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(video.reshape(n // tps * positions, channels * tps * area))


def video_arms(workdir: Path, reps: int) -> str:
    """Qwen2-VL video rows at the default per-frame budget: as images, by
    `video_rows`, and by `video_rows` with the shortcuts (ms per clip)."""
    import shutil
    import time as clock

    from transformers import AutoImageProcessor

    from mmsplit_server import families
    from tokenizer_svc import video

    model = workdir / "qwen2-vl-video-budget"
    if not model.exists():
        shutil.copytree(_model("qwen2-vl", workdir), model)
        config = json.loads((model / "video_preprocessor_config.json").read_text())
        config["size"] = {"shortest_edge": 100352, "longest_edge": 602112}
        (model / "video_preprocessor_config.json").write_text(json.dumps(config))
    stock, fast = (AutoImageProcessor.from_pretrained(model) for _ in range(2))
    pil_shortcuts.install(fast)
    family = families.load(model, frozenset(stock.model_input_names))
    rows = []
    for frames in (8, 20):
        data = samples.video(frames=frames * 3, width=640, height=480, fps=6, seed=frames)
        limits = video.VideoLimits(
            max_pixels=10**8, max_duration_s=600, max_frames=10**4, deadline=clock.monotonic() + 600
        )
        rule = video.Sampling(fps=2.0, min_frames=4, max_frames=64, temporal_patch_size=family.temporal_patch_size)
        clip = video.decode_video(data, limits, rule)
        arms = {
            "as images": lambda c: video_rows_as_images(family, stock, c.frames),
            "video_rows": lambda c: family.video_rows(stock, c.frames, c.sampled_fps)["pixel_values_videos"],
            "+ shortcuts": lambda c: _with_shortcuts(family, fast, c),
        }
        best = dict.fromkeys(arms, float("inf"))
        for _ in range(reps):
            expected = None
            for name, arm in arms.items():
                start = clock.perf_counter()
                got = arm(clip)
                best[name] = min(best[name], clock.perf_counter() - start)
                if expected is None:
                    expected = got
                elif not np.array_equal(got, expected):
                    raise AssertionError(f"{name}: the video rows differ")
        before, plain, fast_s = best.values()
        rows.append(
            [f"{len(clip.frames)} frames", f"{before * 1e3:.1f}", f"{plain * 1e3:.1f}", f"{fast_s * 1e3:.1f}",
             f"{plain / before:.2f}x", f"{fast_s / before:.2f}x"]
        )  # fmt: skip
    header = ["640x480 clip", "as images ms", "video_rows ms", "+ shortcuts ms", "video_rows / as images", "both"]
    return "Qwen2-VL video rows at the default per-frame budget, fastest of each; rows equal\n" + table(header, rows)


def _with_shortcuts(family: Any, processor: Any, clip: Any) -> np.ndarray:
    with pil_shortcuts.processing():
        return family.video_rows(processor, clip.frames, clip.sampled_fps)["pixel_values_videos"]


def _model(family: str, workdir: Path) -> Path:
    """A tiny model of `family` (the benchmarks' own tiny LLaVA for llava),
    kept in MMSPLIT_BENCH_MODELS when the environment names it."""
    from mmsplit_cli.tiny_model import build_once

    if family == "llava":
        return build_model("tiny", workdir)
    base = Path(os.environ[MODELS_DIR]) if os.environ.get(MODELS_DIR) else workdir
    return build_once(base / f"tiny-{family}", cache_dir=ROOT / ".cache", family=family)


def _figures(seconds: list[float]) -> list[str]:
    stock, resizes, both = seconds
    return [
        f"{stock * 1e3:.2f}",
        f"{resizes * 1e3:.2f}",
        f"{both * 1e3:.2f}",
        f"{both / resizes:.2f}x",
        f"{both / stock:.2f}x",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llava,llava-next,qwen2-vl")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--workdir", type=Path, help="where the tiny models go (default: a temporary directory)")
    args = parser.parse_args()
    with scratch_dir(args.workdir) as where:
        print(run(args.families.split(","), args.reps, where))
        if "qwen2-vl" in args.families.split(","):
            print()
            print(video_arms(where, args.reps))


if __name__ == "__main__":
    main()
