"""Time from a CPU worker's death to the next successful request.

Kills one preprocessing worker (SIGKILL) of a running tokenizer and at once
sends requests until one succeeds, then waits until the pool is whole again
(the dead worker replaced, all workers up); repeats, and prints the medians over the kills
against the median latency of a request with no kill, measured in the same
run. The first request after a kill may be served by a surviving worker;
"whole again" is the full recovery (the dead worker replaced).

    python bench/pool_recovery.py [--kills 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from mmsplit_cli.launch import Pair, running_pair

ROOT = Path(__file__).resolve().parent.parent


def workers(pair: Pair) -> list[psutil.Process]:
    tokenizer = psutil.Process(pair.tokenizer.pid)
    forkservers = [c for c in tokenizer.children() if "forkserver" in " ".join(c.cmdline())]
    return [w for f in forkservers for w in f.children()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    image = samples.good_png()
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        from mmsplit_cli.tiny_model import build

        model = build(Path(tmp) / "tiny", cache_dir=ROOT / ".cache")
        with running_pair(model, Path(tmp)) as pair, grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            request = make_request("x", [image], max_tokens=1)
            warm = [run_request(stub, request) for _ in range(20)]
            if not all(o.ok for o in warm):
                raise RuntimeError(f"requests fail before any kill: {[o.reason for o in warm][:3]}")
            baseline = statistics.median(o.latency_s for o in warm)
            recoveries, wholes, failed_first = [], [], 0
            workers_per_pool = len(workers(pair))
            for _ in range(args.kills):
                victims = workers(pair)
                if not victims:
                    tree = [(p.pid, p.cmdline()[-1][:60]) for p in psutil.Process(pair.tokenizer.pid).children(True)]
                    log = pair.tokenizer.tail(15)
                    raise RuntimeError(f"kill {len(recoveries)}: no pool worker under the tokenizer: {tree}\n{log}")
                os.kill(victims[0].pid, signal.SIGKILL)
                start = time.perf_counter()
                while not run_request(stub, request, timeout=60).ok:
                    failed_first += 1
                recoveries.append(time.perf_counter() - start)
                # Whole again: the dead worker replaced (the others never stop).
                deadline = time.perf_counter() + 60
                while not (len(live := workers(pair)) == workers_per_pool and victims[0] not in live):
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"the pool did not get whole again within 60 s: {live}")
                    time.sleep(0.01)
                wholes.append(time.perf_counter() - start)
    median = statistics.median(recoveries)
    print(f"request without a kill: median {baseline * 1e3:.0f} ms")
    whole = statistics.median(wholes)
    print(
        f"kill -> next success over {len(recoveries)} kills: median {median * 1e3:.0f} ms "
        f"({median / baseline:.1f}x), worst {max(recoveries) * 1e3:.0f} ms; requests failed meanwhile: {failed_first}"
    )
    worst = max(wholes)
    print(
        f"kill -> pool whole again: median {whole * 1e3:.0f} ms ({whole / baseline:.1f}x), worst {worst * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
