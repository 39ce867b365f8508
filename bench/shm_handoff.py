"""Cost of handing one pixel tensor from the tokenizer to a scheduler rank.

Measures, in one run and one process, per tensor size:
  copy    — a plain numpy copy (the floor every hand-off is compared to)
  slab    — the path the services take: a worker allocates a slice of the
            pre-faulted slab and writes it, the tokenizer takes it over,
            rank 0 takes it (Accepted), a rank's reader (the services' own,
            `scheduler_svc.reader`) lends it in place under a lock of its
            own, the step ends, rank 0 lets go
  slab+copy — the same, the rank copying the slice into a fresh tensor (what
            the reader did before it lent slices in place)
  shm     — a segment per tensor (the path with the slab off): write a new
            segment, the reader copies it into a fresh buffer, unlink
  inline  — encode the bytes into a TensorRef protobuf, decode, the reader
            lends the decoded bytes
and prints each as a ratio to `copy`, the paths taken in turn in each
repetition (so the copy's source is not left in cache by the copy before it,
as it is for none of the others), in an order rotated at each repetition
(so each path follows each other path equally often). For comparison, "hot copy" is the copy
alone in a tight loop (source and destination stay in L2 below ~2 MB), and
slab/hot the slab path against it: the stricter ratio, and the one this
benchmark printed before it took the paths in turn. The tokenizer's worker pays the write,
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
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mmsplit import shm, slab
from mmsplit.common.v1 import common_pb2
from mmsplit.tensors import TensorSpec
from scheduler_svc.reader import SharedMemoryReader

PREFIX = "mmsplitbench"
SHAPES = {
    "CLIP-224 (3x224x224)": (3, 224, 224),
    "CLIP-336 (3x336x336)": (3, 336, 336),
    "anyres 5x336": (5, 3, 336, 336),
}
SLAB_BYTES = 64 << 20


def timed(paths: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median seconds of each path, the paths taken in turn within each
    repetition, so a drift in this machine's speed (other tenants) falls on
    all of them alike instead of on whichever ran during it."""
    for fn in paths.values():
        fn()  # warm up
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(repeat):
        # Each path runs after every other equally often: the one before
        # leaves the caches (and the kernel's lock and page paths) cold or
        # warm for it, so a fixed order would favour some paths.
        for name in names[i % len(names) :] + names[: i % len(names)]:
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
        f"{'tensor':24} {'MB':>6} {'copy µs':>9} {'slab µs':>9} {'slab+copy µs':>13} {'shm µs':>9}"
        f" {'inline µs':>10} {'slab/copy':>10} {'slab+copy/copy':>15} {'shm/copy':>9} {'inline/copy':>12}"
        f" {'hot copy µs':>12} {'slab/hot':>9} {'slab+copy/hot':>14}"
    )
    owned = slab.Slab(PREFIX, os.getpid(), SLAB_BYTES)
    try:
        for label, shape in SHAPES.items():
            row(label, shape, owned, rng, args.repeat)
    finally:
        owned.close()
    left = shm.list_segments(PREFIX)
    assert not left, f"benchmark leaked segments: {left}"


def row(label: str, shape: tuple[int, ...], owned: slab.Slab, rng: np.random.Generator, repeat: int) -> None:
    """One tensor size: each path timed, checked, and printed as a ratio to a copy."""
    src = rng.standard_normal(shape, dtype=np.float32)
    dst = np.empty_like(src)

    def copy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
        np.copyto(dst, src)

    rank = SharedMemoryReader(rank=0, prefix=PREFIX, max_bytes=1 << 30)

    def via_slab(src: np.ndarray = src, *, lend: bool = True) -> torch.Tensor:
        writer = slab.write(owned.name, PREFIX, memoryview(src), wait_s=0)  # type: ignore[arg-type]
        tokenizer = slab.take(writer.slice, PREFIX)
        writer.release()
        rank0 = slab.take(writer.slice, PREFIX)  # before Accepted
        tokenizer.release()
        try:
            if lend:
                return rank.read("bench", TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, shm=writer.slice))
            # What the reader did: a fresh tensor, the slice copied into it.
            raw = torch.empty(src.nbytes, dtype=torch.uint8)
            shm.read_into(rank0.slice, PREFIX, memoryview(raw.numpy()), max_segment_bytes=1 << 30)  # type: ignore[arg-type]
            return raw.view(torch.float32).reshape(src.shape)
        finally:
            rank.end_step()
            rank0.release()  # after the step

    def via_slab_copy(src: np.ndarray = src) -> torch.Tensor:
        return via_slab(src, lend=False)

    def via_shm(src: np.ndarray = src) -> torch.Tensor:
        piece = shm.write_segment(PREFIX, os.getpid(), memoryview(src))  # type: ignore[arg-type]
        try:
            return rank.read("bench", TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, shm=piece))
        finally:
            shm.unlink(piece.segment)
            rank.end_step()

    def via_inline(src: np.ndarray = src) -> torch.Tensor:
        wire = TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, inline=src.tobytes()).to_pb().SerializeToString()
        spec = TensorSpec.from_pb(common_pb2.TensorRef.FromString(wire), prefix=PREFIX, max_bytes=1 << 30)
        try:
            return rank.read("bench", spec)
        finally:
            rank.end_step()

    expect = torch.from_numpy(src)
    # The slab's tensor is checked while its slice is held (its bytes are
    # the slab's; the next write reuses them).
    writer = slab.write(owned.name, PREFIX, memoryview(src), wait_s=0)  # type: ignore[arg-type]
    assert torch.equal(rank.read("check", TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, shm=writer.slice)), expect)
    rank.end_step()
    writer.close()
    for path in (via_slab_copy, via_shm, via_inline):
        dst.fill(0)
        assert torch.equal(path(), expect), path.__name__
    got = timed(
        {"copy": copy, "slab": via_slab, "slab+copy": via_slab_copy, "shm": via_shm, "inline": via_inline}, repeat
    )
    base, t_slab, t_copied, t_shm, t_inline = (got[k] for k in ("copy", "slab", "slab+copy", "shm", "inline"))
    hot = timed({"copy": copy}, repeat)["copy"]
    print(
        f"{label:24} {src.nbytes / 1e6:6.2f} {base * 1e6:9.0f} {t_slab * 1e6:9.0f} {t_copied * 1e6:13.0f}"
        f" {t_shm * 1e6:9.0f} {t_inline * 1e6:10.0f} {t_slab / base:9.1f}x {t_copied / base:14.1f}x"
        f" {t_shm / base:8.1f}x {t_inline / base:11.1f}x {hot * 1e6:12.0f} {t_slab / hot:8.1f}x {t_copied / hot:13.1f}x"
    )


if __name__ == "__main__":
    main()
