"""The same images sent again and again: requests/s with the tokenizer's
preprocessing cache and the scheduler's encoder-output cache ÷ without them,
measured in the same run (a pair with `--preprocess-cache-bytes 0` and
`--encoder-cache-bytes 0`, then a pair with both on), and both hit rates.

Each request carries one of `--images` distinct JPEGs (640x480 to 1920x1080)
and asks for `--tokens` tokens; every image is sent `--repeat` times, in an
interleaved order, by `--concurrency` clients.

    python bench/repeat.py [--images 8] [--repeat 100] [--concurrency 8] [--tokens 1] [--tp 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, run_clients, scratch_dir, table

from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args
from tests.support.local_token import scheduler_channel

SIZES = [(640, 480), (800, 600), (1024, 768), (1280, 720), (1600, 900), (1920, 1080)]


def images(n: int) -> list[bytes]:
    return [samples.encode(samples.gradient(*SIZES[i % len(SIZES)], seed=i), "JPEG", quality=90) for i in range(n)]


def cache_counts(tokenizer: str, scheduler: str) -> tuple[int, int, int, int]:
    """(preprocessing hits, misses, encoder-output hits, misses)."""
    with grpc.insecure_channel(tokenizer) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        tok = stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=5).info
    with scheduler_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        sched = stub.GetServerInfo(scheduler_pb2.GetServerInfoRequest(), timeout=5).info
    return tok.preprocess_cache_hits, tok.preprocess_cache_misses, sched.encoder_cache_hits, sched.encoder_cache_misses


def rate(hits: int, misses: int) -> str:
    return f"{hits}/{hits + misses} ({hits / (hits + misses):.1%})" if hits + misses else "-"


def run(*, n_images: int, repeat: int, concurrency: int, tokens: int, tp: int, workdir: Path) -> str:
    model = build_model("tiny", workdir)
    pictures = images(n_images)
    # Warm-up: other images (the measured run starts with cold caches).
    warm = [make_request("Hi", [data], max_tokens=tokens) for data in images(n_images + concurrency)[n_images:]]
    requests = [
        make_request("Describe it.", [pictures[i % n_images]], max_tokens=tokens) for i in range(n_images * repeat)
    ]
    rows = []
    walls = {}
    arms = (
        ("no caches", ["--encoder-cache-bytes", "0"], ["--preprocess-cache-bytes", "0"]),
        ("caches", [], []),
    )
    for name, sched_flags, tok_flags in arms:
        sched_args = scheduler_args(model, tp=tp, extra=["--port", "0", *sched_flags])
        sched = ServiceProcess("scheduler", sched_args, workdir / f"scheduler-{name}.log")
        tok: ServiceProcess | None = None
        try:
            sched.wait_serving("mmsplit.scheduler.v1.SchedulerService", 300)
            tok_args = tokenizer_args(model, sched.address, extra=tok_flags)
            tok = ServiceProcess("tokenizer", tok_args, workdir / f"tokenizer-{name}.log")
            tok.wait_serving("mmsplit.tokenizer.v1.TokenizerService", 300)
            run_clients(tok.address, warm, concurrency)
            before = cache_counts(tok.address, sched.address)
            timelines, wall = run_clients(tok.address, requests, concurrency)
            counts = [a - b for a, b in zip(cache_counts(tok.address, sched.address), before, strict=True)]
        finally:
            if tok is not None:
                tok.stop()
            sched.stop()
        failed = [t.error for t in timelines if t.error]
        if failed:
            raise SystemExit(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
        walls[name] = wall
        rows.append([name, len(requests), f"{len(requests) / wall:.1f}", rate(*counts[:2]), rate(*counts[2:])])
    ratio = walls["no caches"] / walls["caches"]
    header = ["arm", "requests", "req/s", "preprocessing hits", "encoder-output hits"]
    return (
        f"{n_images} images x {repeat}, {concurrency} clients, {tokens} token(s) each, tp={tp}\n"
        + table(header, rows)
        + f"\nrequests/s with the caches / without: {ratio:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="where models and logs go (default: a temporary directory)")
    args = parser.parse_args()
    with scratch_dir(args.workdir) as where:
        print(
            run(
                n_images=args.images,
                repeat=args.repeat,
                concurrency=args.concurrency,
                tokens=args.tokens,
                tp=args.tp,
                workdir=where,
            )
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
