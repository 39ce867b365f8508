"""What the service benchmarks share: models, service pairs, timed clients,
in-process Hugging Face baselines, and printing.

Every benchmark measures its baseline in the same run as what it compares,
on the same machine, and prints ratios.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

MODELS = {
    # name: (text layers, text hidden size)
    "tiny": (2, 64),
    "8x512": (8, 512),
}


def build_model(name: str, workdir: Path) -> Path:
    """One of `MODELS`, written under `workdir` (random weights, real tokenizer)."""
    from mmsplit_cli.tiny_model import build

    layers, hidden = MODELS[name]
    out = workdir / f"model-{name}"
    if (out / "config.json").exists():
        return out
    return build(out, cache_dir=ROOT / ".cache", text_layers=layers, text_hidden=hidden)


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


def stream(stub: tokenizer_pb2_grpc.TokenizerServiceStub, request: tokenizer_pb2.GenerateRequest) -> Timeline:
    line = Timeline(sent=time.perf_counter())
    try:
        for event in stub.Generate(request, timeout=600):
            if event.HasField("delta") and event.delta.token_ids:
                now = time.perf_counter()
                line.token_ids.extend(event.delta.token_ids)
                line.token_times.extend([now] * len(event.delta.token_ids))
    except grpc.RpcError as exc:
        line.error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    line.ended = time.perf_counter()
    return line


def run_clients(
    address: str, requests: Sequence[tokenizer_pb2.GenerateRequest], concurrency: int
) -> tuple[list[Timeline], float]:
    """Send every request, `concurrency` at a time (each client sends its
    next request when the previous one ends); returns the timelines in
    request order and the wall time of the whole run."""
    results: list[Timeline | None] = [None] * len(requests)
    lock = threading.Lock()
    next_index = iter(range(len(requests)))

    def client(stub: tokenizer_pb2_grpc.TokenizerServiceStub) -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = stream(stub, requests[i])

    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(client, stub) for _ in range(concurrency)]:
                f.result()
        wall = time.perf_counter() - start
    return [r for r in results if r is not None], wall


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
