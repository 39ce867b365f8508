"""A row-compact KV cache for continuous batching (DESIGN.md §6, "a real engine").

Each running request owns one *row*. Every layer holds keys and values as
``[row capacity, kv heads (local under TP), token capacity, head dim]``; live
rows are kept compact in ``0..rows-1`` and each row has its own length, so
requests of different lengths decode together in one forward:

- **prefill** appends rows at the end: ``begin_prefill(lengths)`` then one
  forward over the right-padded prompts. Each row's keys land at ``0..L-1``
  (padding writes past a row's length are never attended and are
  overwritten by its later tokens).
- **a prefill after a cached prefix** (the prefix cache): rows appended
  by ``begin_prefill(lengths, prefixes)`` start holding their prefix's keys
  and values; each row's prompt tokens go on from there (keys at
  ``P..P+L-1``, attending over the prefix and themselves).
- **decode** feeds one token per live row: ``begin_decode()`` then one
  forward. Each row writes its new token at its own length.
- **a long prompt in chunks** (chunked prefill) fills a cache of one row
  of its own: `begin_prefill` for the first chunk, `begin_extend` for each
  next (the chunk attends over the row's keys so far and its own), then
  `adopt` copies the finished row to the end of the batch's cache.
- **growing ahead**: a long prompt's row, adopted, grows every row's token
  capacity to its length at once, and a grown cache must be zeroed whole
  (GBs: hundreds of ms in one step). `grow_ahead(tokens, steps)` makes the
  grown storage while the prompt's chunks are prefilled and `advance_growth`
  zeroes a share of it each step; the growth itself is then a copy of the
  live rows.
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


@dataclass
class _Growth:
    """Storage made ahead of a growth to `rows` x `tokens`: per layer, the
    keys' and values' new tensors, the first `zeroed` of them zeroed."""

    rows: int
    tokens: int
    stores: list[tuple[list[torch.Tensor | None], int, torch.Tensor]]
    per_step: int
    zeroed: int = 0


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
    # Prefill after cached prefixes: where each row's keys start (None: all at 0).
    offsets: tuple[int, ...] | None = None


class RowCache(Cache):
    def __init__(
        self,
        num_layers: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        token_chunk: int = 256,
        row_chunk: int = 8,
        decode_kv_multiple: int = 1,
    ) -> None:
        super().__init__(layers=[_RowLayer() for _ in range(num_layers)])
        self.dtype = dtype
        # A decode step's keys, padded (masked) up to a multiple of this, so
        # that their shape repeats instead of growing by one every step: for
        # attention kernels that plan per shape (cuDNN's SDPA). 1: no padding.
        self.decode_kv_multiple = decode_kv_multiple
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
        self._growth: _Growth | None = None

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

    def begin_prefill(
        self, prompt_lengths: list[int], prefixes: list[torch.Tensor | None] | None = None
    ) -> ForwardInputs:
        """Append one row per prompt (in order) for a prefill forward over
        the right-padded prompts ``[len(prompt_lengths), max(prompt_lengths)]``.
        A row given a prefix (``[layers, 2, kv heads, P, head dim]``, as
        `row_kv` returns) starts with it: its prompt goes on at position P."""
        if not prompt_lengths or min(prompt_lengths) < 1:
            raise ValueError(f"prefill needs non-empty prompts, got lengths {prompt_lengths}")
        first, n, q_len = self.rows, len(prompt_lengths), max(prompt_lengths)
        offsets = [0 if p is None else int(p.shape[3]) for p in prefixes or [None] * n]
        if len(offsets) != n:
            raise ValueError(f"{len(offsets)} prefixes for {n} prompts")
        kv_len = max(offsets) + q_len
        self._reserve(first + n, kv_len)
        for b, prefix in enumerate(prefixes or ()):
            if prefix is not None:
                self._load(first + b, prefix)
        self.lengths.extend(o + length for o, length in zip(offsets, prompt_lengths, strict=True))
        shifted = tuple(offsets) if any(offsets) else None
        self._step = _Step(first, n, q_len, None, kv_len, offsets=shifted)
        start = torch.tensor(offsets, device=self.device)
        end = start + torch.tensor(prompt_lengths, device=self.device)
        key = torch.arange(kv_len, device=self.device)
        query = start[:, None] + torch.arange(q_len, device=self.device)[None]  # [n, q_len]: absolute positions
        # Row b, query i may see key j when j <= its position (causal, the
        # prefix included) and j is not padding.
        visible = (key[None, None, :] <= query[:, :, None]) & (key[None, None, :] < end[:, None, None])
        return ForwardInputs(query, self._additive(visible[:, None]))

    def append_row(self, prefix: torch.Tensor) -> None:
        """Append a row holding `prefix` (``[layers, 2, kv heads, P, head
        dim]``): a long prompt's cached start, before its chunks extend it."""
        row = self.rows
        self._reserve(row + 1, int(prefix.shape[3]))
        self._load(row, prefix)
        self.lengths.append(int(prefix.shape[3]))

    def copy_rows(self, sources: list[int]) -> None:
        """Append a copy of each of the rows `sources`, in order (joiners
        whose prompt another joiner of the step prefilled: `Engine._prefill`)."""
        first, n = self.rows, len(sources)
        self._reserve(first + n, max(self.lengths[s] for s in sources))
        index = torch.tensor(sources, device=self.device)
        for store in (*self._keys, *self._values):
            if store is not None:
                store[first : first + n] = store.index_select(0, index)
        self.lengths.extend(self.lengths[s] for s in sources)

    def row_blocks(self, row: int, start: int, end: int, size: int) -> list[torch.Tensor] | None:
        """The keys and values of `row` at ``[start, end)`` (a multiple of
        `size` tokens) in blocks of `size` tokens, each one tensor of its own
        ``[layers, 2, kv heads, size, head dim]`` (None before any forward
        allocated the layers). Staged block-major with one copy per layer and
        kind, then one copy per block: 2 x layers + blocks copies, not 2 x
        layers x blocks (each a kernel launch on a GPU, where launches, not
        bytes, were this path's cost). Each block owns its memory, so the
        prefix cache frees what it evicts."""
        pairs = list(zip(self._keys, self._values, strict=True))
        if any(k is None or v is None for k, v in pairs):
            return None
        first = pairs[0][0]
        assert first is not None
        blocks, rest = divmod(end - start, size)
        if rest:
            raise ValueError(f"[{start}, {end}) is not a whole number of {size}-token blocks")
        staged = torch.empty(
            (blocks, len(pairs), 2, first.shape[1], size, first.shape[3]), dtype=first.dtype, device=first.device
        )
        for i, (k, v) in enumerate(pairs):
            for kind, store in enumerate((k, v)):
                part = store[row, :, start:end]  # type: ignore[index]
                staged[:, i, kind].copy_(part.unflatten(1, (blocks, size)).transpose(0, 1))
        return [block.clone() for block in staged.unbind(0)]

    def begin_decode(self) -> ForwardInputs:
        """One new token for every live row, each at its own position."""
        if not self.lengths:
            raise ValueError("no rows to decode")
        kv_len = max(self.lengths) + 1
        if self.decode_kv_multiple > 1:
            kv_len = _round_up(kv_len, self.decode_kv_multiple)
        self._reserve(self.rows, kv_len)
        write_at = torch.tensor(self.lengths, device=self.device)
        self._step = _Step(0, self.rows, 1, write_at, kv_len)
        self.lengths = [n + 1 for n in self.lengths]
        key = torch.arange(kv_len, device=self.device)
        visible = key[None, :] <= write_at[:, None]  # [rows, kv_len]
        return ForwardInputs(write_at[:, None], self._additive(visible[:, None, None, :]))

    def undo_decode(self) -> None:
        """Take back what `begin_decode` did (its forward failed): every
        row's length as before, so whatever the forward wrote at the new
        position is never read or kept."""
        self.lengths = [n - 1 for n in self.lengths]
        self._step = None

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
        if last == 0:  # the storage goes: nothing to move or zero
            self.lengths.pop()
            self._free()
            return
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

    def grow_ahead(self, tokens: int, steps: int) -> None:
        """Make the storage for one more row and rows of `tokens` tokens now,
        to be zeroed over the next `steps` calls of `advance_growth`; the
        growth that needs it (the long row's `adopt`) then only copies the
        live rows. Nothing when the capacity suffices or nothing is allocated."""
        token_cap = _round_up(tokens, self.token_chunk)
        row_cap = max(self._row_capacity, _round_up(self.rows + 1, self.row_chunk))
        pairs = [(stores, i) for stores in (self._keys, self._values) for i in range(len(stores))]
        if token_cap <= self._token_capacity or any(stores[i] is None for stores, i in pairs):
            return
        made = []
        for stores, i in pairs:
            old = stores[i]
            assert old is not None
            shape = (row_cap, old.shape[1], token_cap, old.shape[3])
            made.append((stores, i, torch.empty(shape, dtype=old.dtype, device=old.device)))
        self._growth = _Growth(row_cap, token_cap, made, per_step=math.ceil(len(made) / max(1, steps)))

    def drop_growth(self) -> None:
        """Let go of what `grow_ahead` made: the row it was for never comes
        (its prompt failed or was dropped between chunks)."""
        self._growth = None

    def advance_growth(self) -> None:
        """Zero the next share of the storage `grow_ahead` made."""
        growth = self._growth
        if growth is None:
            return
        end = min(len(growth.stores), growth.zeroed + growth.per_step)
        for _, _, tensor in growth.stores[growth.zeroed : end]:
            tensor.zero_()
        growth.zeroed = end

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
        if step.offsets is not None:  # rows after cached prefixes: each at its own offset
            for b, offset in enumerate(step.offsets):
                keys[step.first_row + b, :, offset : offset + step.q_len] = key_states[b]
                values[step.first_row + b, :, offset : offset + step.q_len] = value_states[b]
            return keys[rows, :, : step.kv_len], values[rows, :, : step.kv_len]
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
    def _load(self, row: int, prefix: torch.Tensor) -> None:
        """Write `prefix` (``[layers, 2, kv heads, P, head dim]``) at the start of `row`."""
        if prefix.shape[0] != len(self._keys):
            raise ValueError(f"a prefix of {prefix.shape[0]} layers for a cache of {len(self._keys)}")
        n = int(prefix.shape[3])
        for i in range(len(self._keys)):
            for stores, part in ((self._keys, prefix[i, 0]), (self._values, prefix[i, 1])):
                if stores[i] is None:
                    stores[i] = self._zeros_like(part[None])
                stores[i][row, :, :n] = part  # type: ignore[index]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)

    def _reserve(self, rows: int, tokens: int) -> None:
        row_cap = max(self._row_capacity, _round_up(rows, self.row_chunk))
        token_cap = max(self._token_capacity, _round_up(tokens, self.token_chunk))
        if (row_cap, token_cap) == (self._row_capacity, self._token_capacity):
            return
        growth, self._growth = self._growth, None
        if growth is not None and row_cap <= growth.rows and token_cap <= growth.tokens:
            for k, (stores, i, new) in enumerate(growth.stores):
                if k >= growth.zeroed:
                    new.zero_()
                old = stores[i]
                assert old is not None
                new[: self.rows, :, : old.shape[2]] = old[: self.rows]
                stores[i] = new
            self._row_capacity, self._token_capacity = growth.rows, growth.tokens
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
        self._growth = None
        self._keys = [None] * len(self._keys)
        self._values = [None] * len(self._values)
        self._row_capacity = self._token_capacity = 0


def _round_up(n: int, chunk: int) -> int:
    return max(chunk, math.ceil(n / chunk) * chunk)


def _grown(old: torch.Tensor, rows: int, tokens: int, live_rows: int) -> torch.Tensor:
    new = torch.zeros((rows, old.shape[1], tokens, old.shape[3]), dtype=old.dtype, device=old.device)
    new[:live_rows, :, : old.shape[2]] = old[:live_rows]
    return new
