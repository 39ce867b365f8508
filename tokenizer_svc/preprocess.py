"""What a CPU worker runs: decode → image processor → shared memory.

Only compressed bytes come in and only metadata goes back (`ImageResult`);
the pixel tensor is written once, straight into a new segment owned by the
tokenizer process (its pid is in the name). Workers are started by
forkserver with this module preloaded, so they start without re-importing
transformers. Tasks are pure functions of their input and may be retried.
"""

from __future__ import annotations

import importlib
import os
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Imported here, at module level, on purpose: the forkserver preloads this
# module, so every worker (and every replacement pool) forks with the ~7 s of
# transformers/torch imports already done instead of paying them on start.
import torch
from transformers import AutoImageProcessor

from mmsplit import shm
from tokenizer_svc.decode import decode_image
from tokenizer_svc.errors import InternalError, MediaUnsupported, Overloaded

_processor: Any = None
_hook: Any = None


@dataclass(frozen=True)
class ImageJob:
    data: bytes
    max_pixels: int
    max_aspect_ratio: float
    shm_prefix: str
    owner_pid: int


@dataclass(frozen=True)
class ImageResult:
    segment: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    width: int
    height: int


def _exit_with(owner_pid: int) -> None:
    """Exit when the tokenizer process dies. A pool worker waits on a queue it
    also holds the write end of, so it would never see EOF and would outlive
    a SIGKILLed tokenizer (and keep the forkserver alive with it)."""
    try:
        fd = os.pidfd_open(owner_pid)
    except (OSError, AttributeError):  # owner gone already, or no pidfd (not Linux ≥ 5.3)
        while shm.pid_alive(owner_pid):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])  # readable once the process has exited
    os._exit(0)


def init_worker(model_dir: str, owner_pid: int, hook_module: str = "") -> None:
    """Pool initializer: exit with the owner, one torch thread, the model's
    image processor, and the optional worker hook (`worker_hook` setting): a
    module whose `on_worker_start()` runs here and `on_decoded(image)` after
    each decode. Tests substitute it to crash, stall or fail workers."""
    threading.Thread(target=_exit_with, args=(owner_pid,), name="owner-watch", daemon=True).start()
    global _processor, _hook
    if hook_module:
        _hook = importlib.import_module(hook_module)
        if hasattr(_hook, "on_worker_start"):
            _hook.on_worker_start()
    torch.set_num_threads(1)
    _processor = AutoImageProcessor.from_pretrained(Path(model_dir))


def warm_up() -> int:
    """A no-op task that makes a worker start; returns its pid."""
    return os.getpid()


def preprocess_image(job: ImageJob) -> ImageResult:
    if _processor is None:
        raise InternalError("worker has no image processor (initializer did not run)")
    image = decode_image(job.data, max_pixels=job.max_pixels)
    if _hook is not None and hasattr(_hook, "on_decoded"):
        _hook.on_decoded(image)
    ratio = max(image.size) / min(image.size)
    if ratio > job.max_aspect_ratio:
        raise MediaUnsupported(f"aspect ratio {image.width}x{image.height} exceeds {job.max_aspect_ratio:g}:1")
    try:
        pixels = _processor(images=image, return_tensors="np")["pixel_values"][0]
    except (ValueError, TypeError, OSError, IndexError) as exc:
        raise MediaUnsupported(f"the image processor rejected this image: {type(exc).__name__}: {exc}") from exc
    array = np.ascontiguousarray(pixels, dtype=np.float32)
    try:
        piece = shm.write_segment(job.shm_prefix, job.owner_pid, memoryview(array))  # type: ignore[arg-type]
    except shm.ShmFull as exc:
        raise Overloaded(str(exc)) from exc
    return ImageResult(
        segment=piece.segment,
        nbytes=piece.nbytes,
        shape=tuple(array.shape),
        dtype=str(array.dtype),
        width=image.width,
        height=image.height,
    )
