"""What streaming one token costs, next to what computing it costs.

In one run:
  streaming — a real tokenizer in front of a stand-in scheduler that streams
              T tokens per request at once (no model), N requests from N
              concurrent clients; the CPU time each process spends per
              token: the tokenizer (receive, detokenize, stop strings, send),
              the scheduler's gRPC side, the clients
  compute   — the scheduler's engine in this process (no services): the
              wall time per token of a batched decode step at batch N, for
              the tiny model and the 8-layer 512-wide one
and prints streaming CPU per token ÷ compute time per token. On a machine
where the services share the cores with the model (as here: 2 cores), that
ratio is the share of the model's time the streaming path takes away.

    python bench/streaming.py [--n 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from harness import SoloGroup, build_model, inline_reader, run_clients, table

from mmsplit.serving import free_port
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import TOKENIZER_SERVICE, ServiceProcess, tokenizer_args


def fake_scheduler(port: int) -> None:
    """A SchedulerService that streams max_tokens tokens at once, one message each."""
    import grpc

    from mmsplit.common.v1 import common_pb2
    from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from mmsplit.serving import Health, new_server

    name = "mmsplit.scheduler.v1.SchedulerService"

    class Streamer(scheduler_pb2_grpc.SchedulerServiceServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            yield scheduler_pb2.GenerateResponse(accepted=scheduler_pb2.Accepted())
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(0)  # every request gets a turn, as in a batched step
                yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[1000 + i % 500]))
            finished = scheduler_pb2.Finished(finish_reason=1, completion_tokens=request.sampling.max_tokens)
            yield scheduler_pb2.GenerateResponse(finished=finished)

        async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            info = common_pb2.ServerInfo(model="stand-in", tp_size=1, transports=[common_pb2.TRANSPORT_INLINE])
            return scheduler_pb2.GetServerInfoResponse(info=info)

    async def serve() -> None:
        health = Health(name)
        await health.start()
        server, _ = await new_server(
            host="127.0.0.1", port=port, health_=health, service_names=[name], max_message_bytes=1 << 20
        )
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(Streamer(), server)
        await server.start()
        await health.set_ready(True)
        print("ready", flush=True)
        await server.wait_for_termination()

    del grpc
    asyncio.run(serve())


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def streaming_cost(model_dir: Path, n: int, tokens: int, workdir: Path) -> dict[str, float]:
    """CPU microseconds per streamed token, by process."""
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, __file__, "--fake-scheduler", str(port)], stdout=subprocess.PIPE, text=True
    )
    tokenizer = None
    try:
        assert fake.stdout is not None
        fake.stdout.readline()
        args = tokenizer_args(model_dir, f"127.0.0.1:{port}")
        tokenizer = ServiceProcess("tokenizer", args, workdir / "tokenizer.log")
        tokenizer.wait_serving(TOKENIZER_SERVICE, 120)
        requests = [make_request(f"Say {i}", max_tokens=tokens) for i in range(n)]
        run_clients(tokenizer.address, requests, n)  # warm up
        procs = {"tokenizer": psutil.Process(tokenizer.pid), "scheduler gRPC": psutil.Process(fake.pid)}
        me = psutil.Process()
        before = {k: cpu(p) for k, p in procs.items()} | {"clients": cpu(me)}
        made = 0
        for _ in range(3):
            timelines, _ = run_clients(tokenizer.address, requests, n)
            made += sum(len(t.token_ids) for t in timelines)
        after = {k: cpu(p) for k, p in procs.items()} | {"clients": cpu(me)}
        return {k: 1e6 * (after[k] - before[k]) / made for k in before}
    finally:
        if tokenizer is not None:
            tokenizer.stop()
        fake.terminate()
        fake.wait(10)


def compute_cost(model_dir: Path, n: int, steps: int = 16) -> float:
    """Microseconds of wall time per token of the engine's batched decode at batch n."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmsplit.sampling import Sampling
    from scheduler_svc.engine import Engine
    from scheduler_svc.plan import NewRequest, Plan

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(model, SoloGroup(), inline_reader(), torch.device("cpu"), eos_token_ids=frozenset())
    new = tuple(NewRequest(f"r{i}", (1, 22557, 1526, 100 + i), (), Sampling(max_tokens=1000)) for i in range(n))
    tokens = engine.step(Plan(step=0, new=new)).sampled
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for s in range(steps):
            tokens = engine.step(Plan(step=s + 1, feed=tuple(tokens.items()))).sampled
        best = min(best, (time.perf_counter() - start) / (steps * n))
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="concurrent requests (and the decode batch)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--fake-scheduler", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_scheduler:
        fake_scheduler(args.fake_scheduler)
        return
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        tiny = build_model("tiny", Path(tmp))
        wide = build_model("8x512", Path(tmp))
        stream = streaming_cost(tiny, args.n, args.tokens, Path(tmp))
        computes = {"tiny": compute_cost(tiny, args.n), "8x512": compute_cost(wide, args.n)}
    total = sum(stream.values())
    print(
        f"streaming, CPU µs per token at {args.n} concurrent: " + ", ".join(f"{k} {v:.0f}" for k, v in stream.items())
    )
    rows = [[name, f"{us:.0f}", f"{total:.0f}", f"{total / us:.2f}"] for name, us in computes.items()]
    print(table(["model", f"decode µs/token at batch {args.n}", "streaming CPU µs/token", "streaming / decode"], rows))


if __name__ == "__main__":
    main()
