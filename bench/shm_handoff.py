"""Cost of handing one pixel tensor from the tokenizer to a scheduler rank.

Measures, in one run and one process, per tensor size:
  copy    — a plain numpy copy (the floor every hand-off is compared to)
  slab r0 — the path the services take to rank 0: a worker allocates a
            slice of the pre-faulted slab and writes it, the tokenizer takes
            it over, rank 0 takes it (Accepted), rank 0's reader (the
            services' own, `scheduler_svc.reader`) lends it in place under
            that same lock (`ranges.take` shares a slice its process holds),
            the step ends, rank 0 lets go
  slab rk — the same to another rank, whose reader takes a lock of its own
            (another process: nothing to share); with two or more ranks the
            step waits for this one
  slab+copy — slab rk, the rank copying the slice into a fresh tensor (what
            the reader did before it lent slices in place)
  shm     — a segment per tensor (the path with the slab off): write a new
            segment, the reader copies it into a fresh buffer, unlink
  inline  — encode the bytes into a TensorRef protobuf, decode, the reader
            lends the decoded bytes
  →slab   — the copy alone, into the slab's mapping instead of a private
            buffer (no lock, no bookkeeping): how much of the slab paths'
            time over `copy` is the destination memory itself, not our code
and prints each as a ratio to `copy`. Every run of every path starts from
the caches a worker leaves when it hands a tensor over (the tensor just
made, everything else evicted), and the paths are taken in turn in each
repetition, in an order shuffled each time, so a drift in this machine's
speed falls on all alike. For comparison, "hot copy" is the copy run right
after the same copy (source and destination in L2 below ~2 MB, as in a
tight loop of copies), timed in turn with the others, and the slab paths
against it: the stricter ratios. The tokenizer's worker pays the write,
each rank pays one read; a fresh segment pays its page faults, which the
slab's pages, reserved once, do not.

What a lent tensor's consumer does with the bytes is not counted on any
path: the engine makes the model's inputs from what the reader returns by
a conversion or a concatenation (one pass over the bytes), as it would
from a tensor made in its own process; a copied tensor pays that pass on
top of its copy.

    python bench/shm_handoff.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import files, grants, ranges, reference, segment, slab
from mmsplit_server.handoff.reference import TensorSpec
from scheduler_svc.reader import SharedMemoryReader

PREFIX = "mmsplitbench"
SHAPES = {
    "CLIP-224 (3x224x224)": (3, 224, 224),
    "CLIP-336 (3x336x336)": (3, 336, 336),
    "anyres 5x336": (5, 3, 336, 336),
}
SLAB_BYTES = 64 << 20


# Written before each timed run of a path: more than this machine's L2 and
# its share of L3 hold, so every path starts from the same cold caches.
EVICT_BYTES = 32 << 20


def timed(
    paths: dict[str, Callable[[], None]], repeat: int, *, before: dict[str, Callable[[], None]]
) -> dict[str, float]:
    """Median seconds of each path, the paths taken in turn within each
    repetition, so a drift in this machine's speed (other tenants) falls on
    all of them alike instead of on whichever ran during it. `before[name]`
    runs untimed ahead of each run of path `name` and sets its caches."""
    for fn in paths.values():
        fn()  # warm up
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    order = random.Random(0)
    for _ in range(repeat):
        # A new order each repetition, and `before` between runs: the path
        # before would leave the caches (and the kernel's lock and page
        # paths) cold or warm for the next, so a fixed order, or one only
        # rotated (each path then follows the same one nearly always),
        # would favour some paths: one that follows another slab path finds
        # the slab's first pages in cache, one that follows the copy does not.
        order.shuffle(names)
        for name in names:
            before[name]()
            start = time.perf_counter()
            paths[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(got) for name, got in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{'tensor':24} {'MB':>5} {'copy µs':>8} {'hot µs':>7} {'slab r0':>8} {'slab rk':>8} {'slab+copy':>10}"
        f" {'shm':>6} {'inline':>7} {'→slab':>6}   per copy: {'r0':>5} {'rk':>5} {'+copy':>6} {'shm':>6}"
        f" {'inline':>6} {'→slab':>6}"
        f"   per hot: {'r0':>5} {'rk':>5} {'+copy':>6}"
    )
    owned = ranges.Slab(PREFIX, os.getpid(), SLAB_BYTES)
    table = grants.GrantTable(PREFIX, os.getpid(), 64)
    try:
        for label, shape in SHAPES.items():
            row(label, shape, owned, table, rng, args.repeat)
    finally:
        owned.close()
        table.close()
    left = files.list_segments(PREFIX)
    assert not left, f"benchmark leaked segments: {left}"


def row(
    label: str,
    shape: tuple[int, ...],
    owned: ranges.Slab,
    table: grants.GrantTable,
    rng: np.random.Generator,
    repeat: int,
) -> None:
    """One tensor size: each path timed, checked, and printed as a ratio to a copy."""
    src = rng.standard_normal(shape, dtype=np.float32)
    dst = np.empty_like(src)

    def granted(piece: files.Slice) -> TensorSpec:
        """The reference as the tokenizer sends it: granted (issued here,
        ended by the caller; both are part of a hand-off's cost)."""
        grant = table.issue(piece.segment, piece.offset, piece.nbytes)
        return TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, shm=piece, grant=grant)

    def copy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
        np.copyto(dst, src)

    rank = SharedMemoryReader(rank=0, prefix=PREFIX, max_bytes=1 << 30)

    def via_slab(src: np.ndarray = src, *, rank0_reads: bool = True, lend: bool = True) -> torch.Tensor:
        writer = slab.place(owned.name, PREFIX, memoryview(src), wait_s=0)  # type: ignore[arg-type]
        tokenizer = ranges.take(writer.slice, PREFIX)
        writer.release()
        unshared(tokenizer)  # rank 0 is another process than the tokenizer
        rank0 = ranges.take(writer.slice, PREFIX)  # before Accepted
        tokenizer.release()
        if not rank0_reads:
            # Another rank is another process: rank 0's lock is not there to share.
            unshared(rank0)
        spec = granted(writer.slice)
        try:
            if lend:
                return rank.read("bench", spec)
            # What the reader did: a fresh tensor, the slice copied into it.
            raw = torch.empty(src.nbytes, dtype=torch.uint8)
            reference.read_slice(rank0.slice, PREFIX, memoryview(raw.numpy()), max_segment_bytes=1 << 30)  # type: ignore[arg-type]
            return raw.view(torch.float32).reshape(src.shape)
        finally:
            rank.end_step()
            rank0.release()  # after the step
            table.revoke(spec.grant)  # type: ignore[arg-type]

    def via_slab_other_rank(src: np.ndarray = src) -> torch.Tensor:
        return via_slab(src, rank0_reads=False)

    def via_slab_copy(src: np.ndarray = src) -> torch.Tensor:
        return via_slab(src, rank0_reads=False, lend=False)

    def via_shm(src: np.ndarray = src) -> torch.Tensor:
        piece = segment.place(PREFIX, os.getpid(), memoryview(src))  # type: ignore[arg-type]
        spec = granted(piece)
        try:
            return rank.read("bench", spec)
        finally:
            files.unlink(piece.segment)
            rank.end_step()
            table.revoke(spec.grant)  # type: ignore[arg-type]

    def via_inline(src: np.ndarray = src) -> torch.Tensor:
        wire = TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, inline=src.tobytes()).to_pb().SerializeToString()
        spec = TensorSpec.from_pb(common_pb2.TensorRef.FromString(wire), prefix=PREFIX, max_bytes=1 << 30)
        try:
            return rank.read("bench", spec)
        finally:
            rank.end_step()

    # The slab's own pages as a copy's destination (bench-only: nobody else
    # uses this slab, so its first bytes need no lease here).
    fd, stat = ranges._local.descriptor(owned.name, PREFIX, write=True)
    mapping = ranges._local.view(fd, owned.name, write=True, ino=stat.st_ino)
    into_slab = np.frombuffer(mapping, dtype=src.dtype, count=src.size).reshape(src.shape)

    def copy_to_slab(src: np.ndarray = src, into_slab: np.ndarray = into_slab) -> None:
        np.copyto(into_slab, src)

    expect = torch.from_numpy(src)
    # The slab's tensor is checked while its slice is held (its bytes are
    # the slab's; the next write reuses them).
    writer = slab.place(owned.name, PREFIX, memoryview(src), wait_s=0)  # type: ignore[arg-type]
    check = granted(writer.slice)
    assert torch.equal(rank.read("check", check), expect)
    rank.end_step()
    table.revoke(check.grant)  # type: ignore[arg-type]
    writer.close()
    for path in (via_slab_copy, via_shm, via_inline):
        dst.fill(0)
        assert torch.equal(path(), expect), path.__name__
    paths = {
        "copy": copy,
        "hot copy": copy,
        "slab r0": via_slab,
        "slab rk": via_slab_other_rank,
        "slab+copy": via_slab_copy,
        "shm": via_shm,
        "inline": via_inline,
        "→slab": copy_to_slab,
    }
    scratch = np.ones(EVICT_BYTES // 8)

    def as_served(src: np.ndarray = src, scratch: np.ndarray = scratch) -> None:
        """The caches as a worker leaves them when it hands a tensor over:
        the tensor just made (in cache), everything else evicted by the
        decode and preprocessing that made it (the slab's pages too)."""
        scratch += 1.0
        src.max()

    # The hot copy runs right after the same copy, both buffers in cache,
    # as it would alone in a tight loop; every other path from the caches
    # as served. Timed in turn with the others, so drift falls on all alike.
    before = {name: copy if name == "hot copy" else as_served for name in paths}
    try:
        got = timed(paths, repeat, before=before)
    finally:
        del into_slab
        mapping.release()
        ranges._local.spare(owned.name, PREFIX, fd, stat, write=True)
    base, hot, r0, rk, copied, seg, inline, to_slab = (got[k] for k in paths)
    us = " ".join(
        f"{t * 1e6:{w}.0f}"
        for t, w in ((base, 8), (hot, 7), (r0, 8), (rk, 8), (copied, 10), (seg, 6), (inline, 7), (to_slab, 6))
    )
    per_copy = " ".join(f"{t / base:5.1f}x" for t in (r0, rk, copied, seg, inline, to_slab))
    per_hot = " ".join(f"{t / hot:5.1f}x" for t in (r0, rk, copied))
    print(f"{label:24} {src.nbytes / 1e6:5.2f} {us}   per copy: {per_copy}   per hot: {per_hot}")


def unshared(held: ranges.Held) -> None:
    """Take `held`'s slice out of this process's table of taken slices, so
    that the next take locks it anew, as another process's would (the
    held lock itself stays, and is released as before)."""
    with ranges._taken_lock:
        ranges._taken.pop((held.slice.segment, *held.span), None)


if __name__ == "__main__":
    main()
