"""What a step reads of its new requests, on every rank, before the agreement.

Each item's tensors are read through the `TensorReader` (lent, not copied)
and checked finite; a request whose tensors cannot be used gets its typed
error here, so that every rank's vote in the agreement says why. When a
cache will use them, each readable item is also keyed: this rank's own
digest of what it read (`EncoderCache.key`), never a hash the request
brought. The encoder cache keys its outputs by it, and the prefix cache's
blocks chain it for every multimodal run they overlap.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from mmsplit.errors import E, MmsplitError
from scheduler_svc.encoder_cache import EncoderCache
from scheduler_svc.errors import NonFinitePixels
from scheduler_svc.plan import Item, NewRequest
from scheduler_svc.reader import TensorReader

log = logging.getLogger(__name__)

# One joining request's encoder inputs: per item, forward name -> tensor.
ItemTensors = list[dict[str, torch.Tensor]]

_UNREADABLE = "the tensor could not be read (an internal error, logged on that rank)"


@dataclass
class NewTensors:
    """A step's new requests as this rank read them, in plan order: each
    one's tensors (None when unusable) and its error code and message (0
    and "" when usable); and, when keyed, each usable request's item keys."""

    tensors: list[ItemTensors | None] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    keys: dict[str, list[bytes]] = field(default_factory=dict)


class Intake:
    def __init__(self, reader: TensorReader, rank: int) -> None:
        self.reader = reader
        self.rank = rank
        self._hash_pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use

    def read(self, new: tuple[NewRequest, ...], *, keyed: bool) -> NewTensors:
        """Every new request's tensors; `keyed`: and its items' keys."""
        out = NewTensors()
        for req in new:
            try:
                read = [self._read_item(req.request_id, i, item) for i, item in enumerate(req.items)]
            except MmsplitError as exc:
                log.warning("rank %d could not use tensors of request %s: %s", self.rank, req.request_id, exc)
                out.tensors.append(None)
                out.codes.append(exc.error_code)
                out.messages.append(exc.message)
                continue
            except Exception:
                # A reader bug must not leave this rank out of the vote.
                log.exception("rank %d: tensor reader failed on request %s", self.rank, req.request_id)
                out.tensors.append(None)
                out.codes.append(E.ERROR_CODE_FEATURE_TRANSPORT_FAILED)
                out.messages.append(_UNREADABLE)
                continue
            out.tensors.append(read)
            out.codes.append(0)
            out.messages.append("")
        if keyed:
            self._key_items(new, out)
        return out

    def _key_items(self, new: tuple[NewRequest, ...], out: NewTensors) -> None:
        """Each readable item's key. Hashing reads every byte (a 6.8 MB
        anyres item takes ~5 ms), so the step's items are hashed on several
        threads at once (hashlib lets go of the GIL). A request one of
        whose items cannot be hashed becomes unusable."""
        work = [
            (i, encoder, item.side)
            for i, (req, read) in enumerate(zip(new, out.tensors, strict=True))
            if read is not None
            for encoder, item in zip(read, req.items, strict=True)
        ]

        def key(job: tuple[int, dict[str, torch.Tensor], dict[str, Any]]) -> bytes | None:
            try:
                return EncoderCache.key(job[1], job[2])
            except Exception:
                log.exception("rank %d: hashing an item of request %s failed", self.rank, new[job[0]].request_id)
                return None

        keys = list(self._hashers().map(key, work)) if len(work) > 1 else [key(job) for job in work]
        for (i, _, _), digest in zip(work, keys, strict=True):
            if out.tensors[i] is None:
                continue  # an item before it failed
            if digest is None:
                out.tensors[i] = None
                out.codes[i] = E.ERROR_CODE_FEATURE_TRANSPORT_FAILED
                out.messages[i] = _UNREADABLE
                out.keys.pop(new[i].request_id, None)
                continue
            out.keys.setdefault(new[i].request_id, []).append(digest)

    def _hashers(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._hash_pool is None:
            workers = min(8, os.cpu_count() or 1)
            self._hash_pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="encoder-key")
        return self._hash_pool

    def _read_item(self, rid: str, index: int, item: Item) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, spec in item.encoder:
            tensor = self.reader.read(rid, spec)
            if tensor.is_floating_point() and not all_finite(tensor):
                raise NonFinitePixels(f"item {index}: {name} holds NaN or infinite values")
            out[name] = tensor
        return out


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, in one pass with no temporary: the
    extremes are finite exactly when every value is (`aminmax` propagates
    NaN, and an infinity is an extreme). `isfinite(t).all()` made a bool
    tensor the size of the pixels first: 4.9 ms for a 6.8 MB anyres item
    here, against 0.3 ms, on every rank before the agreement."""
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
