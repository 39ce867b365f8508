"""The encoder-output cache: keys from the bytes (never a hash a request
brings), entries checked on use, memory within its bound."""

from __future__ import annotations

import numpy as np
import torch

from scheduler_svc.encoder_cache import EncoderCache

PIXELS = {"pixel_values": torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)}


def test_the_key_follows_bytes_names_shapes_dtypes_and_side_tensors() -> None:
    key = EncoderCache.key(PIXELS, {})
    assert key == EncoderCache.key({"pixel_values": PIXELS["pixel_values"].clone()}, {})
    changed = PIXELS["pixel_values"].clone()
    changed[0, 0, 0, 0] += 1
    assert EncoderCache.key({"pixel_values": changed}, {}) != key
    assert EncoderCache.key({"pixel_values": PIXELS["pixel_values"].reshape(1, 3, 2, 4)}, {}) != key
    assert EncoderCache.key({"pixel_values": PIXELS["pixel_values"].double()}, {}) != key
    assert EncoderCache.key({"pixel_values_videos": PIXELS["pixel_values"]}, {}) != key
    assert EncoderCache.key(PIXELS, {"image_sizes": np.array([[2, 3]])}) != key


def test_a_hit_is_counted_and_an_entry_of_the_wrong_shape_is_never_served() -> None:
    cache = EncoderCache(1 << 20)
    features = torch.randn(4, 8)
    cache.keep(b"k", features)
    assert cache.would_hit(b"k", 4, 8)
    assert torch.equal(cache.take(b"k", 4, 8), features)  # type: ignore[arg-type]
    assert (cache.hits, cache.misses) == (1, 0)
    # An item that needs another shape under the same key (a corrupt or
    # colliding entry): a miss, and the entry is gone.
    assert not cache.would_hit(b"k", 5, 8)
    assert cache.take(b"k", 5, 8) is None
    assert (cache.hits, cache.misses, len(cache), cache.bytes) == (1, 1, 0, 0)
    assert cache.take(b"absent", 4, 8) is None
    assert cache.misses == 2


def test_memory_stays_within_the_bound_least_recent_first() -> None:
    one = 4 * 8 * 4  # bytes of a [4, 8] float32 entry
    cache = EncoderCache(3 * one)
    for k in (b"a", b"b", b"c"):
        cache.keep(k, torch.zeros(4, 8))
    cache.take(b"a", 4, 8)  # a is now the most recent
    cache.keep(b"d", torch.zeros(4, 8))
    assert cache.bytes == 3 * one
    assert [cache.would_hit(k, 4, 8) for k in (b"a", b"b", b"c", b"d")] == [True, False, True, True]
    cache.keep(b"huge", torch.zeros(64, 8))  # larger than the whole cache: not kept
    assert not cache.would_hit(b"huge", 64, 8)
    assert cache.bytes == 3 * one
    assert not EncoderCache(0).enabled
