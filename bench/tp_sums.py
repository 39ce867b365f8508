"""The model's tensor-parallel sums: gloo against the shared-memory arena.

In ONE run, two (or --world) ranks forked from this process as a local CPU
group's ranks are (one thread each, as the scheduler gives them), joined in
a gloo group, sum tensors of the sizes a TP step sums: a decode step's hidden
state of one row and of 32 rows (hidden 512, the 8x512 benchmark model), a
prefill's 1,024 rows, and more than one arena slot. Each size: gloo's
`all_reduce` and `Arena.all_reduce_` in turn, --reps each after a warm-up,
µs per sum and the ratio. Both results are checked against the expected sum.

    python bench/tp_sums.py [--world 2] [--reps 500]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import table

from mmsplit_server.serving import free_port
from scheduler_svc.shm_allreduce import SLOT_BYTES, Arena, supported

SIZES = {
    "1 row x 512": 512,
    "32 rows x 512": 32 * 512,
    "1024 rows x 512": 1024 * 512,
    "> a slot": SLOT_BYTES // 4 + 4096,
}


def rank_main(arena: Arena, rank: int, world: int, port: int, reps: int) -> dict[str, list[float]]:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    arena.attach(rank, 120.0)
    out: dict[str, list[float]] = {}
    expected = sum(range(1, world + 1))
    for name, n in SIZES.items():
        t = torch.empty(n)
        times = []
        for way in (lambda x: dist.all_reduce(x), arena.all_reduce_):
            for _ in range(20):
                t.fill_(rank + 1.0)
                way(t)
            dist.barrier()
            count = max(10, reps if n <= 1 << 20 else reps // 10)
            began = time.perf_counter()
            for _ in range(count):
                t.fill_(rank + 1.0)
                way(t)
            times.append((time.perf_counter() - began) / count * 1e6)
            if not bool((t == expected).all()):
                raise AssertionError(f"{name}: a wrong sum")
        out[name] = times
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=500)
    args = parser.parse_args()
    if not supported():
        raise SystemExit("the arena is used on x86 hosts only")
    arena, port = Arena(args.world), free_port()
    children = []
    for rank in range(args.world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a rank, as a local group's are: a fork of this process before any thread
            os.close(read)
            code = 0
            try:
                result: object = rank_main(arena, rank, args.world, port, args.reps)
            except BaseException as exc:  # reported by the parent
                result, code = repr(exc), 1
            os.write(write, json.dumps(result).encode())
            os._exit(code)
        os.close(write)
        children.append((pid, read))
    results = []
    for pid, read in children:
        with os.fdopen(read) as f:
            results.append(json.loads(f.read() or "null"))
        os.waitpid(pid, 0)
    if not isinstance(results[0], dict):
        raise SystemExit(f"a rank failed: {results}")
    rows = []
    for name, n in SIZES.items():
        gloo, shm = results[0][name]
        rows.append([name, f"{n * 4 / 1024:.0f} KiB", f"{gloo:.1f}", f"{shm:.1f}", f"{gloo / shm:.1f}x"])
    print(f"{args.world} forked ranks, one thread each; µs per sum (float32), rank 0's timing")
    print(table(["tensor", "bytes", "gloo µs", "shared memory µs", "gloo / shm"], rows))


if __name__ == "__main__":
    main()
