"""Memory over a long mixed load: each service process's resident memory
after every round of requests, and its growth per 1,000 requests from the
second round to the last (the first round warms caches and allocators up)
and over the second half of the run. A leak shows as growth that does not
level off; with both caches off (the default) nothing should grow.

Each round: 10 % corrupt images, 10 % text only with a stop string, 10 %
images never seen before, the rest a rotation of 50 images; every 13th
client leaves after its first token. Every request ends in success, the
corrupt ones' MEDIA_DECODE_FAILED, or the leaver's CANCELLED.

    python bench/soak.py [--rounds 10] [--per-round 1000] [--tp 2] [--caches]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, scratch_dir, table

from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args

ROTATION = [samples.encode(samples.gradient(320, 240, seed=i), "JPEG") for i in range(50)]
CORRUPT = samples.good_png(seed=1)[:300]
EXPECTED = {"", "MEDIA_DECODE_FAILED", "CANCELLED"}


def request(i: int) -> tokenizer_pb2.GenerateRequest:
    kind = i % 10
    if kind == 3:
        return make_request("Look.", [CORRUPT], max_tokens=2)
    if kind == 7:
        return make_request("Say something.", max_tokens=4, stop=["e"])
    if kind == 5:
        fresh = samples.encode(samples.gradient(160, 120, seed=100_000 + i), "JPEG")
        return make_request("Look.", [fresh], max_tokens=2)
    return make_request("Look.", [ROTATION[i % len(ROTATION)]], max_tokens=3)


async def one_round(address: str, first: int, count: int, concurrency: int) -> list[str]:
    """Each request's outcome: "" for success, else its reason."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int) -> str:
            async with slots:
                call = stub.Generate(request(i), timeout=120)
                try:
                    async for _ in call:
                        if i % 13 == 0:
                            call.cancel()
                            return "CANCELLED"
                except grpc.aio.AioRpcError as exc:
                    return RemoteError.from_rpc_error(exc).reason
                return ""

        return await asyncio.gather(*(one(i) for i in range(first, first + count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--caches", action="store_true", help="keep both caches on (they grow to their bounds)")
    parser.add_argument("--workdir", type=Path, help="where the model and logs go (default: a temporary directory)")
    args = parser.parse_args()
    off = [] if args.caches else ["--encoder-cache-bytes", "0"]
    tok_off = [] if args.caches else ["--preprocess-cache-bytes", "0"]
    with scratch_dir(args.workdir) as where:
        model = build_model("tiny", where)
        sched = ServiceProcess("scheduler", scheduler_args(model, tp=args.tp, extra=off), where / "scheduler.log")
        tok: ServiceProcess | None = None
        try:
            sched.wait_serving("mmsplit.scheduler.v1.SchedulerService", 300)
            tok = ServiceProcess(
                "tokenizer", tokenizer_args(model, sched.address, extra=tok_off), where / "tokenizer.log"
            )
            tok.wait_serving("mmsplit.tokenizer.v1.TokenizerService", 300)
            rank0 = psutil.Process(sched.pid)
            processes = {"tokenizer": psutil.Process(tok.pid), "rank 0": rank0}
            # Ranks 1.. are spawned children (not the resource tracker).
            ranks = [p for p in rank0.children() if "spawn_main" in " ".join(p.cmdline())]
            processes |= {f"rank {r}": p for r, p in enumerate(ranks, 1)}
            rows, resident = [], {name: [] for name in processes}
            for n in range(args.rounds):
                started = time.monotonic()
                outcomes = asyncio.run(one_round(tok.address, n * args.per_round, args.per_round, args.concurrency))
                unexpected = [o for o in outcomes if o not in EXPECTED]
                if unexpected:
                    raise SystemExit(f"round {n + 1}: unexpected outcomes {sorted(set(unexpected))}")
                for name, process in processes.items():
                    resident[name].append(process.memory_info().rss / 2**20)
                took = time.monotonic() - started
                rows.append([(n + 1) * args.per_round, f"{took:.0f}", *(f"{resident[k][-1]:.0f}" for k in processes)])
        finally:
            if tok is not None:
                tok.stop()
            sched.stop()
    print(f"tp={args.tp}, caches {'on' if args.caches else 'off'}, {args.concurrency} clients; resident MiB")
    print(table(["requests", "round s", *processes], rows))
    if args.rounds >= 4:
        # Growth that levels off (allocators, the KV cache's chunks) is not a
        # leak: the second half of the run shows whether it goes on.
        for label, first in (("round 2", 1), (f"round {args.rounds // 2 + 1}", args.rounds // 2)):
            span = (args.rounds - 1 - first) * args.per_round / 1000
            growth = ", ".join(f"{k} {(v[-1] - v[first]) / span:+.2f}" for k, v in resident.items())
            print(f"growth per 1,000 requests from {label} to the last, MiB: {growth}")


if __name__ == "__main__":
    main()
