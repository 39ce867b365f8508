"""Per-step cost of agreeing on failed requests across TP=2 gloo ranks.

Compares, in one run on the same process group, for 1, 8 and 32 new requests
per step:
  ours      — `agree_on_failures`: ONE all_gather of a small int64 row
              (plus a gather of messages only in steps where something failed)
  baseline  — the per-request pattern: one `all_gather_object` per request
and prints the median per step and the ratio baseline / ours.

    python bench/consensus.py [--steps N]

It starts its two ranks itself (two local processes) and ends them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 8, 32)


def rank_main(rank: int, port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from scheduler_svc.agreement import agree_on_failures
    from scheduler_svc.collective import TorchCollective

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    coll = TorchCollective(torch.device("cpu"))

    def ours(n: int, fail: bool) -> None:
        codes = [0] * n
        if fail and rank == 1:
            codes[0] = 11
        agree_on_failures(coll, codes, ["x" if c else "" for c in codes], active=n)

    def baseline(n: int, fail: bool) -> None:
        for i in range(n):
            verdicts: list[object] = [None, None]
            code = 11 if fail and rank == 1 and i == 0 else 0
            dist.all_gather_object(verdicts, (code, "x" if code else ""))

    def timed(fn, n: int, fail: bool) -> float:  # type: ignore[no-untyped-def]
        for _ in range(5):
            fn(n, fail)
        samples = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            fn(n, fail)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    rows = []
    for fail in (False, True):
        for n in SIZES:
            rows.append((n, fail, timed(ours, n, fail), timed(baseline, n, fail)))
    if rank == 0:
        print(f"{'new requests/step':>18} {'a failure':>10} {'ours ms':>9} {'baseline ms':>12} {'baseline/ours':>14}")
        for n, fail, t_ours, t_base in rows:
            failed = "yes" if fail else "no"
            print(f"{n:18d} {failed:>10} {t_ours * 1e3:9.3f} {t_base * 1e3:12.3f} {t_base / t_ours:13.1f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.steps)
        return
    from mmsplit_server.serving import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--port", str(port)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in (0, 1)]
    try:
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
