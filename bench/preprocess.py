"""Preprocessing throughput of the tokenizer's CPU pool against the same work
done serially in one process, measured in the same run.

For each model family's processor (LLaVA-1.5 and LLaVA-NeXT by default) and
each pool size W: images/s through `CpuPool` with W workers (decode, the
model's image processor, the family's rows, the write into a slice of a
slab, as the service does with shared memory; all jobs submitted at once)
/ (W x images/s of one process doing decode + processor + rows serially
with one torch thread). 1.0 means the pool costs nothing on
top of the work itself. Slices are taken over and released as they come.

    python bench/preprocess.py [--families llava,llava-next] [--workers 1,2] [--images 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, scratch_dir, table

from mmsplit import families, slab
from mmsplit_cli import samples
from tokenizer_svc.decode import decode_image
from tokenizer_svc.pool import CpuPool
from tokenizer_svc.preprocess import ImageJob, SlabRef

SIZES = [(640, 480), (800, 600), (1024, 768), (1280, 720), (1600, 900), (1920, 1080)]
MAX_PIXELS = 40_000_000
PREFIX = "mmsplitbench"


def images(n: int) -> list[bytes]:
    return [samples.encode(samples.gradient(*SIZES[i % len(SIZES)], seed=i), "JPEG", quality=90) for i in range(n)]


def serial_rate(model: Path, pictures: list[bytes]) -> float:
    """Images/s of decode + processor + rows in this process, one torch thread."""
    import torch
    from transformers import AutoImageProcessor

    torch.set_num_threads(1)
    processor = AutoImageProcessor.from_pretrained(model)
    family = families.load(model, frozenset(processor.model_input_names))
    start = time.perf_counter()
    for data in pictures:
        image = decode_image(data, max_pixels=MAX_PIXELS)
        outputs = processor(images=image, return_tensors="np")
        rows = family.item_rows({k: np.asarray(v) for k, v in outputs.items()})
        for name, array in rows.items():
            if families.is_encoder_input(name):
                np.ascontiguousarray(array, dtype=np.float32)
    return len(pictures) / (time.perf_counter() - start)


async def pool_rate(pool: CpuPool, pictures: list[bytes], owned: slab.Slab) -> float:
    ref = SlabRef(owned.name, owned.max_slice, wait_s=60)
    jobs = [ImageJob(d, MAX_PIXELS, 50.0, PREFIX, os.getpid(), slab=ref) for d in pictures]

    async def one(i: int, job: ImageJob) -> None:
        result = await pool.preprocess(job, timeout_s=120, request_id=f"bench-{i}")
        for piece in result.slab_slices:  # taken over, as the service does, then let go
            slab.take(piece, PREFIX).release()

    start = time.perf_counter()
    await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))
    return len(pictures) / (time.perf_counter() - start)


async def measure(model: Path, workers: int, pictures: list[bytes], rounds: int) -> tuple[list[float], list[float]]:
    """(serial rates, pool rates), one of each per round, interleaved."""
    pool = CpuPool(str(model), workers, queue_timeout_s=600)
    await pool.start()
    owned = slab.Slab(PREFIX, os.getpid(), 256 << 20)
    serial, pooled = [], []
    try:
        await pool_rate(pool, pictures[: workers * 2], owned)  # warm-up
        for _ in range(rounds):
            pooled.append(await pool_rate(pool, pictures, owned))
            serial.append(serial_rate(model, pictures))
    finally:
        await pool.shutdown()
        owned.close()
    return serial, pooled


def run(*, family_names: list[str], worker_counts: list[int], n_images: int, rounds: int, workdir: Path) -> str:
    from mmsplit_cli.tiny_model import build

    pictures = images(n_images)
    rows = []
    for name in family_names:
        model = workdir / f"tiny-{name}"
        if not (model / "config.json").exists():
            build(model, cache_dir=ROOT / ".cache", family=name)
        for workers in worker_counts:
            serial, pooled = asyncio.run(measure(model, workers, pictures, rounds))
            s, p = statistics.median(serial), statistics.median(pooled)
            rows.append([name, workers, f"{s:.1f}", f"{p:.1f}", f"{p / (workers * s):.2f}"])
    header = ["processor", "W", "serial img/s", "pool img/s", "pool / (W x serial)"]
    return f"{n_images} JPEGs 640x480..1920x1080, medians of {rounds} interleaved rounds\n" + table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llava,llava-next")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where the tiny models go (default: a temporary directory)")
    args = parser.parse_args()
    with scratch_dir(args.workdir) as where:
        print(
            run(
                family_names=args.families.split(","),
                worker_counts=[int(w) for w in args.workers.split(",")],
                n_images=args.images,
                rounds=args.rounds,
                workdir=where,
            )
        )


if __name__ == "__main__":
    main()
