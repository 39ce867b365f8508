"""What a CPU worker runs: decode → image processor → the model family's
item tensors → shared memory. Images and videos (`tokenizer_svc.video`).

Only compressed bytes come in: in a slice of the slab when there is one
(`stage_input`: a megabyte-sized pickle crosses the worker's socket in
pieces, each a wake-up of the event loop), else in the pickled job. With the shared-memory transport only
metadata goes back (`ItemResult`): each encoder input (``pixel_values*``) is
written once, straight into a slice of the tokenizer's slab (`mmsplit_server.handoff.slab`;
the worker holds the slice until the tokenizer process takes it over), or
into a new segment of its own when there is no slab or the tensor is over
the slab's largest slice. With the inline transport (a scheduler that does not
share this /dev/shm) the job says ``inline`` and the encoder inputs come back
as bytes in the result, so /dev/shm is never touched. The small side tensors
(``image_sizes``, ``image_grid_thw``) always come back as bytes. The
worker also applies the family's placeholder rule, so the prompt is expanded
from exactly what the scheduler will check. Workers are started by
forkserver with this module preloaded, so they start without re-importing
transformers. Tasks are pure functions of their input and may be retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import resource
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Imported here, at module level, on purpose: the forkserver preloads this
# module, so every worker (and every replacement pool) forks with the ~7 s of
# transformers/torch imports already done instead of paying them on start.
import torch
from transformers import AutoImageProcessor

from mmsplit_server import families, mallocheap
from mmsplit_server.families.base import rgb_as_is
from mmsplit_server.handoff import files, ranges, reference, slab
from tokenizer_svc import pil_shortcuts, video
from tokenizer_svc.decode import decode_image
from tokenizer_svc.errors import InternalError, MediaTooLarge, MediaUnsupported, Overloaded

_processor: Any = None
_family: families.Family | None = None
_hook: Any = None


@dataclass(frozen=True)
class SlabRef:
    """Where a job's encoder inputs go when the transport is shared memory."""

    name: str
    max_slice: int
    wait_s: float  # for room in a full slab, then OVERLOADED


@dataclass(frozen=True)
class RowForm:
    """How an item's encoder inputs are made for the scheduler they go to:
    an image's rows of one frame where the family repeats it
    (`Family.image_options`; ServerInfo.one_frame_image_rows), and their
    dtype (float32, or the model's float16 or bfloat16:
    ServerInfo.encoder_input_dtype)."""

    one_frame: bool = False
    dtype: str = "float32"


# Rows of every frame in float32: what every scheduler takes.
PLAIN_ROWS = RowForm()


@dataclass(frozen=True)
class ImageJob:
    data: bytes
    max_pixels: int
    max_aspect_ratio: float
    shm_prefix: str
    owner_pid: int
    # Return encoder inputs as bytes instead of writing segments (inline transport).
    inline: bool = False
    slab: SlabRef | None = None
    # Where `data` is when it is not in the job (`stage_input`).
    source: files.Slice | None = None
    form: RowForm = PLAIN_ROWS
    # The request's own pixel budget (GenerateRequest.image_budget); None: the checkpoint's.
    pixels: families.PixelBudget | None = None
    # Its own bounds on an image's tiles (ImageBudget.min_tiles, max_tiles); None: the checkpoint's.
    tiles: families.TileBudget | None = None
    # The largest tensor its scheduler takes (ServerInfo.max_tensor_bytes),
    # checked from the image's header where the family says its rows; 0: unchecked.
    max_bytes: int = 0


@dataclass(frozen=True)
class VideoJob:
    data: bytes
    max_pixels: int  # per frame
    max_duration_s: float
    max_frames: int  # frames in the file
    fps: float  # sampling rule (`video.sample_indices`)
    min_frames: int
    max_sampled_frames: int
    budget_s: float  # the worker's own deadline, from when it starts the task
    shm_prefix: str
    owner_pid: int
    inline: bool = False  # as ImageJob.inline
    slab: SlabRef | None = None
    source: files.Slice | None = None  # as ImageJob.source
    form: RowForm = PLAIN_ROWS  # its dtype (a video's rows are of two frames whatever the scheduler)


Job = ImageJob | VideoJob


@dataclass(frozen=True)
class ItemTensor:
    """One tensor of an item: in a segment or a slab slice (encoder inputs),
    or inline (side tensors, and everything for the inline transport)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: str | None = None
    inline: bytes | None = None
    offset: int = 0  # in a slab, or in the GPU pool (then `segment` is its lease map)
    device: bool = False  # in the GPU staging pool (CUDA IPC)

    @property
    def slice(self) -> files.Slice | None:
        return None if self.segment is None else files.Slice(self.segment, self.offset, self.nbytes)


# The stages a worker's time on one item is counted in (`ItemResult.stages`).
STAGES = ("read", "decode", "process", "write")


@dataclass(frozen=True)
class ItemResult:
    modality: int
    tensors: tuple[ItemTensor, ...]
    # Placeholder tokens this item fills (the family's rule).
    tokens: int
    # Filled in by the tokenizer: the digest of the bytes, the model and the
    # preprocessing settings (`tokenizer_svc.cache`), not of the tensors:
    # hashing megabytes of pixels in the worker cost more than the hand-off.
    content_hash: bytes
    width: int
    height: int
    # Video: the frames sampled (0 for an image), and each temporal patch's
    # time in seconds (`video.Video.patch_times`; Qwen3-VL writes them).
    frames: int = 0
    times: tuple[float, ...] = ()
    # Seconds the worker spent on this item per stage (`STAGES`, in order):
    # its input read from the slab, decode, the processor and the family's
    # rows, the write into shared memory (or bytes for inline). What is not
    # in them (the pool's queue, the socket, pickling) is the pool's own cost.
    stages: tuple[float, ...] = ()

    @property
    def segments(self) -> list[str]:
        """The one-off segments (released by unlinking)."""
        return [t.segment for t in self.tensors if t.segment is not None and not files.is_slab(t.segment)]

    @property
    def slab_slices(self) -> list[files.Slice]:
        """The slab slices (released by unlocking)."""
        return [t.slice for t in self.tensors if t.slice is not None and files.is_slab(t.slice.segment)]

    def abandon(self, prefix: str) -> None:
        """Release what nobody will send (`abandon`)."""
        abandon(self.tensors, prefix)


def abandon(tensors: Iterable[ItemTensor], prefix: str) -> None:
    """Release tensors nobody will send: each taken over from its writer
    only to be let go of (`reference.hold`, then the one release)."""
    for t in tensors:
        if t.slice is None:
            continue
        # SegmentError: the writer let it go already (its hand-off timed out, or it died).
        with contextlib.suppress(files.SegmentError):
            reference.hold(t.slice, prefix).release()


def _exit_with(owner_pid: int) -> None:
    """Exit when the tokenizer process dies. A pool worker waits on a queue it
    also holds the write end of, so it would never see EOF and would outlive
    a SIGKILLed tokenizer (and keep the forkserver alive with it)."""
    try:
        fd = os.pidfd_open(owner_pid)
    except (OSError, AttributeError):  # owner gone already, or no pidfd (not Linux ≥ 5.3)
        while files.pid_alive(owner_pid):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])  # readable once the process has exited
    os._exit(0)


def keep_heap() -> None:
    """Keep a worker's freed buffers for the next image instead of handing
    them back to the kernel (`mallocheap.keep`). The processor allocates and
    frees the same few large arrays per image (a 1920x1080 frame in float64
    is 50 MB); with glibc's defaults in a forkserver child those were
    mmapped and unmapped each time, about 1,000 page faults per image and
    ~15 % of a worker's time (measured: 25,000 faults per 24 images against
    none in a process that had warmed up; with these settings, none)."""
    mallocheap.keep()


def init_worker(model_dir: str, owner_pid: int, hook_module: str = "", memory_bytes: int = 0) -> None:
    """Pool initializer: exit with the owner, keep the heap (`keep_heap`),
    one torch thread, the model's image processor (with `pil_shortcuts`'s
    shortcuts), and the optional worker
    hook (`worker_hook` setting): a module whose `on_worker_start()` runs
    here and `on_decoded(image)` after each decode. Tests substitute it to
    crash, stall or fail workers."""
    threading.Thread(target=_exit_with, args=(owner_pid,), name="owner-watch", daemon=True).start()
    keep_heap()
    global _processor, _family, _hook
    if hook_module:
        _hook = importlib.import_module(hook_module)
        if hasattr(_hook, "on_worker_start"):
            _hook.on_worker_start()
    torch.set_num_threads(1)
    _processor = AutoImageProcessor.from_pretrained(Path(model_dir))
    pil_shortcuts.install(_processor)
    _family = families.load(Path(model_dir), frozenset(_processor.model_input_names))
    if memory_bytes:
        limit_address_space(memory_bytes)


def limit_address_space(extra_bytes: int) -> int:
    """Cap this process's address space (RLIMIT_AS, soft) at what it maps
    now plus `extra_bytes`: an item whose decoding or preprocessing would
    need more gets MemoryError (MEDIA_TOO_LARGE) in this worker, which then
    serves on, instead of growing until the kernel's OOM killer takes the
    pod. The limit set, in bytes."""
    mapped = _vm_size()
    limit = mapped + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def warm_up() -> int:
    """A no-op task that makes a worker start; returns its pid."""
    return os.getpid()


def stage_input(job: Job, limit: int) -> tuple[Job, ranges.Held | None]:
    """(The tokenizer process.) `job` with its media bytes moved into a
    slice of its slab, and that slice held, or `job` as it is when it has no
    slab, the bytes are over `limit` or the slab has no room now (this only
    saves time; it never makes anyone wait). The caller holds the slice
    until the task has ended, so the worker reads it without a lock, and
    picks `limit` so that inputs never crowd out the tensors workers write
    (no more than the slab's largest slice is staged in any case)."""
    ref = job.slab
    if ref is None or job.source is not None or not job.data or len(job.data) > min(limit, ref.max_slice):
        return job, None
    try:
        held = slab.place(ref.name, job.shm_prefix, memoryview(job.data), wait_s=0)
    except files.SegmentError:  # full now, or being removed (shutdown)
        return job, None
    return dataclasses.replace(job, data=b"", source=held.slice), held


def media_bytes(job: Job) -> bytes | bytearray:
    """The job's media bytes: in the job, or in the slab slice it names."""
    if job.source is None:
        return job.data
    data = bytearray(job.source.nbytes)
    slab.read_into(job.source, job.shm_prefix, memoryview(data))
    return data


def preprocess(job: Job) -> ItemResult:
    """The task a worker runs for one image or video."""
    if _processor is None or _family is None:
        raise InternalError("worker has no image processor (initializer did not run)")
    clock = _Clock()
    if job.source is not None:
        job = dataclasses.replace(job, data=media_bytes(job), source=None)  # type: ignore[arg-type]
    clock.lap("read")
    try:
        if isinstance(job, VideoJob):
            result = _video(job, _processor, _family, clock)
        else:
            result = _image(job, _processor, _family, clock)
    except MemoryError as exc:
        raise MediaTooLarge("the item needs more memory than a worker may use (--worker-memory-bytes)") from exc
    clock.lap("write")
    return dataclasses.replace(result, stages=clock.seconds())


class _Clock:
    """Wall time per stage of one task, each lap ending the named stage."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._spent = dict.fromkeys(STAGES, 0.0)

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self._spent[stage] += now - self._last
        self._last = now

    def seconds(self) -> tuple[float, ...]:
        return tuple(self._spent[s] for s in STAGES)


def _image(job: ImageJob, processor: Any, family: families.Family, clock: _Clock) -> ItemResult:
    image = decode_image(job.data, max_pixels=job.max_pixels, check=_rows_check(job, family))
    if _hook is not None and hasattr(_hook, "on_decoded"):
        _hook.on_decoded(image)
    clock.lap("decode")
    ratio = max(image.size) / min(image.size)
    if ratio > job.max_aspect_ratio:
        raise MediaUnsupported(f"aspect ratio {image.width}x{image.height} exceeds {job.max_aspect_ratio:g}:1")
    try:
        with pil_shortcuts.processing():
            options = family.image_options(one_frame=job.form.one_frame, pixels=job.pixels, tiles=job.tiles)
            outputs = processor(images=image, return_tensors="np", **rgb_as_is(image), **options)
        rows = family.item_rows({name: np.asarray(value) for name, value in outputs.items()})
        tokens = _count(family, families.IMAGE, rows)
    except (ValueError, TypeError, OSError, IndexError, KeyError) as exc:
        raise MediaUnsupported(f"the image processor rejected this image: {type(exc).__name__}: {exc}") from exc
    clock.lap("process")
    return _publish(job, families.IMAGE, rows, tokens, image.width, image.height)


def _rows_check(job: ImageJob, family: families.Family) -> Callable[[int, int], None] | None:
    """What refuses an image whose rows would be over its scheduler's
    largest tensor, from the size its header states, before any pixel is
    decoded or processed (a 12-megapixel photo for Qwen2-VL at its default
    budget is ~73 MB of rows even in bfloat16): the processor's own rule
    for a size's rows (`Family.image_rows`), for a family whose rows are
    patches."""
    own = family.image_pixels
    if not job.max_bytes or not family.image_row_pixels or own is None:
        return None
    budget = job.pixels or own
    row_bytes = family.image_row_values(one_frame=job.form.one_frame) * reference.itemsize(job.form.dtype)

    def check(width: int, height: int) -> None:
        try:
            rows = family.image_rows(width, height, budget)
        except ValueError:
            return  # a shape the processor refuses: said when it processes the image
        if rows * row_bytes > job.max_bytes:
            most = most_pixels(family, width, height, budget, row_bytes, job.max_bytes)
            raise too_large(families.IMAGE, rows * row_bytes, job.max_bytes, most)

    return check


def most_pixels(
    family: families.Family, width: int, height: int, budget: families.PixelBudget, row_bytes: int, cap: int
) -> int | None:
    """The largest max_pixels (within `budget`, a min_pixels over it taken
    down to it: `PixelBudget.at_most`) under which an image
    of this size makes rows of at most `cap` bytes; None if even one
    merged patch would not. Rows never shrink as max_pixels grows (the
    processor's resize rule), so a bisection finds it."""

    def fits(most: int) -> bool:
        return family.image_rows(width, height, budget.at_most(most)) * row_bytes <= cap

    low, high = family.least_image_pixels, budget.most
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def too_large(modality: int, nbytes: int, cap: int, most: int | None = None) -> MediaTooLarge:
    """MEDIA_TOO_LARGE for an item of `nbytes` of encoder input over its
    scheduler's `cap`; `most`, for an image, the max_pixels whose rows fit."""
    image = modality == families.IMAGE
    fix = "send a smaller image" if image else "send a shorter or smaller video"
    if most is not None:
        fix += f", or ask for at most {most:,} pixels an image (max_pixels)"
    return MediaTooLarge(
        f"this {'image' if image else 'video'} comes to {nbytes:,} bytes of pixels for the model, over the "
        f"{cap:,} its scheduler takes (--max-tensor-bytes): {fix}"
    )


def _video(job: VideoJob, processor: Any, family: families.Family, clock: _Clock) -> ItemResult:
    if not family.takes_video:
        raise MediaUnsupported(f"this model ({family.name}) takes no video")
    limits = video.VideoLimits(
        max_pixels=job.max_pixels,
        max_duration_s=job.max_duration_s,
        max_frames=job.max_frames,
        deadline=time.monotonic() + job.budget_s,
    )
    rule = video.Sampling(
        fps=job.fps,
        min_frames=job.min_frames,
        max_frames=job.max_sampled_frames,
        temporal_patch_size=family.temporal_patch_size,
        how=family.frame_sampling,
    )
    hook = getattr(_hook, "on_decoded", None)
    clip = video.decode_video(job.data, limits, rule, on_frame=hook)
    clock.lap("decode")
    try:
        with pil_shortcuts.processing():  # each frame goes through the image processor
            rows = family.video_rows(processor, clip.frames, clip.sampled_fps)
        tokens = _count(family, families.VIDEO, rows)
    except (ValueError, TypeError, OSError, IndexError, KeyError) as exc:
        raise MediaUnsupported(f"the video's frames were rejected: {type(exc).__name__}: {exc}") from exc
    clock.lap("process")
    times = clip.patch_times(family.temporal_patch_size)
    return _publish(job, families.VIDEO, rows, tokens, clip.width, clip.height, frames=len(clip.frames), times=times)


def place(t: ItemTensor, data: memoryview, ref: SlabRef | None, prefix: str, owner_pid: int) -> ItemTensor:
    """An encoder input put in shared memory (`reference.place`): a slice of
    the slab, kept by this process's hand-off until the tokenizer process
    takes it, when there is a slab and it fits; else a segment of its own.
    No room is OVERLOADED. The worker hook's `on_slice_written` runs while
    the slice is still write-locked (tests kill the worker there)."""
    try:
        piece = reference.place(
            data,
            prefix=prefix,
            owner_pid=owner_pid,
            slab_name=None if ref is None else ref.name,
            max_slice=0 if ref is None else ref.max_slice,
            wait_s=0.0 if ref is None else ref.wait_s,
            on_written=getattr(_hook, "on_slice_written", None),
        )
    except ranges.SlabFull as exc:
        raise Overloaded(f"the shared-memory slab has no room: {exc}") from exc
    except (files.ShmFull, files.NoDescriptors) as exc:
        raise Overloaded(str(exc)) from exc
    return dataclasses.replace(t, segment=piece.segment, offset=piece.offset, inline=None)


def pixels_as(array: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
    """Encoder inputs in `dtype` (float32, float16 or bfloat16) and its name: float16
    and bfloat16 by torch's cast from float32, the one a rank makes to its
    model's dtype (the model gets the same values); bfloat16, which numpy
    lacks, as its bits (uint16)."""
    pixels = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return pixels, dtype
    cast = torch.from_numpy(pixels).to(getattr(torch, dtype))
    return (cast.view(torch.uint16) if dtype == "bfloat16" else cast).numpy(), dtype


def _count(family: families.Family, modality: int, rows: dict[str, np.ndarray]) -> int:
    shapes = {n: tuple(a.shape) for n, a in rows.items() if families.is_encoder_input(n)}
    return family.count(modality, shapes, {n: a for n, a in rows.items() if n not in shapes})


def _publish(
    job: Job,
    modality: int,
    rows: dict[str, np.ndarray],
    tokens: int,
    width: int,
    height: int,
    frames: int = 0,
    times: tuple[float, ...] = (),
) -> ItemResult:
    """Encoder inputs into the slab or new segments (or inline for an
    inline job), side tensors inline."""
    tensors: list[ItemTensor] = []
    try:
        for name in sorted(rows):
            array = np.ascontiguousarray(rows[name])
            dtype = str(array.dtype)
            if families.is_encoder_input(name):
                array, dtype = pixels_as(array, job.form.dtype)
            t = ItemTensor(name, dtype, tuple(array.shape), array.nbytes)
            if not families.is_encoder_input(name) or job.inline:
                tensors.append(dataclasses.replace(t, inline=array.tobytes()))
            else:
                tensors.append(place(t, memoryview(array), job.slab, job.shm_prefix, job.owner_pid))  # type: ignore[arg-type]
    except BaseException:
        abandon(tensors, job.shm_prefix)
        raise
    return ItemResult(
        modality=modality,
        tensors=tuple(tensors),
        tokens=tokens,
        content_hash=b"",
        width=width,
        height=height,
        frames=frames,
        times=times,
    )
