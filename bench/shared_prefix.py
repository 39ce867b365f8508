"""Requests arriving together with one system prompt, through the real
services: the scheduler's `--wait-for-shared-prefix` (a request waits for a
prefill of the text it starts with, then takes it from the prefix cache) on,
against off, in the same run.

Two service pairs stand side by side (the prefix cache on in both; one
waits, one does not); each round sends a burst of N requests to each in
turn, all at once (N concurrent clients), every request the same system
prompt of about S tokens, then its own JPEG (never sent before: no cache
spares its preprocessing or its encoder) and question, T greedy tokens
each. Printed: time to first token p50/p90, the burst's wall time, the
prompt tokens the prefix cache supplied, medians over the rounds, and the
ratios waiting / not waiting. (`bench/multiturn.py`'s "at once" workload
measures the same rule on the engine alone, where every request is queued
before the first step; here they arrive as the tokenizer finishes each.)

    python bench/shared_prefix.py [--model 8x512] [--n 16] [--system 250] [--tokens 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, cache_hits, percentile, run_clients, scratch_dir, table

from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import Pair, running_pair

ARMS = {"waits": "64", "no wait": "0"}  # --wait-for-shared-prefix


def burst(pair: Pair, system: str, n: int, tokens: int, batch: int) -> tuple[list[float], float]:
    """Each request's time to first token, and the wall time of all."""
    requests = [
        make_request(f"{system}\n<image>\nQuestion {i}: what is in this picture?",
                     [samples.good_jpeg(seed=10_000 * batch + i)], max_tokens=tokens, min_tokens=tokens)
        for i in range(n)
    ]  # fmt: skip
    timelines, wall = run_clients(pair.tokenizer_address, requests, n)
    failed = [t.error for t in timelines if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    return [t.ttft for t in timelines], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8x512", help="tiny or 8x512")
    parser.add_argument("--n", type=int, default=16, help="requests per burst")
    parser.add_argument("--system", type=int, default=250, help="words of system prompt (about as many tokens)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each request makes")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (one more warms up)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(1)
    words = "the a light shape color bright dark round square soft hard near far old new".split()  # noqa: SIM905
    system = "You answer questions about pictures. " + " ".join(rng.choice(words) for _ in range(args.system))
    ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
    p90: dict[str, list[float]] = {arm: [] for arm in ARMS}
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    from_cache: dict[str, float] = {}
    with scratch_dir(args.workdir) as workdir, contextlib.ExitStack() as stack:
        model = build_model(args.model, workdir)
        pairs = {}
        for arm, wait in ARMS.items():
            logs = workdir / f"logs-{wait}"
            logs.mkdir(exist_ok=True)
            pairs[arm] = stack.enter_context(
                running_pair(model, logs, tp=1, scheduler_extra=["--wait-for-shared-prefix", wait])
            )
        batches = iter(range(1, 1 << 30))
        for pair in pairs.values():  # warm up: the first burst of each pair is not counted
            burst(pair, system, args.n, args.tokens, next(batches))
        before = {arm: cache_hits(pair.tokenizer_address, pair.scheduler_address) for arm, pair in pairs.items()}
        for _ in range(args.rounds):
            for arm, pair in pairs.items():
                times, wall = burst(pair, system, args.n, args.tokens, next(batches))
                ttft[arm].append(statistics.median(times))
                p90[arm].append(percentile(times, 0.9))
                walls[arm].append(wall)
        for arm, pair in pairs.items():
            after = cache_hits(pair.tokenizer_address, pair.scheduler_address)
            from_cache[arm] = after["prefix tokens"] - before[arm]["prefix tokens"]
    rows = []
    for arm in ARMS:
        rows.append([arm, f"{statistics.median(ttft[arm]) * 1000:.0f}", f"{statistics.median(p90[arm]) * 1000:.0f}",
                     f"{statistics.median(walls[arm]) * 1000:.0f}",
                     f"{from_cache[arm] / (args.rounds * args.n):.0f}"])  # fmt: skip
    print(
        f"{args.n} requests at once, each a ~{args.system}-token system prompt then its own image and question, "
        f"{args.tokens} tokens each; {args.model}, TP=1; medians of {args.rounds} rounds, pairs taking turns"
    )
    header = ["--wait-for-shared-prefix", "TTFT p50 ms", "TTFT p90 ms", "burst ms", "cached tokens/request"]
    print(table(header, rows))
    ratio = {name: statistics.median(values["waits"]) / statistics.median(values["no wait"])
             for name, values in (("TTFT p50", ttft), ("TTFT p90", p90), ("burst", walls))}  # fmt: skip
    print("waiting / not waiting: " + ", ".join(f"{name} {r:.2f}x" for name, r in ratio.items()))


if __name__ == "__main__":
    main()
