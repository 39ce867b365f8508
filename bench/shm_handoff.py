"""Cost of handing one pixel tensor from the tokenizer to a scheduler rank.

Measures, in one run and one process, per tensor size:
  copy    — a plain numpy copy (the floor every hand-off is compared to)
  slab    — the path the services take: a worker allocates a slice of the
            pre-faulted slab and writes it, the tokenizer takes it over, a
            rank reads it into a fresh buffer, the slice is released
  shm     — a segment per tensor (the path with the slab off): write a new
            segment, read it into a fresh buffer, unlink
  inline  — encode the bytes into a TensorRef protobuf, decode, copy out
and prints each as a ratio to `copy`, the four taken in turn in each
repetition (so the copy's source is not left in cache by the copy before it,
as it is for none of the others). For comparison, "hot copy" is the copy
alone in a tight loop (source and destination stay in L2 below ~2 MB), and
slab/hot the slab path against it: the stricter ratio, and the one this
benchmark printed before it took the paths in turn. The tokenizer's worker pays the write,
each rank pays one read; a fresh segment pays its page faults, which the
slab's pages, reserved once, do not.

    python bench/shm_handoff.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from mmsplit import shm, slab
from mmsplit.common.v1 import common_pb2
from mmsplit.tensors import TensorSpec

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
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(got) for name, got in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{'tensor':24} {'MB':>6} {'copy µs':>9} {'slab µs':>9} {'shm µs':>9} {'inline µs':>10}"
        f" {'slab/copy':>10} {'shm/copy':>9} {'inline/copy':>12} {'hot copy µs':>12} {'slab/hot':>9}"
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

    def via_slab(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
        writer = slab.write(owned.name, PREFIX, memoryview(src), wait_s=0)  # type: ignore[arg-type]
        tokenizer = slab.take(writer.slice, PREFIX)
        writer.release()
        rank0 = slab.take(writer.slice, PREFIX)  # before Accepted
        tokenizer.release()
        try:
            shm.read_into(rank0.slice, PREFIX, memoryview(dst), max_segment_bytes=1 << 30)  # type: ignore[arg-type]
        finally:
            rank0.release()

    def via_shm(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
        piece = shm.write_segment(PREFIX, os.getpid(), memoryview(src))  # type: ignore[arg-type]
        try:
            shm.read_into(piece, PREFIX, memoryview(dst), max_segment_bytes=1 << 30)  # type: ignore[arg-type]
        finally:
            shm.unlink(piece.segment)

    def via_inline(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
        wire = TensorSpec(common_pb2.DTYPE_FLOAT32, src.shape, inline=src.tobytes()).to_pb().SerializeToString()
        spec = TensorSpec.from_pb(common_pb2.TensorRef.FromString(wire), prefix=PREFIX, max_bytes=1 << 30)
        spec.read_into(memoryview(dst), prefix=PREFIX, max_bytes=1 << 30)  # type: ignore[arg-type]

    via_slab()
    assert np.array_equal(dst, src)
    dst.fill(0)
    via_shm()
    assert np.array_equal(dst, src)
    dst.fill(0)
    via_inline()
    assert np.array_equal(dst, src)
    got = timed({"copy": copy, "slab": via_slab, "shm": via_shm, "inline": via_inline}, repeat)
    base, t_slab, t_shm, t_inline = got["copy"], got["slab"], got["shm"], got["inline"]
    hot = timed({"copy": copy}, repeat)["copy"]
    print(
        f"{label:24} {src.nbytes / 1e6:6.2f} {base * 1e6:9.0f} {t_slab * 1e6:9.0f} {t_shm * 1e6:9.0f}"
        f" {t_inline * 1e6:10.0f} {t_slab / base:9.1f}x {t_shm / base:8.1f}x {t_inline / base:11.1f}x"
        f" {hot * 1e6:12.0f} {t_slab / hot:8.1f}x"
    )


if __name__ == "__main__":
    main()
