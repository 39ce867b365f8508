"""Slow image origins must not fail requests (the fault-injection setup
published against another server, where 7.95% of requests failed).

A local origin delays 12% of fetches beyond the preprocessing timeout (3 s);
the tokenizer runs 4 CPU workers; 12 concurrent clients send rounds of
requests whose image is a URL on that origin, through the real services.
Fetching has its own timeouts and never spends the preprocessing budget, so
the failure rate must be 0. It also prints the latency of delayed and
undelayed requests against a round without delays measured in the same run.

    python bench/fetch_faults.py [--rounds 100] [--clients 12] [--tp 2]
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import running_pair

ROOT = Path(__file__).resolve().parent.parent

PREPROCESS_TIMEOUT_S = 3.0
DELAY_S = 3.5  # beyond the preprocessing timeout
DELAYED_SHARE = 0.12


class _Origin(http.server.BaseHTTPRequestHandler):
    image = b""
    delayed = 0
    served = 0
    lock = threading.Lock()
    delay_enabled = True

    def do_GET(self) -> None:
        # /img/<n>: every n with n % 25 in {0, 8, 16} is delayed (12%).
        n = int(self.path.rsplit("/", 1)[-1])
        if _Origin.delay_enabled and n % 25 in (0, 8, 16):
            with _Origin.lock:
                _Origin.delayed += 1
            time.sleep(DELAY_S)
        with _Origin.lock:
            _Origin.served += 1
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(self.image)))
        self.end_headers()
        self.wfile.write(self.image)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    delayed: list[float] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)

    @property
    def failures(self) -> Counter[str]:
        return Counter(o.reason for o in self.outcomes if not o.ok)

    @property
    def failure_rate(self) -> float:
        return sum(self.failures.values()) / max(1, len(self.outcomes))


def run(*, rounds: int, clients: int, tp: int, model: Path, workdir: Path) -> Report:
    _Origin.image = samples.good_jpeg()
    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{origin.server_address[1]}/img"
    tokenizer_flags = [
        "--cpu-workers", "4",
        "--io-threads", str(2 * clients),
        "--preprocess-timeout-s", str(PREPROCESS_TIMEOUT_S),
        "--fetch-timeout-s", "10",
        "--private-fetch-exempt", base.split("/")[2],
    ]  # fmt: skip
    report = Report()
    try:
        with (
            running_pair(model, workdir, tokenizer_extra=tokenizer_flags, scheduler_extra=["--tp", str(tp)]) as pair,
            grpc.insecure_channel(pair.tokenizer_address) as channel,
            ThreadPoolExecutor(clients) as pool,
        ):
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

            def one(n: int) -> Outcome:
                return run_request(stub, make_request("Describe.", urls=[f"{base}/{n}"], max_tokens=1), 60)

            _Origin.delay_enabled = False
            report.baseline = [o.latency_s for o in pool.map(one, range(1, clients + 1))]
            _Origin.delay_enabled = True
            for r in range(rounds):
                ids = range(r * clients, (r + 1) * clients)
                for n, out in zip(ids, pool.map(one, ids), strict=True):
                    report.outcomes.append(out)
                    (report.delayed if n % 25 in (0, 8, 16) else report.prompt).append(out.latency_s)
    finally:
        origin.shutdown()
        origin.server_close()
    return report


def print_report(report: Report, rounds: int, clients: int) -> None:
    base = statistics.median(report.baseline)
    total = len(report.outcomes)
    print(f"{total} requests ({rounds} rounds x {clients} clients), {_Origin.delayed} fetches delayed {DELAY_S}s")
    print(f"failure rate: {report.failure_rate:.4%}  {dict(report.failures) or ''}")
    for label, values in (("undelayed", report.prompt), ("delayed", report.delayed)):
        if values:
            med = statistics.median(values)
            ratio = med / base
            print(f"{label:10} median {med * 1e3:7.0f} ms = {ratio:5.1f}x the no-delay baseline ({base * 1e3:.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny one built here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        model = args.model
        if model is None:
            from mmsplit_cli.tiny_model import build

            model = build(Path(tmp) / "tiny", cache_dir=ROOT / ".cache")
        report = run(rounds=args.rounds, clients=args.clients, tp=args.tp, model=model, workdir=Path(tmp))
    print_report(report, args.rounds, args.clients)
    sys.exit(1 if report.failure_rate > 0 else 0)


if __name__ == "__main__":
    main()
