"""The PIL image processors' resizes without their numpy round trips (runs
in a CPU worker).

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

So, once `install(processor)` has run in a worker, within `processing()`
(one processor call): an array that is the processor's copy of a decoded
RGB image is resized from that image, and a uint8 array resized to its own
size is copied. Everything else, and everything outside `processing()`,
goes to the stock resize. The tensors are the same either way (PIL does the same
resize on the same pixels; tests/tokenizer/test_preprocess.py compares
every tensor of every family). Measured on bench/preprocess.py's JPEGs,
processor time per image, min of nine passes: LLaVA-NeXT 36.4 -> 25.4 ms,
LLaVA-1.5 13.7 -> 12.2 ms.

The arrays are known by identity, for the length of one processor call
(`processing`): only the object `process_image` returned, unmodified (the
PIL processors make new arrays for every step), stands for its image.
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
_active = False
_stock_resize: Callable[..., Any] | None = None
# Round trips skipped, by kind; tests read it to see the shortcuts taken.
skipped = {"from_decoded": 0, "same_size": 0}


def install(processor: Any) -> bool:
    """Take the shortcuts for `processor` in this process. False (and
    nothing changed) when it is not a PIL-backend processor or this
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
    return True


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
