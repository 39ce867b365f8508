"""Preprocessed items kept for media seen before (a bounded LRU in the
tokenizer process).

Key: a BLAKE2b digest over the model's fingerprint (its processor, video
processor and model configs), the job's every setting that shapes or admits
the result (limits, sampling rule), and the fetched bytes. So a hash never
stands in for the bytes across models or preprocessing settings: change
either and the key changes.

Value: the item's tensors as bytes (encoder inputs included), its
placeholder count and content hash. A hit skips fetching nothing (the bytes
are needed for the key) but skips decoding and preprocessing; the tensors
are then written into new segments (shared-memory transport) or sent as
they are (inline). Every tensor's length is checked against its shape and
dtype on use, and an entry that does not add up is dropped and counted, never
served. Errors are not cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from pathlib import Path

from blake3 import blake3

from mmsplit_server.handoff import reference
from mmsplit_server.lru import ByteLRU
from tokenizer_svc.preprocess import ItemResult, Job, VideoJob

FINGERPRINT_FILES = ("config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def fingerprint(model_dir: Path) -> bytes:
    """A digest of what decides how media become items for this model."""
    digest = hashlib.blake2b(digest_size=16)
    for name in FINGERPRINT_FILES:
        path = model_dir / name
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return digest.digest()


def entry_bytes(result: ItemResult) -> int:
    return sum(len(t.inline or b"") for t in result.tensors)


def consistent(result: ItemResult) -> bool:
    """Every tensor is inline and holds exactly shape x itemsize bytes."""
    for t in result.tensors:
        if t.inline is None or t.segment is not None:
            return False
        if len(t.inline) != math.prod(t.shape) * reference.itemsize(t.dtype) or len(t.inline) != t.nbytes:
            return False
    return True


class PreprocessCache(ByteLRU[ItemResult]):
    """Preprocessed items (all tensors inline) by `key`; an entry is checked
    (`consistent`) when it is put and when it is used."""

    def __init__(self, max_bytes: int, model_fingerprint: bytes) -> None:
        super().__init__(max_bytes)
        self._fingerprint = model_fingerprint

    def key(self, job: Job) -> bytes:
        """The job's key: model, settings (everything but the bytes and
        where the result goes), then the bytes."""
        settings: Job = dataclasses.replace(
            job, data=b"", shm_prefix="", owner_pid=0, inline=False, slab=None, source=None
        )
        if isinstance(settings, VideoJob):
            settings = dataclasses.replace(settings, budget_s=0.0)  # a time budget does not shape the item
        else:
            settings = dataclasses.replace(settings, max_bytes=0)  # nor does a scheduler's cap admit it for another
        # BLAKE3: collision-resistant (entries are shared between clients),
        # and 4x as fast as SHA-256 here (media up to 1 MiB are hashed on the
        # event loop).
        digest = blake3()
        digest.update(self._fingerprint)
        digest.update(repr(settings).encode())
        digest.update(job.data)
        return digest.digest()

    def get(self, key: bytes, valid: Callable[[ItemResult], bool] = consistent) -> ItemResult | None:
        return super().get(key, valid)

    def put(self, key: bytes, value: ItemResult, size: int = -1) -> None:
        """Keep `value` (all tensors inline); an entry over the whole budget is not kept."""
        if consistent(value):
            super().put(key, value, entry_bytes(value) if size < 0 else size)
