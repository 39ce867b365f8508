"""The PIL image processors' work without their needless passes over the
pixels (runs in a CPU worker).

transformers' PIL-backend image processors hold each image as a numpy
array and resize through PIL: `image_transforms.resize` turns the array
back into a PIL image, resizes that, and turns the result into an array
again. Two of those round trips are pure cost:

- the first resize of an image: its array is the processor's own copy of
  the PIL image the worker decoded (`process_image`), and making a PIL
  image of it again copies every pixel twice, ~1.9 ms for a 1920x1080
  photo here. LLaVA-NeXT does this twice per image (the best-fit grid and
  the base image);
- a resize to the array's own size, which PIL answers with a copy:
  LLaVA-NeXT "resizes" each of its 336x336 patches to 336x336, and each
  such call is a copy into PIL, a copy in PIL and a copy out.

Then every processor rescales the resized uint8 pixels (to float64 and
back to float32) and normalizes them (a float32 subtraction and division
per channel): four passes and three temporaries, 1.5 ms for a 336x336
image and 58 ms for a 1932x1092 one here. Each output value is a function
of its channel and its uint8 input alone, so a table of 256 values a
channel, made by the processor's own rescale and normalize, gives the
same values in one lookup pass (0.6 and 22 ms).

So, once `install(processor)` has run in a worker, within `processing()`
(one processor call): an array that is the processor's copy of a decoded
RGB image is resized from that image, a uint8 array resized to its own
size is copied, and where the processor rescales and then normalizes, the
rescale hands its uint8 array on unchanged and the normalize looks the
values up. Everything else, and everything outside `processing()`, goes to
the stock functions. The tensors are the same either way (PIL does the
same resize on the same pixels, the table holds the stock functions'
values; tests/tokenizer/test_preprocess.py compares every tensor of every
family). Measured on bench/preprocess.py's JPEGs, processor time per image,
min of nine passes, for the resizes: LLaVA-NeXT 36.4 -> 25.4 ms, LLaVA-1.5
13.7 -> 12.2 ms.

The arrays are known by identity, for the length of one processor call
(`processing`): only the object `process_image` returned, unmodified (the
PIL processors make new arrays for every step), stands for its image, and
only the object a rescale handed on stands for its rescaled values. The
processors served rescale and normalize one after the other, nothing in
between (their `_preprocess`; the test holds it for this transformers); a
rescaled array that never reaches a normalize would mean other steps, and
the processor's call is then made again with the stock rescale.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import transformers.image_processing_backends as backends
from PIL import Image
from transformers.image_utils import ChannelDimension

# id(array) -> (array, the PIL image it is a copy of), for one processor call.
# The array is held, so its id cannot be reused while the entry lives.
_decoded: dict[int, tuple[np.ndarray, Image.Image]] = {}
# id(array) -> (array, scale): uint8 pixels a rescale handed on unchanged,
# for the normalize after it; within one `_preprocess` that does both.
_rescaled: dict[int, tuple[np.ndarray, float]] = {}
_active = False
_fusing = False
_stock_resize: Callable[..., Any] | None = None
# (scale, mean, std) -> the rescaled and normalized value of each uint8 value, by channel.
_tables: dict[tuple[Any, ...], np.ndarray] = {}
# Passes skipped, by kind; tests read it to see the shortcuts taken.
skipped = {"from_decoded": 0, "same_size": 0, "looked_up": 0}


def install(processor: Any, *, lookup: bool = True) -> bool:
    """Take the shortcuts for `processor` in this process (`lookup`: the
    rescale and normalize too; off, for bench/processor_steps.py). False
    (and nothing changed) when it is not a PIL-backend processor or this
    transformers resizes differently."""
    global _stock_resize
    if not isinstance(processor, backends.PilBackend) or not callable(getattr(backends, "np_resize", None)):
        return False
    if _stock_resize is None:
        _stock_resize = backends.np_resize
        backends.np_resize = _resize
    stock = processor.process_image

    @functools.wraps(stock)
    def process_image(image: Any, *args: Any, **kwargs: Any) -> Any:
        array = stock(image, *args, **kwargs)
        if _active and _is_copy_of(image, array, args, kwargs):
            _decoded[id(array)] = (array, image)
        return array

    processor.process_image = process_image  # type: ignore[method-assign]  # this instance only
    if lookup:
        _fuse_rescale_and_normalize(processor)
    return True


def _fuse_rescale_and_normalize(processor: Any) -> None:
    """The instance's rescale hands uint8 pixels on, and its normalize
    looks up both steps' values, within a `_preprocess` that does both."""
    stock_preprocess, stock_rescale, stock_normalize = processor._preprocess, processor.rescale, processor.normalize

    @functools.wraps(stock_preprocess)
    def _preprocess(images: Any, *args: Any, **kwargs: Any) -> Any:
        global _fusing
        if not _active or args or not (kwargs.get("do_rescale") and kwargs.get("do_normalize")):
            return stock_preprocess(images, *args, **kwargs)
        _fusing = True
        try:
            out = stock_preprocess(images, **kwargs)
        finally:
            _fusing = False
            unmatched = bool(_rescaled)
            _rescaled.clear()
        # A rescaled array no normalize took: steps other than the known ones.
        return stock_preprocess(images, **kwargs) if unmatched else out

    @functools.wraps(stock_rescale)
    def rescale(image: Any, scale: float, **kwargs: Any) -> Any:
        if _fusing and not kwargs and _is_channels_first_uint8(image):
            _rescaled[id(image)] = (image, scale)
            return image
        return stock_rescale(image, scale, **kwargs)

    @functools.wraps(stock_normalize)
    def normalize(image: Any, mean: Any, std: Any, **kwargs: Any) -> Any:
        held = _rescaled.pop(id(image), None)
        if held is None or held[0] is not image:
            return stock_normalize(image, mean, std, **kwargs)
        if kwargs:
            return stock_normalize(stock_rescale(image, held[1]), mean, std, **kwargs)
        key = (held[1], _values(mean), _values(std), image.shape[0])
        table = _tables.get(key)
        if table is None:
            every = np.broadcast_to(np.arange(256, dtype=np.uint8), (image.shape[0], 1, 256)).copy()
            table = _tables[key] = np.ascontiguousarray(stock_normalize(stock_rescale(every, held[1]), mean, std)[:, 0])
        out = np.empty(image.shape, dtype=table.dtype)
        # numpy makes each block's uint8 values into a temporary array of
        # indices (8 bytes a value): blocks of ~64K values keep it in cache
        # (12 ms for a 1932x1092 image here, 28 in one block a channel).
        rows = max(1, 65536 // max(1, image.shape[2]))
        for channel in range(image.shape[0]):
            for row in range(0, image.shape[1], rows):
                np.take(table[channel], image[channel, row : row + rows], out=out[channel, row : row + rows])
        skipped["looked_up"] += 1
        return out

    processor._preprocess = _preprocess
    processor.rescale = rescale
    processor.normalize = normalize


def _is_channels_first_uint8(image: Any) -> bool:
    return isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[0] in (1, 3, 4)


def _values(x: Any) -> tuple[float, ...]:
    """A mean or std as a key: one number, or one a channel."""
    return tuple(float(v) for v in np.atleast_1d(np.asarray(x, dtype=np.float64)))


@contextlib.contextmanager
def processing() -> Iterator[None]:
    """One processor call with the shortcuts; the images it decoded are
    let go at its end."""
    global _active
    _active = True
    try:
        yield
    finally:
        _active = False
        _decoded.clear()


def _is_copy_of(image: Any, array: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`array` is `np.array(image)` with its channels moved first, nothing
    else: an RGB PIL image the processor did not convert (with conversion
    on, it composites transparency first, and the array is not the image)."""
    return (
        not args
        and kwargs.get("do_convert_rgb") is False
        and isinstance(image, Image.Image)
        and image.mode == "RGB"
        and isinstance(array, np.ndarray)
        and array.dtype == np.uint8
        and array.shape == (3, image.height, image.width)
    )


def _resize(
    image: Any,
    size: tuple[int, int],
    resample: Any = None,
    reducing_gap: int | None = None,
    data_format: Any = None,
    return_numpy: bool = True,
    input_data_format: Any = None,
) -> Any:
    assert _stock_resize is not None  # installed before it replaced the stock one
    if (
        _active
        and return_numpy
        and isinstance(image, np.ndarray)
        and image.dtype == np.uint8
        and image.ndim == 3
        and image.shape[0] in (1, 3, 4)  # what PIL holds as L, RGB, RGBA
        and input_data_format == ChannelDimension.FIRST
        and data_format == ChannelDimension.FIRST
    ):
        if tuple(image.shape[-2:]) == tuple(size):
            skipped["same_size"] += 1
            return image.copy()
        held = _decoded.get(id(image))
        if held is not None and held[0] is image:
            skipped["from_decoded"] += 1
            image = held[1]
    return _stock_resize(
        image,
        size,
        resample=resample,
        reducing_gap=reducing_gap,
        data_format=data_format,
        return_numpy=return_numpy,
        input_data_format=input_data_format,
    )
