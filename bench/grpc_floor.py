"""What gRPC itself costs per streamed message, with no mmsplit code: the
floor under every token the services stream.

A bare grpc.aio server (a process of its own) streams small messages
(40 bytes, a token's size) to a bare grpc.aio client (this process), as
the scheduler streams to the tokenizer and the tokenizer to its client.
Arms, interleaved over rounds, medians reported:
  back to back — the messages as fast as they go (a burst: many streams'
                 tokens of one step, or a fast model)
  every N ms   — one message every N ms (one stream of a model that makes
                 a token every N ms: one request at a time)
  open, silent — a stream open with nothing on it: CPU per second
For each: CPU µs per message on the server and on the client, and the
paced arms ÷ back to back. On a host whose cores the model's threads also
use, this CPU is what one request at a time pays per token at each gRPC
hop (two hops: the scheduler's and the tokenizer's).

    python bench/grpc_floor.py [--intervals-ms 5,20,100] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
import psutil
from harness import table

SERVICE, METHOD = "floor.Floor", "Stream"
# The request: the interval between messages (s, 0: back to back) and how many.
_REQUEST = struct.Struct("<dI")
MESSAGE = b"x" * 40


def _serve(ports: Any) -> None:
    """The server process: stream what each request asks for."""

    async def stream(request: bytes, context: Any) -> Any:
        interval, count = _REQUEST.unpack(request)
        for _ in range(count):
            if interval:
                await asyncio.sleep(interval)
            yield MESSAGE

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_stream_rpc_method_handler(stream)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu(proc: psutil.Process) -> float:
    """CPU seconds of the process's threads, to the nanosecond where Linux
    says (each thread's schedstat): `cpu_times` counts in clock ticks, 10 ms
    here, and a paced arm of a short run can use less than one tick. (A
    thread that ended between two readings drops out of the second: gRPC's
    threads live as long as the process.)"""
    tasks = Path(f"/proc/{proc.pid}/task")
    if not tasks.is_dir():
        times = proc.cpu_times()
        return times.user + times.system
    total = 0
    for task in tasks.iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue  # the thread ended as we looked
    return total / 1e9


async def _arm(channel: grpc.aio.Channel, server: psutil.Process, interval: float, count: int) -> tuple[float, float]:
    """Server and client CPU seconds over one streamed call."""
    call = channel.unary_stream(f"/{SERVICE}/{METHOD}")
    me = psutil.Process()
    before = _cpu(server), _cpu(me)
    got = 0
    async for _ in call(_REQUEST.pack(interval, count)):
        got += 1
    after = _cpu(server), _cpu(me)
    if got != count:
        raise RuntimeError(f"{got} of {count} messages came")
    return after[0] - before[0], after[1] - before[1]


async def measure(port: int, server: psutil.Process, intervals: list[float], seconds: float, rounds: int) -> list[Any]:
    """[(arm, messages, server µs/msg, client µs/msg)] medians; the silent
    arm's figures are µs per second open."""
    arms: dict[str, list[tuple[float, float]]] = {}
    counts: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await _arm(channel, server, 0.0, 100)  # warm up: the connection, the first call
        for _ in range(rounds):
            plan = [("back to back", 0.0, max(100, int(seconds * 2000)))]
            plan += [(f"every {i * 1000:g} ms", i, max(2, int(seconds / i))) for i in intervals]
            for name, interval, count in plan:
                server_s, client_s = await _arm(channel, server, interval, count)
                arms.setdefault(name, []).append((server_s / count * 1e6, client_s / count * 1e6))
                counts[name] = count
            # One message after `seconds`: the CPU of a stream that waits.
            server_s, client_s = await _arm(channel, server, seconds, 1)
            arms.setdefault("open, silent (per s)", []).append((server_s / seconds * 1e6, client_s / seconds * 1e6))
            counts["open, silent (per s)"] = 1
    return [
        (name, counts[name], statistics.median(s for s, _ in got), statistics.median(c for _, c in got))
        for name, got in arms.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", default="5,20,100", help="the paced arms' intervals")
    parser.add_argument("--seconds", type=float, default=2.0, help="how long each arm streams")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    args = parser.parse_args()
    intervals = [float(ms) / 1000 for ms in args.intervals_ms.split(",")]
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    proc = context.Process(target=_serve, args=(ports,), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        started = time.perf_counter()
        rows = asyncio.run(measure(port, psutil.Process(proc.pid), intervals, args.seconds, args.rounds))
        took = time.perf_counter() - started
    finally:
        proc.kill()
        proc.join()
    base = rows[0][2] + rows[0][3]
    print(
        f"bare grpc.aio, one server-streaming call per arm ({len(MESSAGE)}-byte messages), server in a process of "
        f"its own; CPU µs per message, medians of {args.rounds} interleaved rounds ({took:.0f} s)"
    )
    print(
        table(
            ["arm", "messages", "server µs/msg", "client µs/msg", "both ÷ back to back"],
            [
                (name, count, f"{s:.0f}", f"{c:.0f}", "" if name.startswith("open") else f"{(s + c) / base:.1f}")
                for name, count, s, c in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
