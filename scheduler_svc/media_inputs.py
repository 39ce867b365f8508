"""What a joining request's prefill takes from its media.

Families whose encoder outputs are cached (`Family.caches_encoder_outputs`,
with the encoder cache on) get them apart from the forward: from the cache
where every rank has them, the rest encoded now, one call per modality
(`MediaInputs.encode`); the forward then takes each placeholder run's rows
(`features`), a chunk of a long prompt only the rows its placeholders take.
With the encoder cache off, the model encodes media inside its forward
from the items' tensors joined name by name (`MediaInputs.joined`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mmsplit.errors import InternalError
from mmsplit_server.families import Family
from scheduler_svc.encoder_cache import EncoderCache
from scheduler_svc.intake import ItemTensors
from scheduler_svc.plan import NewRequest
from scheduler_svc.prefix_cache import Runs

log = logging.getLogger(__name__)

# The typed verdict on one request whose named work raised (the engine's: logged, typed).
FailedOn = Callable[[NewRequest, BaseException, str], tuple[int, str]]


@dataclass
class Joiner:
    """A request joining this step, and what its prefill needs besides its ids."""

    request: NewRequest
    tensors: ItemTensors | None
    # Encoder outputs by item (families whose outputs are cached): (modality, output).
    features: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    positions: torch.Tensor | None = None  # M-RoPE: [3, prompt length]
    rope_delta: int = 0
    runs: Runs = field(default_factory=Runs)
    # The prompt's start taken from the prefix cache: [layers, 2, heads, tokens, head dim].
    prefix: torch.Tensor | None = None

    @property
    def cached(self) -> int:
        """Prompt tokens taken from the prefix cache (their prefill is skipped)."""
        return 0 if self.prefix is None else int(self.prefix.shape[3])


class MediaInputs:
    def __init__(
        self,
        family: Family,
        body: torch.nn.Module,
        cache: EncoderCache,
        *,
        device: torch.device,
        dtype: torch.dtype,
        hidden: int,
        rank: int,
        failed_on: FailedOn,
        hook: Any = None,
    ) -> None:
        self.family = family
        self._body = body  # the multimodal body whose encoder `family.encode` runs
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.width = family.encoded_width(hidden)  # of an item's encoder output, whose rows are its placeholders'
        self._rank = rank
        self._failed_on = failed_on
        self._hook = hook  # tests' fault injection: on_encoded

    def encode(
        self,
        joiners: list[Joiner],
        keys: dict[str, list[bytes]],
        use_cache: bool,
        codes: list[int],
        messages: list[str],
    ) -> None:
        """Each joiner's encoder outputs (`Joiner.features`), in plan order:
        from the cache where every rank has them (`use_cache`), the rest
        encoded now (one call per modality; when it raises, each request's
        items alone, so the one at fault fails alone) and kept. An output
        that does not fit its item's placeholders fails its request (its
        code and message set). Only requests every rank agreed on get here,
        in the same order on every rank, so the caches change alike for
        what encodes alike."""
        cache = self.cache
        # (joiner, item, inputs, key, placeholder rows) of every item to encode.
        misses: list[tuple[int, int, dict[str, torch.Tensor], bytes, int]] = []
        for ji, j in enumerate(joiners):
            mine = keys.get(j.request.request_id, [])
            for k, (item, encoder, key) in enumerate(zip(j.request.items, j.tensors or (), mine, strict=True)):
                if item.placeholders and item.span[1] <= j.cached:
                    j.features.append((item.modality, None))  # inside the cached prefix: not needed
                    continue
                rows = item.rows
                hit = cache.take(key, rows, self.width) if use_cache else None
                if hit is None:
                    if not use_cache:
                        cache.misses += 1
                    inputs = {name: self._model_input(item.modality, name, t) for name, t in encoder.items()}
                    inputs |= {name: torch.from_numpy(v).to(self.device) for name, v in item.side.items()}
                    misses.append((ji, k, inputs, key, rows))
                j.features.append((item.modality, hit))
        for modality in dict.fromkeys(joiners[ji].request.items[k].modality for ji, k, *_ in misses):
            batch = [m for m in misses if joiners[m[0]].request.items[m[1]].modality == modality]
            outputs = self._encoded(joiners, modality, batch, codes, messages)
            for (ji, k, _, key, rows), output in zip(batch, outputs, strict=True):
                if output is None or codes[ji]:
                    continue
                j = joiners[ji]
                if self._hook is not None and hasattr(self._hook, "on_encoded"):
                    output = self._hook.on_encoded(self._rank, j.request, k, output)
                if tuple(output.shape) != (rows, self.width):
                    codes[ji], messages[ji] = self._failed_on(
                        j.request,
                        InternalError(f"the encoder made {list(output.shape)} for an item of {rows} tokens"),
                        "encoding its media",
                    )
                    continue
                j.features[k] = (modality, output)
                cache.keep(key, output)

    def _encoded(
        self,
        joiners: list[Joiner],
        modality: int,
        batch: list[tuple[int, int, dict[str, torch.Tensor], bytes, int]],
        codes: list[int],
        messages: list[str],
    ) -> list[torch.Tensor | None]:
        """`batch`'s encoder outputs (None for a request whose encode raised),
        in one call; when it raises, each request's items in a call of their
        own. A deterministic failure raises alike on every rank, so every
        rank makes the same calls."""

        def encode(items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor | None]:
            outputs = list(self.family.encode(self._body, modality, items))
            if len(outputs) != len(items):
                raise InternalError(f"the encoder made {len(outputs)} outputs for {len(items)} items")
            return outputs

        try:
            return encode([inputs for _, _, inputs, _, _ in batch])
        except Exception:
            log.warning("rank %d: encoding %d items failed; each request's alone", self._rank, len(batch))
        # Each request's items (their places in `batch`), in order of first appearance.
        by_request: dict[int, list[int]] = {}
        for place, m in enumerate(batch):
            by_request.setdefault(m[0], []).append(place)
        placed: list[torch.Tensor | None] = [None] * len(batch)
        for ji, places in by_request.items():
            try:
                outputs = encode([batch[place][2] for place in places])
            except Exception as exc:
                codes[ji], messages[ji] = self._failed_on(joiners[ji].request, exc, "encoding its media")
                continue
            for place, output in zip(places, outputs, strict=True):
                placed[place] = output
        return placed

    def _model_input(self, modality: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A read encoder input as the model's own input (`owned`), an
        image's rows of one frame repeated (`Family.full_rows`): on a CPU in
        one copy from the lent rows, elsewhere after the rows' move to the
        device (half the bytes moved)."""
        if self.device.type == "cpu":
            full = self.family.full_rows(modality, name, tensor)
            if full is not tensor:  # a new tensor already
                return full.to(self.device, self.dtype)
        return self.family.full_rows(modality, name, owned(tensor, self.device, self.dtype))

    def joined(self, joiners: list[Joiner]) -> dict[str, torch.Tensor]:
        """Every item's tensors joined name by name with cat(dim=0), in plan
        order (the model fills placeholders in row-major order), but for the
        items inside a joiner's cached prefix. Encoder inputs are cast to the
        model's dtype (an image's rows of one frame repeated: `full_rows`);
        side tensors keep theirs. The cat is the copy that
        makes borrowed tensors the engine's own."""
        parts: dict[str, list[torch.Tensor]] = {}
        for j in joiners:
            for item, encoder in zip(j.request.items, j.tensors or (), strict=True):
                if item.placeholders and item.span[0] < j.cached:
                    continue
                for name, tensor in encoder.items():
                    full = self.family.full_rows(item.modality, name, tensor.to(self.device, self.dtype))
                    parts.setdefault(name, []).append(full)
                for name, value in item.side.items():
                    parts.setdefault(name, []).append(torch.from_numpy(value).to(self.device))
        return {name: torch.cat(chunks) for name, chunks in parts.items()}


def features(j: Joiner, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
    """The encoder outputs of `j`'s placeholders in prompt tokens ``[start,
    end)``, item by item: whole items whole, a cut item's rows run by run."""
    out: list[tuple[int, torch.Tensor]] = []
    for item, (modality, output) in zip(j.request.items, j.features, strict=True):
        if output is None or not item.placeholders:
            continue
        first, last = item.span
        if start <= first and last <= end:
            out.append((modality, output))
            continue
        row = 0  # the item's output rows are its placeholders', run after run
        for offset, length in item.placeholders:
            lo, hi = max(start, offset), min(end, offset + length)
            if lo < hi:
                out.append((modality, output[row + lo - offset : row + hi - offset]))
            row += length
    return out


def owned(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A read tensor as a model input of the engine's own: converted or
    moved (a copy either way), or copied. The reader only lends what it
    read (a slab's read-only mapping), and a model may write its inputs."""
    out = tensor.to(device, dtype)
    return out.clone() if out is tensor else out
