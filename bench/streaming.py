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

Then a stand-in scheduler faster than its tokenizer (a step every
--step-ms, one token per request per step, made on a thread of its own as
rank 0's step loop is): the tokens/s the clients get, against the tokens/s
offered, and the messages per token, for rank 0 streaming one message per
token (as it did before), with `--stream-interval 1` (one per step, and
what queued up meanwhile together) and with `--stream-interval 4`.

Then the same streaming over the OpenAI-compatible HTTP API (server-sent
events from /v1/completions, the same tokenizer and stand-in) next to
gRPC, in turn, three times each: the tokenizer's CPU per token by protocol
and HTTP ÷ gRPC (the target: at most 1.5).

Last, the real services with the tiny model (and the 8x512 one with
--services-8x512): tokens/s at the clients and CPU per token, the
tokenizer's requests each over a `Generate` call or all over one
`GenerateStream` call (the default), and the scheduler's --stream-interval
1 and 4, in turn, a fresh pair each run. (The stand-in scheduler above
serves `Generate` only: its figures are the per-request path's.) Those
requests share one image and are sent once as a warm-up first, so the
timed run finds it in the services' caches (no preprocessing, vision tower
or prompt prefill but the last block): these tokens/s are the streaming
path's with little else around it, for comparing the arms with each other,
not what a request with a new image gets (`bench/engine.py` measures that).

    python bench/streaming.py [--n 32] [--tokens 64] [--services-only] [--services-8x512]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from harness import SoloGroup, build_model, cpu_seconds, inline_reader, run_clients, table

from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import TOKENIZER_SERVICE, ServiceProcess, running_pair, tokenizer_args
from mmsplit_server.serving import free_port


def fake_scheduler(port: int, step_ms: float = 0.0, per_token: bool = False, interval: int = 1) -> None:
    """A SchedulerService that streams max_tokens tokens, no model. With
    `step_ms` 0: at once, one message each. Otherwise as a scheduler that
    makes one token per running request every `step_ms` (one step), its
    events streamed by the scheduler's own `responses` (what queued up
    meanwhile in one message), or one message per token (`per_token`, how
    rank 0 streamed before)."""
    import grpc

    from mmsplit.common.v1 import common_pb2
    from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from mmsplit_server.serving import Health, new_server
    from scheduler_svc.frontend import responses
    from scheduler_svc.loop import Event, Finished, Token

    name = "mmsplit.scheduler.v1.SchedulerService"
    running: dict[asyncio.Queue[Event], list[int]] = {}  # each stream's queue -> [made, max_tokens]

    def steps(loop: asyncio.AbstractEventLoop) -> None:
        """The step loop's stand-in, on a thread of its own as rank 0's is:
        each step's events reach the event loop in one callback."""

        def deliver() -> None:
            for events, counts in list(running.items()):
                counts[0] += 1
                events.put_nowait(Token(1000 + counts[0] % 500))
                if counts[0] == counts[1]:
                    events.put_nowait(Finished(reason=1, prompt_tokens=1, completion_tokens=counts[1]))
                    del running[events]

        while True:
            time.sleep(step_ms / 1000)
            loop.call_soon_threadsafe(deliver)

    async def one_per_token(events: asyncio.Queue[Event]):  # type: ignore[no-untyped-def]
        while True:
            event = await events.get()
            if isinstance(event, Token):
                yield scheduler_pb2.GenerateResponse(tokens=scheduler_pb2.Tokens(token_ids=[event.token_id]))
            else:
                yield scheduler_pb2.GenerateResponse(finished=scheduler_pb2.Finished(finish_reason=1))
                return

    class Streamer(scheduler_pb2_grpc.SchedulerServiceServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            yield scheduler_pb2.GenerateResponse(accepted=scheduler_pb2.Accepted())
            if step_ms:
                events: asyncio.Queue[Event] = asyncio.Queue()
                running[events] = [0, request.sampling.max_tokens]
                try:
                    stream = one_per_token(events) if per_token else responses(events, interval)
                    async for response in stream:
                        yield response
                finally:
                    running.pop(events, None)
                return
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
        if step_ms:
            threading.Thread(target=steps, args=(asyncio.get_running_loop(),), daemon=True).start()
        print("ready", flush=True)
        await server.wait_for_termination()

    del grpc
    asyncio.run(serve())


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def _http_stream(url: str, n: int, tokens: int) -> tuple[int, int, float]:
    """n concurrent streamed /v1/completions: (tokens, events, wall seconds)."""
    import json

    import aiohttp

    made = events = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal made, events
        body = {"prompt": f"Say {i}", "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json=body) as reply:
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                events += 1
                if chunk.get("usage"):
                    made += chunk["usage"]["completion_tokens"]

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    return made, events, time.perf_counter() - start


def streaming_cost(
    model_dir: Path, n: int, tokens: int, workdir: Path, fake_args: Sequence[str] = (), *, http: bool = False
) -> dict[str, float]:
    """CPU microseconds per streamed token, by process; also the clients'
    tokens/s ("tok/s") and messages per token ("messages/token"). `http`:
    the clients stream over the OpenAI-compatible API instead of gRPC."""
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, __file__, "--fake-scheduler", str(port), *fake_args], stdout=subprocess.PIPE, text=True
    )
    tokenizer = None
    try:
        assert fake.stdout is not None
        fake.stdout.readline()
        http_port = free_port()
        args = tokenizer_args(model_dir, f"127.0.0.1:{port}", extra=["--http-port", str(http_port)] if http else [])
        tokenizer = ServiceProcess("tokenizer", args, workdir / "tokenizer.log")
        tokenizer.wait_serving(TOKENIZER_SERVICE, 120)
        if http:
            url = f"http://127.0.0.1:{http_port}/v1/completions"

            def once() -> tuple[int, int, float]:
                return asyncio.run(_http_stream(url, n, tokens))

        else:
            requests = [make_request(f"Say {i}", max_tokens=tokens) for i in range(n)]

            def once() -> tuple[int, int, float]:
                timelines, wall = run_clients(tokenizer.address, requests, n)  # type: ignore[union-attr]
                # A message's tokens arrive at one instant (`Timeline.token_times`).
                messages = sum(len(set(t.token_times)) for t in timelines)
                return sum(len(t.token_ids) for t in timelines), messages, wall

        return _cpu_per_token(tokenizer, fake, once)
    finally:
        if tokenizer is not None:
            tokenizer.stop()
        fake.terminate()
        fake.wait(10)


def _cpu_per_token(
    tokenizer: ServiceProcess, fake: subprocess.Popen[str], once: Callable[[], tuple[int, int, float]]
) -> dict[str, float]:
    """`once` (a round of the clients: tokens, messages, wall seconds) run to
    warm up, then three times measured: CPU µs per token by process, the
    clients' tokens/s and messages per token."""
    once()
    procs = {"tokenizer": psutil.Process(tokenizer.pid), "scheduler gRPC": psutil.Process(fake.pid)}
    me = psutil.Process()
    before = {k: cpu(p) for k, p in procs.items()} | {"clients": cpu(me)}
    made = messages = 0
    took = 0.0
    for _ in range(3):
        m, e, wall = once()
        made, messages, took = made + m, messages + e, took + wall
    after = {k: cpu(p) for k, p in procs.items()} | {"clients": cpu(me)}
    cost = {k: 1e6 * (after[k] - before[k]) / made for k in before}
    return cost | {"tok/s": made / took, "messages/token": messages / made}


# The real services' arms: (the scheduler's flags, the tokenizer's).
SERVICE_ARMS = {
    "Generate, interval 1": (["--stream-interval", "1"], ["--scheduler-stream", "false"]),
    "GenerateStream, interval 1": (["--stream-interval", "1"], []),
    "GenerateStream, interval 4": (["--stream-interval", "4"], []),
}


def service_rates(
    model_dir: Path, n: int, tokens: int, workdir: Path, rounds: int = 3
) -> dict[str, list[dict[str, float]]]:
    """Through the real services (TP=1), n concurrent one-image requests of
    `tokens` tokens each, each of SERVICE_ARMS in turn, a fresh pair each
    run: the clients' tokens/s ("tok/s") and CPU µs per token by process."""
    image = samples.good_png()
    requests = [make_request(f"Say {i}", [image], max_tokens=tokens, min_tokens=tokens) for i in range(n)]
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in SERVICE_ARMS}
    for round_ in range(rounds):
        for i, (arm, (scheduler_extra, tokenizer_extra)) in enumerate(SERVICE_ARMS.items()):
            logs = workdir / f"services-{model_dir.name}-{i}-{round_}"  # the tiny and 8x512 runs share workdir
            logs.mkdir()
            with running_pair(
                model_dir, logs, tp=1, scheduler_extra=scheduler_extra, tokenizer_extra=tokenizer_extra
            ) as pair:
                run_clients(pair.tokenizer_address, requests, n)  # warm up
                before = cpu_seconds(pair.scheduler.pid, pair.tokenizer.pid)
                timelines, wall = run_clients(pair.tokenizer_address, requests, n)
                after = cpu_seconds(pair.scheduler.pid, pair.tokenizer.pid)
            made = sum(len(t.token_ids) for t in timelines)
            cost = {k: 1e6 * (after[k] - before[k]) / made for k in ("scheduler", "tokenizer", "clients")}
            runs[arm].append(cost | {"tok/s": made / wall})
    return runs


def compute_cost(model_dir: Path, n: int, steps: int = 16) -> float:
    """Microseconds of wall time per token of the engine's batched decode at batch n."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmsplit_server.sampling import Sampling
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


def print_services(services: dict[str, dict[str, list[dict[str, float]]]], n: int, tokens: int) -> None:
    """The real services' arms by model (`service_rates`), each against the per-request Generate arm."""
    print(
        f"\nthe real services (TP=1), {n} concurrent one-image requests x {tokens} tokens: tokens/s at"
        " the clients and CPU µs per token, medians of 3 rounds, the arms in turn: the tokenizer's requests each"
        " over a Generate call (--scheduler-stream false) or all over one GenerateStream call (the default), and"
        " the scheduler's --stream-interval"
    )
    service_rows = []
    for name, arms in services.items():
        base = statistics.median(r["tok/s"] for r in arms["Generate, interval 1"])
        for arm, runs in arms.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            every = ", ".join(f"{r['tok/s']:.0f}" for r in runs)
            cpu_cells = [f"{med[k]:.0f}" for k in ("scheduler", "tokenizer", "clients")]
            service_rows.append([name, arm, f"{med['tok/s']:.0f}", f"{med['tok/s'] / base:.2f}", *cpu_cells, every])
    header = ["model", "arm", "tokens/s", "/ Generate", "scheduler µs/tok", "tokenizer µs/tok", "clients µs/tok"]
    print(table([*header, "every round"], service_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="concurrent requests (and the decode batch)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--step-ms", type=float, default=1.0, help="the fast stand-in's step: one token per request per step"
    )
    parser.add_argument(
        "--services-8x512", action="store_true", help="also run the real services with the 8x512 model (minutes)"
    )
    parser.add_argument(
        "--services-only", action="store_true", help="only the real services' comparison (the last table)"
    )
    parser.add_argument("--fake-scheduler", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fake-step-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--fake-per-token", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fake-interval", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_scheduler:
        fake_scheduler(args.fake_scheduler, args.fake_step_ms, args.fake_per_token, args.fake_interval)
        return
    if args.services_only:
        with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
            found = {"tiny": service_rates(build_model("tiny", Path(tmp)), args.n, args.tokens, Path(tmp))}
            if args.services_8x512:
                found["8x512"] = service_rates(build_model("8x512", Path(tmp)), args.n, args.tokens, Path(tmp))
        print_services(found, args.n, args.tokens)
        return
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        tiny = build_model("tiny", Path(tmp))
        wide = build_model("8x512", Path(tmp))
        stream = streaming_cost(tiny, args.n, args.tokens, Path(tmp))
        step = ["--fake-step-ms", str(args.step_ms)]
        # In turn, twice each, so a drift in this machine's speed falls on both.
        modes = {
            "one message per token (before)": [*step, "--fake-per-token"],
            "--stream-interval 1": step,
            "--stream-interval 4": [*step, "--fake-interval", "4"],
        }
        fast: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for _ in range(2):
            for mode, fake_args in modes.items():
                fast[mode].append(streaming_cost(tiny, args.n, args.tokens, Path(tmp), fake_args))
        protocols: dict[str, list[dict[str, float]]] = {"gRPC": [], "HTTP (SSE)": []}
        for _ in range(3):
            for name, runs in protocols.items():
                runs.append(streaming_cost(tiny, args.n, args.tokens, Path(tmp), http=name != "gRPC"))
        computes = {"tiny": compute_cost(tiny, args.n), "8x512": compute_cost(wide, args.n)}
        services = {"tiny": service_rates(tiny, args.n, args.tokens, Path(tmp))}
        if args.services_8x512:
            services["8x512"] = service_rates(wide, args.n, args.tokens, Path(tmp))
    cpu_keys = ("tokenizer", "scheduler gRPC", "clients")
    total = sum(stream[k] for k in cpu_keys)
    print(f"streaming, CPU µs per token at {args.n} concurrent: " + ", ".join(f"{k} {stream[k]:.0f}" for k in cpu_keys))
    rows = [[name, f"{us:.0f}", f"{total:.0f}", f"{total / us:.2f}"] for name, us in computes.items()]
    print(table(["model", f"decode µs/token at batch {args.n}", "streaming CPU µs/token", "streaming / decode"], rows))
    offered = args.n * 1000 / args.step_ms
    print(
        f"\na stand-in scheduler faster than its tokenizer: {args.n} requests x {args.tokens} tokens,"
        f" a step every {args.step_ms:g} ms ({offered:.0f} tokens/s offered); medians of 2 runs each, in turn"
    )
    fast_rows = []
    for mode, runs in fast.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        fast_rows.append(
            [
                mode,
                f"{med['tok/s']:.0f}",
                f"{med['tok/s'] / offered:.2f}",
                f"{med['messages/token']:.2f}",
                f"{med['tokenizer']:.0f}",
                f"{med['scheduler gRPC']:.0f}",
            ]
        )
    print(
        table(
            [
                "rank 0 streams",
                "tokens/s at the clients",
                "of offered",
                "messages/token",
                "tokenizer µs/token",
                "scheduler µs/token",
            ],
            fast_rows,
        )
    )

    print(
        f"\nthe same streaming by protocol ({args.n} concurrent x {args.tokens} tokens, the stand-in streaming at"
        " once); the tokenizer's CPU per token, median of 3 runs each, in turn"
    )
    med = {name: statistics.median(r["tokenizer"] for r in runs) for name, runs in protocols.items()}
    proto_rows = [
        [name, f"{med[name]:.0f}", ", ".join(f"{r['tokenizer']:.0f}" for r in runs), f"{med[name] / med['gRPC']:.2f}"]
        for name, runs in protocols.items()
    ]
    print(table(["protocol", "tokenizer µs/token", "every run", "÷ gRPC"], proto_rows))

    print_services(services, args.n, args.tokens)


if __name__ == "__main__":
    main()
