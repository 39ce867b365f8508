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

    python bench/processor_steps.py [--families llava,llava-next,qwen2-vl] [--reps 9]
"""

from __future__ import annotations

import argparse
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


if __name__ == "__main__":
    main()
