"""What the service benchmarks share: models, service pairs, timed clients,
in-process Hugging Face baselines, and printing.

Every benchmark measures its baseline in the same run as what it compares,
on the same machine, and prints ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from mmsplit import localauth
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("MMSPLIT_TEST_ZYGOTE_AT"):  # run by the test suite (tests/support/bench.py)
    from tests.support.zygote import fork_from_the_suite_s_zygote

    fork_from_the_suite_s_zygote()

MODELS = {
    # name: (text layers, text hidden size)
    "tiny": (2, 64),
    "8x512": (8, 512),
}


@contextlib.contextmanager
def scratch_dir(given: Path | None) -> Iterator[Path]:
    """`given` (made if missing), or a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        path = given or Path(tmp)
        path.mkdir(parents=True, exist_ok=True)
        yield path


MODELS_DIR = "MMSPLIT_BENCH_MODELS"


def build_model(name: str, workdir: Path, *, chat: bool = False) -> Path:
    """One of `MODELS` (random weights, real tokenizer), written under
    `workdir`; or, when the environment names a directory in
    MMSPLIT_BENCH_MODELS (the tests do), kept there and reused by every
    benchmark run after the first (a build costs ~10 s here). Without
    `chat`, no chat template: prompts are taken as written, and the
    baselines run `generate` on the same text; with it, the template its
    family's public checkpoints ship, for conversations (the HTTP API's)."""
    from mmsplit_cli.tiny_model import build_once

    layers, hidden = MODELS[name]
    base = Path(os.environ[MODELS_DIR]) if os.environ.get(MODELS_DIR) else workdir
    return build_once(
        base / f"model-{name}{'-chat' if chat else ''}",
        cache_dir=ROOT / ".cache",
        text_layers=layers,
        text_hidden=hidden,
        chat_template=chat,
    )


@dataclass
class Timeline:
    """One streamed request as the client saw it (seconds, perf_counter)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    ended: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def _stream(stub: tokenizer_pb2_grpc.TokenizerServiceStub, request: tokenizer_pb2.GenerateRequest) -> Timeline:
    line = Timeline(sent=time.perf_counter())
    try:
        async for event in stub.Generate(request, timeout=600):
            if event.HasField("delta") and event.delta.token_ids:
                now = time.perf_counter()
                line.token_ids.extend(event.delta.token_ids)
                line.token_times.extend([now] * len(event.delta.token_ids))
    except grpc.aio.AioRpcError as exc:
        line.error = f"{exc.code().name}: {exc.details()}"
    line.ended = time.perf_counter()
    return line


def run_clients(
    address: str, requests: Sequence[tokenizer_pb2.GenerateRequest], concurrency: int
) -> tuple[list[Timeline], float]:
    """Send every request, `concurrency` at a time (each client sends its
    next request when the previous one ends); returns the timelines in
    request order and the wall time of the whole run. The clients are
    coroutines on one event loop and one channel: the load generator shares
    the machine with the services, so it should cost as little as it can."""

    async def run() -> tuple[list[Timeline], float]:
        results: list[Timeline | None] = [None] * len(requests)
        pending = iter(range(len(requests)))
        async with grpc.aio.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

            async def client() -> None:
                for i in pending:
                    results[i] = await _stream(stub, requests[i])

            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall = time.perf_counter() - start
        return [r for r in results if r is not None], wall

    return asyncio.run(run())


class SoloGroup:
    """A process group of one rank, for running a scheduler `Engine` in the
    benchmark's own process: every collective is the identity."""

    rank = 0
    world_size = 1

    def broadcast_from_0(self, obj: object) -> object:
        return obj

    def all_gather_row(self, row: Any) -> Any:
        return row[None]

    def gather_to_0(self, obj: object) -> list[object]:
        return [obj]


def inline_reader() -> Any:
    """The services' own tensor reader, for an engine in this process given
    inline tensors: it lends their bytes in place, as it does in service."""
    from scheduler_svc.reader import SharedMemoryReader

    return SharedMemoryReader(rank=0, prefix="mmsplitbench", max_bytes=1 << 40)


def cache_hits(tokenizer_address: str, scheduler_address: str) -> dict[str, int]:
    """The services' cache hits so far: the tokenizer's preprocessing cache,
    the scheduler's encoder and prefix caches (a benchmark that compares the
    services with arms that have no cache checks these stay 0)."""
    from mmsplit.client import Client

    with Client(tokenizer_address) as client:
        tok = client.server_info()
    with grpc.insecure_channel(scheduler_address) as channel:
        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetServerInfo
        # A scheduler on loopback asks for its local token (mmsplit.localauth).
        sched = call(scheduler_pb2.GetServerInfoRequest(), metadata=localauth.LocalToken(scheduler_address).metadata())
    return {
        "preprocess": tok.info.preprocess_cache_hits,
        "encoder": sched.info.encoder_cache_hits,
        "prefix": sched.info.prefix_cache_hits,
        "prefix tokens": sched.info.prefix_cache_hit_tokens,
    }


def cpu_seconds(scheduler_pid: int, tokenizer_pid: int) -> dict[str, float]:
    """CPU time used so far by each part of the system on this machine: the
    scheduler's ranks, the tokenizer's main process, its preprocessing
    workers, and this process (the clients)."""

    def used(procs: Iterable[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    scheduler = psutil.Process(scheduler_pid)
    tokenizer = psutil.Process(tokenizer_pid)
    return {
        "scheduler": used([scheduler, *scheduler.children(recursive=True)]),
        "tokenizer": used([tokenizer]),
        "workers": used(tokenizer.children(recursive=True)),
        "clients": used([psutil.Process()]),
    }


def per_call_us(call: Callable[[], object], reps: int) -> float:
    """µs per call of `call`, over `reps` calls after one to warm up."""
    call()
    began = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - began) / reps * 1e6


def percentile(values: Iterable[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    if len(data) == 1:
        return data[0]
    return statistics.quantiles(data, n=100, method="inclusive")[int(q) - 1]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
