"""`mallocheap.keep`: a process that handles large buffers keeps its freed
memory for the next one. Counted in page faults, not time: copying a 48 MiB
buffer again faults its pages in again under glibc's thresholds at their
top (set by the environment, which `keep` leaves alone), and not once the
heap is kept; nor does a 96 MiB one (a Qwen image's rows in bfloat16 at
its checkpoint's budget come to ~77 MB, under the scheduler's default cap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mmsplit_server import mallocheap

PROBE = """
import json, resource
from mmsplit_server import mallocheap
kept = mallocheap.keep()
import sys
source = bytearray(int(sys.argv[1]) << 20)
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    copy = bytes(source)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del copy
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _probe(env: dict[str, str], mib: int = 48) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in mallocheap.ENVIRONMENT}
    argv = [sys.executable, "-c", PROBE, str(mib)]
    out = subprocess.run(argv, env=clean | env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_kept_heap_copies_a_large_buffer_again_without_faulting_its_pages_in() -> None:
    pages = (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    kept = _probe({})
    assert kept["kept"] is True
    defaults = _probe({"MALLOC_MMAP_THRESHOLD_": str(32 << 20)})
    assert defaults["kept"] is False
    again_kept, again_defaults = kept["faults"][1:], defaults["faults"][1:]  # type: ignore[index]
    assert all(f > pages // 2 for f in again_defaults), defaults
    assert all(f < pages // 50 for f in again_kept), kept
    big = _probe({}, mib=96)
    assert all(f < (96 << 20) // os.sysconf("SC_PAGE_SIZE") // 50 for f in big["faults"][1:]), big  # type: ignore[index]


TRIM = """
import json, os
from mmsplit_server import mallocheap
mallocheap.keep()
def holes(n):
    # 8 MiB buffers from the heap, each followed by a small one that stays:
    # freed, the big ones leave holes inside the heap, which no threshold trims.
    blocks = []
    for _ in range(n):
        blocks.append(bytearray(8 << 20))
        pins.append(bytearray(4096))
pins = []
holes(48)
held, before = mallocheap.free_held(), mallocheap.resident()
out = {"held": held, "before": before}
out["under"] = mallocheap.Bound(limit=held + (1 << 20)).check()  # under its limit: nothing
# Busy: over its limit but within BUSY_FACTOR times it: nothing either.
out["busy_under"] = mallocheap.Bound(limit=held // 2, every_s=0).check(busy=True)
bound = mallocheap.Bound(limit=64 << 20, every_s=3600)
out["first"] = bound.check()
out["after"] = mallocheap.resident()
holes(48)  # the same holes, written again: resident again
out["too_soon"] = bound.check()  # within its interval: not trimmed
bound.every_s = 0
out["regrown"] = bound.check(busy=True)  # busy, but past BUSY_FACTOR times its limit
print(json.dumps(out))
"""


def test_free_memory_inside_the_heap_is_given_back_once_over_the_bound() -> None:
    clean = {k: v for k, v in os.environ.items() if k not in mallocheap.ENVIRONMENT}
    out = subprocess.run([sys.executable, "-c", TRIM], env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    mib = 1 << 20
    assert got["held"] >= 300 * mib, got  # the holes: free memory the heap keeps
    assert got["before"] >= got["held"], got  # and resident
    assert got["under"] == 0, got
    assert got["busy_under"] == 0, got
    assert got["first"] >= 300 * mib, got  # over the bound: given back
    assert got["before"] - got["after"] >= 300 * mib, got
    assert got["too_soon"] == 0, got
    assert got["regrown"] >= 300 * mib, got
