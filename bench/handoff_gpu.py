"""What a CUDA-IPC hand-off of a pixel tensor costs, against a device-to-device
copy, measured in the same run (needs a CUDA GPU; `tests/gpu/run.sh` runs it).

The exporter (this process, standing in for the tokenizer) stages tensors
into one pool allocation it owns and shares the pool once through torch's
CUDA-IPC reductions; the importer (a spawned process, standing in for a
scheduler rank) opens the pool's handle once and, per tensor, copies its
slice into a tensor of its own. Printed per size:
  d2d      — the importer copying between two of its own tensors (the floor)
  ipc      — the importer copying from the exporter's pool (handle open, cached)
  open     — the first open of the handle (paid once per pool and process)
  h2d      — the host-to-device upload the SHM path needs on each rank
and ipc/d2d, h2d/d2d. This measures the mechanism a CUDA-IPC transport
would use; the services do not offer that transport yet.

    python bench/handoff_gpu.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

SIZES_MB = [0.6, 1.35, 6.77, 27.1]
POOL_BYTES = 64 << 20


def _timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def importer(queue, results, repeat: int) -> None:  # type: ignore[no-untyped-def]
    torch.cuda.set_device(0)
    start = time.perf_counter()
    pool = queue.get()  # rebuilt from its IPC handle: the handle is opened here
    torch.cuda.synchronize()
    opened = time.perf_counter() - start
    rows = []
    for mb in SIZES_MB:
        n = int(mb * 1e6)
        mine = torch.empty(n, dtype=torch.uint8, device="cuda")
        other = torch.empty(n, dtype=torch.uint8, device="cuda")
        host = torch.empty(n, dtype=torch.uint8).pin_memory()
        d2d = _timed(lambda mine=mine, other=other: mine.copy_(other), repeat)
        ipc = _timed(lambda mine=mine, n=n: mine.copy_(pool[:n]), repeat)
        h2d = _timed(lambda mine=mine, host=host: mine.copy_(host, non_blocking=True), repeat)
        same = bool(torch.equal(mine.copy_(pool[:n]), pool[:n]))
        rows.append((mb, d2d, ipc, h2d, same))
    results.put((opened, rows))
    queue.get()  # hold the handle until the exporter says goodbye


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    pool = torch.randint(0, 255, (POOL_BYTES,), dtype=torch.uint8, device="cuda")
    child = ctx.Process(target=importer, args=(queue, results, args.repeat))
    child.start()
    queue.put(pool)
    opened, rows = results.get(timeout=300)
    queue.put(None)
    child.join(60)
    print(f"{torch.cuda.get_device_name(0)}; first open of the pool's IPC handle: {opened * 1e3:.1f} ms")
    print(f"{'MB':>6} {'d2d µs':>8} {'ipc µs':>8} {'h2d µs':>8} {'ipc/d2d':>8} {'h2d/d2d':>8} {'same':>5}")
    for mb, d2d, ipc, h2d, same in rows:
        print(
            f"{mb:6.2f} {d2d * 1e6:8.1f} {ipc * 1e6:8.1f} {h2d * 1e6:8.1f} {ipc / d2d:7.2f}x {h2d / d2d:7.2f}x"
            f" {same!s:>5}"
        )


if __name__ == "__main__":
    main()
