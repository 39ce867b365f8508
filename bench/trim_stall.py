"""How long the event loop's thread waits for its allocations while another
thread gives the heaps' free memory back (`malloc_trim`), against the same
allocations with no trim running.

`mallocheap.Bound` trims off the event loop, on a thread, but glibc's
`malloc_trim` locks each heap while it walks it, and the loop's thread
allocates from the main heap: every allocation it makes meanwhile waits.
The tokenizer's holes are mostly there (big bodies and data: URLs read and
parsed on the loop). This is why a busy tokenizer waits for an idle moment
before it trims (`Bound.check(busy=True)`), unless its heaps hold far more
free than its limit.

For each size of holes, in a new interpreter with the services' heap
thresholds (`mallocheap.keep`): buffers of 9 MiB from the main heap, each
followed by a small one that stays, half of them freed (holes no threshold
trims); then the main thread times 64 KiB allocations in a loop for as
long as a thread's `malloc_trim(0)` runs, and for as long again with no
trim. Printed per size (medians over --rounds): the trim's time, the
resident memory it gave back, and the main thread's longest wait for an
allocation with and without the trim running.

    python bench/trim_stall.py [--mib 256,512,1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, table

ONE = r"""
import ctypes, json, sys, threading, time
from mmsplit_server import mallocheap
mallocheap.keep()
libc = ctypes.CDLL("libc.so.6")
buffers, pins = [], []
for _ in range(2 * int(sys.argv[1]) // 9):
    buffers.append(bytearray(9 << 20))
    pins.append(bytearray(4096))
del buffers[::2]
held, before = mallocheap.free_held(), mallocheap.resident()

def allocating(until) -> float:
    # The longest one 64 KiB allocation took while `until()` is false.
    worst = 0.0
    while not until():
        began = time.perf_counter()
        block = bytearray(64 << 10)
        worst = max(worst, time.perf_counter() - began)
        del block
    return worst

done, took = threading.Event(), []
def trim():
    began = time.perf_counter()
    libc.malloc_trim(0)
    took.append(time.perf_counter() - began)
    done.set()
thread = threading.Thread(target=trim)
thread.start()
during = allocating(done.is_set)
thread.join()
given_back = before - mallocheap.resident()
stop = time.perf_counter() + took[0]
alone = allocating(lambda: time.perf_counter() >= stop)
print(json.dumps({"held": held, "given_back": given_back, "trim": took[0], "during": during, "alone": alone}))
"""


def one(mib: int) -> dict[str, float]:
    argv = [sys.executable, "-c", ONE, str(mib)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"the {mib} MiB run failed: {out.stderr.strip()[-500:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="256,512,1024", help="sizes of the holes, MiB (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for mib in (int(m) for m in args.mib.split(",")):
        runs = [one(mib) for _ in range(args.rounds)]

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        rows.append(
            [
                mib,
                f"{median('held') / (1 << 20):.0f}",
                f"{median('given_back') / (1 << 20):.0f}",
                f"{1000 * median('trim'):.1f}",
                f"{1000 * median('during'):.1f}",
                f"{1000 * median('alone'):.2f}",
                f"{median('during') / max(median('alone'), 1e-9):.0f}x",
            ]
        )
    print(f"the main thread's 64 KiB allocations while a thread runs malloc_trim(0), medians of {args.rounds} rounds")
    header = ["holes MiB", "free held MiB", "given back MiB", "trim ms", "longest wait ms, trimming", "alone", "ratio"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
