"""The preprocessing cache: keys that separate models and settings, a byte
bound kept by LRU eviction, and entries that do not add up never served."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tokenizer_svc.cache import PreprocessCache, fingerprint
from tokenizer_svc.preprocess import ImageJob, ItemResult, ItemTensor, VideoJob


def job(data: bytes = b"png bytes", **changes: object) -> ImageJob:
    base = ImageJob(data=data, max_pixels=1000, max_aspect_ratio=50.0, shm_prefix="mmsplit", owner_pid=1)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def item(nbytes: int, seed: int = 0) -> ItemResult:
    pixels = np.random.default_rng(seed).random(nbytes // 4, dtype=np.float32)
    grid = np.array([[1, 2, 2]], dtype=np.int64)
    return ItemResult(
        modality=1,
        tensors=(
            ItemTensor("pixel_values", "float32", pixels.shape, pixels.nbytes, inline=pixels.tobytes()),
            ItemTensor("image_grid_thw", "int64", grid.shape, grid.nbytes, inline=grid.tobytes()),
        ),
        tokens=1,
        content_hash=b"h" * 16,
        width=2,
        height=2,
    )


def test_keys_separate_bytes_settings_and_models_but_not_where_the_result_goes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, size in ((a, 224), (b, 336)):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llava"}')
        (d / "preprocessor_config.json").write_text(f'{{"crop_size": {size}}}')
    cache, other_model = PreprocessCache(1 << 20, fingerprint(a)), PreprocessCache(1 << 20, fingerprint(b))
    key = cache.key(job())
    assert cache.key(job(shm_prefix="other", owner_pid=2, inline=True)) == key
    assert cache.key(job(data=b"other bytes")) != key
    assert cache.key(job(max_pixels=2000)) != key
    assert cache.key(job(max_aspect_ratio=10.0)) != key
    assert other_model.key(job()) != key
    video = VideoJob(b"v", 10, 60.0, 100, 2.0, 4, 8, 30.0, "mmsplit", 1)
    assert cache.key(dataclasses.replace(video, budget_s=5.0)) == cache.key(video)
    assert cache.key(dataclasses.replace(video, fps=1.0)) != cache.key(video)


def test_hits_misses_and_the_byte_bound() -> None:
    cache = PreprocessCache(10_000, b"model")
    assert cache.get(b"k0") is None
    for i in range(5):
        cache.put(f"k{i}".encode(), item(3000, seed=i))
        assert cache.bytes <= 10_000
    assert len(cache) == 3  # 3 x (3000 + 24) bytes fit; the two oldest went
    assert cache.evictions == 2
    assert cache.get(b"k0") is None
    got = cache.get(b"k4")
    assert got is not None
    assert got.tensors[0].inline == item(3000, seed=4).tensors[0].inline
    cache.put(b"huge", item(20_000))  # over the whole budget: not kept
    assert cache.get(b"huge") is None
    assert (cache.hits, cache.misses) == (1, 3)


def test_an_entry_that_does_not_add_up_is_dropped_not_served() -> None:
    cache = PreprocessCache(1 << 20, b"model")
    good = item(4000)
    cache.put(b"k", good)
    pixels = good.tensors[0]
    # Damage it in place, as a bug elsewhere might: the bytes no longer fill the shape.
    cut = dataclasses.replace(pixels, inline=pixels.inline[:-4])  # type: ignore[index]
    cache._entries[b"k"] = (dataclasses.replace(good, tensors=(cut, good.tensors[1])), cache._entries[b"k"][1])
    assert cache.get(b"k") is None
    assert cache.dropped == 1
    assert len(cache) == 0
    assert cache.bytes == 0
    # Nor is one accepted in the first place.
    cache.put(b"k", dataclasses.replace(good, tensors=(cut, good.tensors[1])))
    assert len(cache) == 0
