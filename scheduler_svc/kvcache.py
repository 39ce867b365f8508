"""A row-compact KV cache for continuous batching (DESIGN.md §6, "a real engine").

Each running request owns one *row*. Every layer holds keys and values as
``[row capacity, kv heads (local under TP), token capacity, head dim]``; live
rows are kept compact in ``0..rows-1`` and each row has its own length, so
requests of different lengths decode together in one forward:

- **prefill** appends rows at the end: ``begin_prefill(lengths)`` then one
  forward over the right-padded prompts. Each row's keys land at ``0..L-1``
  (padding writes past a row's length are never attended and are
  overwritten by its later tokens).
- **decode** feeds one token per live row: ``begin_decode()`` then one
  forward. Each row writes its new token at its own length.
- **a long prompt in chunks** (chunked prefill) fills a cache of one row
  of its own: `begin_prefill` for the first chunk, `begin_extend` for each
  next (the chunk attends over the row's keys so far and its own), then
  `adopt` copies the finished row to the end of the batch's cache.
- **leave** is swap-remove: the last row moves into the hole. Rows therefore
  move only by `remove`, which the engine calls in plan order, so every rank
  holds the same rows in the same order (the invariant TP depends on).

The forward is given explicit per-row ``position_ids`` and an additive 4-D
mask (a 4-D mask bypasses transformers' cache-length logic, which assumes one
length for the whole batch). The number and size of KV heads are taken from
the first ``key_states`` a layer receives, so under tensor parallelism the
cache holds this rank's shard. Capacity grows in chunks (copying), and the
storage is dropped when the last row leaves; what may be admitted at all is
the scheduler's policy (a KV token budget), not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class ForwardInputs:
    """What a forward over the cache needs besides the input ids."""

    position_ids: torch.Tensor  # [rows, q_len], int64
    attention_mask: torch.Tensor  # [rows, 1, q_len, kv_len], additive, model dtype


class _RowLayer(CacheLayerMixin):
    """A placeholder per layer: `RowCache` keeps the storage and does the
    work; these exist so transformers' introspection of caches (sliding,
    linear, dummy) sees ordinary full-attention layers."""

    is_sliding = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("RowCache allocates its layers itself")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("RowCache.update writes the layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("RowCache is always given a 4-D mask")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


@dataclass(frozen=True)
class _Step:
    first_row: int
    rows: int
    q_len: int
    # Decode: where each row writes its token (its length before the step).
    write_at: torch.Tensor | None
    kv_len: int
    # Extend (one row): where the chunk's keys start (the row's length before it).
    offset: int = 0


class RowCache(Cache):
    def __init__(
        self,
        num_layers: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        token_chunk: int = 256,
        row_chunk: int = 8,
    ) -> None:
        super().__init__(layers=[_RowLayer() for _ in range(num_layers)])
        self.dtype = dtype
        self.device = device
        self.token_chunk = token_chunk
        self.row_chunk = row_chunk
        # Tokens held by each live row (on the CPU: the engine reads them every step).
        self.lengths: list[int] = []
        # Per layer, allocated at its first update: [row cap, kv heads, token cap, head dim].
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._row_capacity = 0
        self._token_capacity = 0
        self._step: _Step | None = None

    # ---- what the engine calls ----
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def token_capacity(self) -> int:
        return self._token_capacity

    @property
    def row_capacity(self) -> int:
        return self._row_capacity

    def begin_prefill(self, prompt_lengths: list[int]) -> ForwardInputs:
        """Append one row per prompt (in order) for a prefill forward over
        the right-padded prompts ``[len(prompt_lengths), max(prompt_lengths)]``."""
        if not prompt_lengths or min(prompt_lengths) < 1:
            raise ValueError(f"prefill needs non-empty prompts, got lengths {prompt_lengths}")
        first, n, q_len = self.rows, len(prompt_lengths), max(prompt_lengths)
        self._reserve(first + n, q_len)
        self.lengths.extend(prompt_lengths)
        self._step = _Step(first, n, q_len, None, q_len)
        lengths = torch.tensor(prompt_lengths, device=self.device)
        key = torch.arange(q_len, device=self.device)
        # Row b, query i may see key j when j <= i (causal) and j < L_b (not padding).
        visible = (key[None, None, :] <= key[None, :, None]) & (key[None, None, :] < lengths[:, None, None])
        position_ids = key.expand(n, q_len)
        return ForwardInputs(position_ids, self._additive(visible[:, None]))

    def begin_decode(self) -> ForwardInputs:
        """One new token for every live row, each at its own position."""
        if not self.lengths:
            raise ValueError("no rows to decode")
        kv_len = max(self.lengths) + 1
        self._reserve(self.rows, kv_len)
        write_at = torch.tensor(self.lengths, device=self.device)
        self._step = _Step(0, self.rows, 1, write_at, kv_len)
        self.lengths = [n + 1 for n in self.lengths]
        key = torch.arange(kv_len, device=self.device)
        visible = key[None, :] <= write_at[:, None]  # [rows, kv_len]
        return ForwardInputs(write_at[:, None], self._additive(visible[:, None, None, :]))

    def begin_extend(self, q_len: int) -> ForwardInputs:
        """The next `q_len` tokens of this cache's one row (a long prompt's
        next chunk): each attends over the row's keys so far and the
        chunk's own up to itself, at positions that go on from the row's."""
        if self.rows != 1 or q_len < 1:
            raise ValueError(f"extending needs one row and a non-empty chunk (rows {self.rows}, chunk {q_len})")
        offset = self.lengths[0]
        kv_len = offset + q_len
        self._reserve(1, kv_len)
        self._step = _Step(0, 1, q_len, None, kv_len, offset)
        self.lengths[0] = kv_len
        key = torch.arange(kv_len, device=self.device)
        query = torch.arange(offset, kv_len, device=self.device)
        visible = key[None, :] <= query[:, None]  # [q_len, kv_len]
        return ForwardInputs(query[None], self._additive(visible[None, None]))

    def adopt(self, other: RowCache) -> None:
        """Append `other`'s one row (a long prompt prefilled in chunks) as
        the last row of this cache."""
        if other.rows != 1:
            raise ValueError("only a cache of one row is adopted")
        n, row = other.lengths[0], self.rows
        self._reserve(row + 1, n)
        for mine, theirs in ((self._keys, other._keys), (self._values, other._values)):
            for i, source in enumerate(theirs):
                if source is None:
                    continue
                if mine[i] is None:
                    mine[i] = self._zeros_like(source)
                mine[i][row, :, :n] = source[0, :, :n]  # type: ignore[index]
        self.lengths.append(n)

    def remove(self, row: int) -> None:
        """Drop `row`; the last row moves into its place (swap-remove)."""
        last = self.rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} of {self.rows}")
        for store in (*self._keys, *self._values):
            if store is not None:
                if row != last:
                    store[row].copy_(store[last])
                # A later row reuses the vacated slot and attends over masked
                # positions with weight 0, and 0 x NaN is NaN: what a poisoned
                # request left there must not outlive it.
                store[last].zero_()
        self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        if not self.lengths:
            self._free()

    def truncate(self, rows: int) -> None:
        """Drop every row from `rows` on (what a failed prefill appended):
        zeroed, as any row that leaves."""
        while self.rows > rows:
            self.remove(self.rows - 1)
        self._step = None

    def nbytes(self) -> int:
        return sum(store.nbytes for store in (*self._keys, *self._values) if store is not None)

    # ---- what transformers calls ----
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        if step is None:
            raise RuntimeError("RowCache.update outside begin_prefill/begin_decode")
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            keys = self._keys[layer_idx] = self._zeros_like(key_states)
            values = self._values[layer_idx] = self._zeros_like(value_states)
        rows = slice(step.first_row, step.first_row + step.rows)
        if step.offset:  # a chunk of one row's prompt: after what the row holds
            keys[0, :, step.offset : step.kv_len] = key_states[0]
            values[0, :, step.offset : step.kv_len] = value_states[0]
            return keys[:1, :, : step.kv_len], values[:1, :, : step.kv_len]
        if step.write_at is None:
            keys[rows, :, : step.q_len] = key_states
            values[rows, :, : step.q_len] = value_states
            # A prefill's rows start empty: what it attends over is exactly its own keys.
            return key_states, value_states
        index = torch.arange(step.rows, device=key_states.device)
        keys[index, :, step.write_at] = key_states[:, :, 0]
        values[index, :, step.write_at] = value_states[:, :, 0]
        return keys[rows, :, : step.kv_len], values[rows, :, : step.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Callers that would use this to make positions or masks are always
        # given both explicitly; the longest row is the honest single answer.
        return max(self.lengths, default=0)

    # ---- storage ----
    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)

    def _reserve(self, rows: int, tokens: int) -> None:
        row_cap = max(self._row_capacity, _round_up(rows, self.row_chunk))
        token_cap = max(self._token_capacity, _round_up(tokens, self.token_chunk))
        if (row_cap, token_cap) == (self._row_capacity, self._token_capacity):
            return
        for stores in (self._keys, self._values):
            for i, old in enumerate(stores):
                if old is not None:
                    stores[i] = _grown(old, row_cap, token_cap, self.rows)
        self._row_capacity, self._token_capacity = row_cap, token_cap

    def _zeros_like(self, states: torch.Tensor) -> torch.Tensor:
        # Zeros, not empty: a masked position still multiplies its value by a
        # zero weight, and uninitialized memory may hold NaN (0 x NaN = NaN).
        _, heads, _, head_dim = states.shape
        shape = (self._row_capacity, heads, self._token_capacity, head_dim)
        return torch.zeros(shape, dtype=states.dtype, device=states.device)

    def _free(self) -> None:
        self._keys = [None] * len(self._keys)
        self._values = [None] * len(self._values)
        self._row_capacity = self._token_capacity = 0


def _round_up(n: int, chunk: int) -> int:
    return max(chunk, math.ceil(n / chunk) * chunk)


def _grown(old: torch.Tensor, rows: int, tokens: int, live_rows: int) -> torch.Tensor:
    new = torch.zeros((rows, old.shape[1], tokens, old.shape[3]), dtype=old.dtype, device=old.device)
    new[:live_rows, :, : old.shape[2]] = old[:live_rows]
    return new
