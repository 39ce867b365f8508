"""Chunked prefill: what a long prompt joining costs the streams already running.

In ONE run, on an 8-layer 512-wide tiny LLaVA whose text model holds 8,192
positions (`mmsplit tiny-model --max-positions 8192`), the scheduler's
`Engine` in this process (a group of one): S text streams decode, and after
a few steps a prompt of P tokens (most of the context) joins. Each step is
one token for every stream, so a stream's inter-token latency is the step's
time. Printed for the steps while the long prompt joins (from its arrival,
as many steps as chunking takes, in both arms): the streams' inter-token
latency p50, p99 and worst, and the long prompt's time to first token,
with chunked prefill (chunks of C tokens, one a step) and without (the
whole prompt in one step, then plain decode steps), arms interleaved over
rounds; also the streams' plain decode step before it arrives, and
whether both arms made the same tokens.

    python bench/chunked_prefill.py [--streams 16] [--prompt 6000] [--chunk 512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, SoloGroup, inline_reader, percentile, scratch_dir, table

WARM_STEPS = 4  # steps the streams decode before the long prompt arrives


def build(workdir: Path) -> Path:
    from mmsplit_cli.tiny_model import build as tiny

    out = workdir / "model-8x512-8k"
    if (out / "config.json").exists():
        return out
    return tiny(out, cache_dir=ROOT / ".cache", text_layers=8, text_hidden=512, max_positions=8192, chat_template=False)


def run(
    model: object, streams: int, prompt: int, chunk: int, window: int, seed: int
) -> tuple[list[float], float, dict[str, list[int]], list[float]]:
    """(the seconds of `window` steps from the long prompt's arrival (0:
    until its first token), its time to first token, every request's
    tokens, the decode steps before)."""
    import torch

    from mmsplit_server.sampling import Sampling
    from scheduler_svc.engine import Engine
    from scheduler_svc.plan import NewRequest, Plan

    engine = Engine(model, SoloGroup(), inline_reader(), torch.device("cpu"), eos_token_ids=frozenset(),  # type: ignore[arg-type]
                    prefill_chunk=chunk)  # fmt: skip
    rng = random.Random(seed)

    def request(rid: str, n: int, tokens: int) -> NewRequest:
        ids = (1, *(rng.randrange(100, 30000) for _ in range(n - 1)))
        return NewRequest(rid, ids, (), Sampling(max_tokens=tokens, min_tokens=tokens))

    made: dict[str, list[int]] = {}
    feeds: dict[str, int] = {}
    short = [request(f"s{i}", rng.randrange(8, 40), 10_000) for i in range(streams)]
    long = request("long", prompt, 1)
    steps: list[float] = []
    plain: list[float] = []  # decode steps before the long prompt arrives
    arrived = None
    ttft = 0.0
    step = 0
    with torch.inference_mode():
        while len(steps) < window or (not window and not ttft):
            new = tuple(short) if step == 0 else (long,) if step == WARM_STEPS else ()
            started = time.perf_counter()
            drop = ("long",) if "long" in made and "long" in engine.index else ()
            outcome = engine.step(Plan(step=step, new=new, drop=drop, feed=tuple(feeds.items())))
            seconds = time.perf_counter() - started
            if step == WARM_STEPS:
                arrived = started
            if arrived is not None:
                steps.append(seconds)
            elif step:
                plain.append(seconds)
            if "long" in outcome.sampled:
                ttft = time.perf_counter() - started + sum(steps[:-1])
            for rid, token in outcome.sampled.items():
                made.setdefault(rid, []).append(token)
                feeds[rid] = token
            feeds.pop("long", None)
            step += 1
    assert ttft, "the long prompt made no token within the window"
    return steps, ttft, made, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=6000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText

    with scratch_dir(args.workdir) as workdir:
        model = AutoModelForImageTextToText.from_pretrained(build(workdir), dtype=torch.float32).eval()
        arms = {"chunked": args.chunk, "whole": 0}
        gaps: dict[str, list[float]] = {arm: [] for arm in arms}
        ttfts: dict[str, list[float]] = {arm: [] for arm in arms}
        tokens: dict[str, dict[str, list[int]]] = {}
        before: list[float] = []
        first: dict[str, list[float]] = {}  # round 0's steps, by arm
        for r in range(args.rounds):
            window = 0  # the chunked arm's: until the long prompt's first token
            for arm, chunk in arms.items():
                steps, ttft, made, plain = run(model, args.streams, args.prompt, chunk, window, seed=r)
                window = window or len(steps)
                gaps[arm] += steps
                before += plain
                ttfts[arm].append(ttft)
                if r == 0:
                    tokens[arm] = made
                    first[arm] = steps
        rows = []
        for arm in arms:
            p50, p99 = percentile(gaps[arm], 50), percentile(gaps[arm], 99)
            rows.append([arm, f"{p50 * 1000:.0f}", f"{p99 * 1000:.0f}", f"{max(gaps[arm]) * 1000:.0f}",
                         f"{p99 / p50:.1f}x", f"{statistics.median(ttfts[arm]):.2f}", len(gaps[arm])])  # fmt: skip
        print(f"{args.streams} streams decoding, a {args.prompt}-token prompt joins; chunks of {args.chunk}; "
              f"{args.rounds} rounds, arms interleaved")  # fmt: skip
        print(f"a plain decode step before it arrives: {statistics.median(before) * 1000:.0f} ms (median)")
        print(table(["prefill", "ITL p50 ms", "ITL p99 ms", "worst ms", "p99/p50", "long TTFT s", "steps"], rows))
        print("round 0, each step while it joins, ms: " + "; ".join(
            f"{arm} " + " ".join(f"{s * 1000:.0f}" for s in steps) for arm, steps in first.items()))  # fmt: skip
        a, b = tokens["chunked"], tokens["whole"]
        # The arms run different numbers of steps: the streams' tokens agree as far as both went.
        same = a.keys() == b.keys() and all(a[k][: len(b[k])] == b[k][: len(a[k])] for k in a)
        print(f"same tokens with and without chunking (round 0, every request, as far as both went): {same}")


if __name__ == "__main__":
    main()
