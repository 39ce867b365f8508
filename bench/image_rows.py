"""Qwen still images sent as rows of one frame (the scheduler's
`--one-frame-image-rows`, on by default) against rows of both frames of the
temporal patch (each pixel twice: what the processor makes, and what a
scheduler that does not take one frame's rows gets).

Part 1, in one process, per image: Qwen2-VL's processor at its default
pixel budget (3,136 to 12,845,056 pixels, where a photo keeps nearly all of
them) on JPEGs of three sizes, called as the CPU workers call it (with
`pil_shortcuts`), in each form; the bytes of the rows; and what every
scheduler rank does with them before the model on a CPU device: its key of
the item (BLAKE3, `EncoderCache.key`), the finite check (`all_finite`) and
the model's input made from the lent rows (`MediaInputs._model_input`: a
copy of rows of both frames, the frame repeated for rows of one). Fastest
of --reps calls of each, the forms in turn; the model's inputs compared
(equal, or the script fails). Twice: for a float32 model (rows of one
frame in float32), and for a bfloat16 one (rows of one frame in bfloat16,
as the workers make them for it, against float32 rows the ranks cast).

Part 2, the services: two pairs of a tiny Qwen2-VL given that pixel budget
and a context of 8,192 positions, one with a scheduler that takes rows of
one frame and one with `--one-frame-image-rows false`, both running, used in
turn over --rounds rounds; each round sends --n requests with a 1280x720
JPEG never sent before (no cache spares any work) by --concurrency clients,
one token each. Per form: requests/s (median of the rounds), and CPU ms per
request of the tokenizer, its workers and the scheduler's ranks.

Part 3, the same for the services' heaps (`mmsplit_server.mallocheap`):
rows of one frame of 1920x1080 JPEGs, both services keeping their freed
buffers (the default) against glibc's thresholds as a process that sets
none has them at their top (set by the environment, which `mallocheap`
leaves to glibc).

    python bench/image_rows.py [--reps 7] [--n 16] [--concurrency 2] [--rounds 3] [--tp 1] [--parts forms,heap]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import serve
from harness import MODELS_DIR, ROOT, run_clients, table

from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_server import mallocheap
from tokenizer_svc import pil_shortcuts
from tokenizer_svc.decode import decode_image
from tokenizer_svc.preprocess import pixels_as, rgb_as_is

SIZES = [(640, 480), (1280, 720), (1920, 1080)]
# Qwen2-VL's own preprocessor_config.json; the tiny model keeps 50,176 pixels at most.
QWEN_DEFAULT_BUDGET = {"shortest_edge": 3136, "longest_edge": 12845056}
FORMS = ("both frames", "one frame")
SERVICE_IMAGE = (1280, 720)
# Where the heap's settings show: a 1920x1080 photo's one-frame rows are 25.3 MB, the
# vision tower's buffers over its 10,764 patches larger (`mallocheap`).
HEAP_IMAGE = (1920, 1080)


def model_dir(workdir: Path) -> Path:
    """A tiny Qwen2-VL with a context of 8,192 positions and the real
    model's default pixel budget (a 1280x720 image: 1,175 placeholders)."""
    import os
    import shutil

    from mmsplit_cli.tiny_model import build_once

    base = Path(os.environ[MODELS_DIR]) if os.environ.get(MODELS_DIR) else workdir
    out = build_once(base / "qwen2-vl-8k", cache_dir=ROOT / ".cache", family="qwen2-vl", max_positions=8192)
    budget = workdir / "qwen2-vl-8k-default-budget"
    if not budget.exists():
        shutil.copytree(out, budget)
        config_path = budget / "preprocessor_config.json"
        config = json.loads(config_path.read_text())
        config["size"] = QWEN_DEFAULT_BUDGET
        config.pop("min_pixels", None)
        config.pop("max_pixels", None)
        config_path.write_text(json.dumps(config))
    return budget


def per_image(model: Path, reps: int, model_dtype: str = "float32") -> str:
    """Part 1 for a model in `model_dtype`: the rows any scheduler takes
    ("both frames": float32, each frame) against those the tokenizer sends
    it now ("one frame": the frame once, in the model's dtype where that
    is bfloat16 or float16)."""
    import torch
    from transformers import AutoImageProcessor

    from mmsplit_server import families
    from scheduler_svc.encoder_cache import EncoderCache
    from scheduler_svc.intake import all_finite
    from scheduler_svc.media_inputs import MediaInputs

    processor = AutoImageProcessor.from_pretrained(model)
    pil_shortcuts.install(processor)
    family = families.load(model, frozenset(processor.model_input_names))
    # Only what _model_input reads of a MediaInputs: the family, device and dtype.
    media = MediaInputs.__new__(MediaInputs)
    media.family, media.device, media.dtype = family, torch.device("cpu"), getattr(torch, model_dtype)
    rows = []
    for i, size in enumerate(SIZES):
        image = decode_image(samples.encode(samples.gradient(*size, seed=i), "JPEG", quality=90), max_pixels=10**8)
        best: dict[str, dict[str, float]] = {form: {} for form in FORMS}
        nbytes: dict[str, int] = {}
        for _ in range(reps):
            made: dict[str, Any] = {}
            for form in FORMS:
                options = family.image_options(one_frame=form == "one frame")
                start = time.perf_counter()
                with pil_shortcuts.processing():
                    out = processor(images=image, return_tensors="np", **rgb_as_is(image), **options)
                pixels, _ = pixels_as(
                    np.asarray(out["pixel_values"]), model_dtype if form == "one frame" else "float32"
                )
                made[form] = {"pixel_values": pixels, "image_grid_thw": out["image_grid_thw"]}
                best[form]["processor"] = min(best[form].get("processor", 1e9), time.perf_counter() - start)
            # Then each form's steps as a rank runs them, on rows lent read-only,
            # each step's output dropped before the next form's (alike for both).
            expected = None
            for form in FORMS:
                took = best[form]
                pixels = np.asarray(made[form]["pixel_values"])
                pixels.flags.writeable = False
                nbytes[form] = pixels.nbytes
                lent = torch.from_numpy(pixels)
                lent = lent.view(torch.bfloat16) if lent.dtype == torch.uint16 else lent
                side = {"image_grid_thw": np.asarray(made[form]["image_grid_thw"])}
                steps: dict[str, Any] = {
                    "key": lambda t, side: EncoderCache.key({"pixel_values": t}, side),
                    "finite": lambda t, side: all_finite(t),
                    "model input": lambda t, side: media._model_input(families.IMAGE, "pixel_values", t),
                }
                for name, step in steps.items():
                    start = time.perf_counter()
                    out = step(lent, side)
                    took[name] = min(took.get(name, 1e9), time.perf_counter() - start)
                digest = EncoderCache.key({"pixel_values": out}, side)  # the model's input, compared
                if expected is not None and digest != expected:
                    raise AssertionError(f"{size}: the model's inputs differ between the forms")
                expected = digest
                del out
        for form in FORMS:
            took = best[form]
            rank = took["key"] + took["finite"] + took["model input"]
            rows.append(
                [f"{size[0]}x{size[1]}", form, f"{nbytes[form] / 1e6:.1f}", f"{took['processor'] * 1e3:.1f}",
                 f"{took['key'] * 1e3:.2f}", f"{took['finite'] * 1e3:.2f}", f"{took['model input'] * 1e3:.2f}",
                 f"{rank * 1e3:.2f}"]
            )  # fmt: skip
        ratio = [best["one frame"][k] / best["both frames"][k] for k in ("processor", "key", "finite", "model input")]
        rank_ratio = sum(best["one frame"][k] for k in ("key", "finite", "model input")) / sum(
            best["both frames"][k] for k in ("key", "finite", "model input")
        )
        size_ratio = nbytes["one frame"] / nbytes["both frames"]
        rows.append(["", "one / both", f"{size_ratio:.2f}", *[f"{r:.2f}" for r in ratio], f"{rank_ratio:.2f}"])
    header = ["JPEG", "rows", "MB", "processor ms", "key ms", "finite ms", "model input ms", "per rank ms"]
    title = f"Qwen2-VL at its default pixel budget, a {model_dtype} model: per image, fastest of {reps}"
    return f"{title} (the model's inputs equal)\n" + table(header, rows)


# Arms of the services part: label -> (the scheduler's extra arguments, environment of both services).
FORM_ARMS = {
    "both frames": (["--one-frame-image-rows", "false"], {}),
    "one frame": (["--one-frame-image-rows", "true"], {}),
}
# glibc's thresholds as a process that sets none has them once its dynamic
# mmap threshold has grown to its top (32 MiB; trim 128 KiB): `mallocheap.keep`
# leaves them to glibc when the environment sets them.
HEAP_ARMS = {
    "glibc's defaults": ([], {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}),
    "heap kept": ([], {}),
}

# The services' parts: name -> their arms and the image size they send.
SERVICE_PARTS = {"forms": (FORM_ARMS, SERVICE_IMAGE), "heap": (HEAP_ARMS, HEAP_IMAGE)}


def services(
    model: Path,
    arms: dict[str, tuple[list[str], dict[str, str]]],
    size: tuple[int, int],
    n: int,
    concurrency: int,
    rounds: int,
    tp: int,
    logs: Path,
) -> str:
    """The services, one pair per arm (all running, used in turn): --rounds
    rounds of `n` new JPEGs of `size`, 1 token each; the last arm against
    the first."""
    import contextlib
    import os

    from mmsplit_cli.launch import running_pair

    results: dict[str, list[tuple[float, dict[str, float]]]] = {arm: [] for arm in arms}
    with contextlib.ExitStack() as stack:
        pairs = {}
        for arm, (extra, env) in arms.items():
            where = logs / arm.replace(" ", "-").replace("'", "")
            where.mkdir(parents=True, exist_ok=True)
            environment = {k: v for k, v in os.environ.items() if k not in mallocheap.ENVIRONMENT} | env
            pairs[arm] = stack.enter_context(running_pair(model, where, tp=tp, scheduler_extra=extra, env=environment))
        seed = 1000 + size[0]
        prompt = "<|vision_start|><|image_pad|><|vision_end|>What is this?"

        def batch() -> list[Any]:
            nonlocal seed
            seed += n
            jpegs = [samples.encode(samples.gradient(*size, seed=seed + i), "JPEG", quality=90) for i in range(n)]
            return [make_request(prompt, [jpeg], max_tokens=1, min_tokens=1) for jpeg in jpegs]

        for pair in pairs.values():  # warm up each: the first requests load what is loaded lazily
            run_clients(pair.tokenizer_address, batch()[:concurrency], concurrency)
        for _ in range(rounds):
            for arm, pair in pairs.items():
                run = serve(pair, batch(), concurrency)  # one token a request: tokens/s = requests/s
                results[arm].append((run.tps, {part: seconds / n for part, seconds in run.cpu.items()}))
    rows = []
    medians: dict[str, float] = {}
    for arm in arms:
        rates = [rate for rate, _ in results[arm]]
        medians[arm] = statistics.median(rates)
        cpu = {k: statistics.median(c[k] for _, c in results[arm]) for k in ("tokenizer", "workers", "scheduler")}
        rows.append(
            [arm, f"{medians[arm]:.2f}", " ".join(f"{r:.2f}" for r in rates),
             *(f"{cpu[k] * 1e3:.0f}" for k in ("tokenizer", "workers", "scheduler"))]
        )  # fmt: skip
    header = ["arm", "req/s", "rounds", "tokenizer CPU ms/req", "workers CPU ms/req", "scheduler CPU ms/req"]
    first, *_, last = arms
    return (
        f"the services, TP={tp}: {n} new {size[0]}x{size[1]} JPEGs a round by {concurrency} "
        f"clients, 1 token each, {rounds} rounds, arms in turn (medians)\n"
        + table(header, rows)
        + f"\n{last} / {first}: {medians[last] / medians[first]:.2f}x the requests/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="calls of each step per image (the fastest is kept)")
    parser.add_argument("--n", type=int, default=16, help="requests per round of the services")
    parser.add_argument("--concurrency", type=int, default=2, help="clients at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the services (0: part 1 only)")
    parser.add_argument("--tp", type=int, default=1, help="the schedulers' ranks")
    parser.add_argument("--workdir", type=Path, help="where the model goes (default: a temporary directory)")
    parser.add_argument(
        "--parts", default="forms,heap", help="the services' parts to run, of forms (part 2) and heap (part 3)"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= SERVICE_PARTS.keys():
        parser.error(f"--parts: {args.parts!r}; the parts are {', '.join(SERVICE_PARTS)}")
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        model = model_dir(workdir)
        for dtype in ("float32", "bfloat16"):
            print(per_image(model, args.reps, dtype), flush=True)
        if args.rounds:
            common = (args.n, args.concurrency, args.rounds, args.tp, Path(tmp))
            for part, (arms, size) in SERVICE_PARTS.items():
                if part in parts:
                    print(services(model, arms, size, *common), flush=True)


if __name__ == "__main__":
    main()
