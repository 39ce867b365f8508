"""The prefix cache: the KV of prompts once prefilled and of finished
requests' outputs, kept in blocks, so a later request whose prompt starts
with the same blocks skips their prefill (a chat client resends the whole
conversation, images included, every turn; many clients share one system
prompt).

A block is `BLOCK_TOKENS` prompt (or generated) tokens. Its key chains:

- its parent's key (the first block's parent is the request's `cache_salt`,
  so tenants with different salts never share a block);
- its token ids;
- for every multimodal placeholder run it overlaps: that item's digest —
  the scheduler's own hash of the tensors it read and their side values
  (grids, sizes), never a hash a client or tokenizer brought — the run's
  index and where in the run the block starts.

Placeholder ids are the same for every image, so ids alone would give a new
image the previous image's KV; with the item's digest in the key the same
text with another image misses from the image's first block on. A match
ends outside every item's span (never between an item's first and last
placeholder, so what follows the match needs whole items only) and leaves
at least the prompt's last token to prefill (its logits make the first
token).

Partial blocks are kept too, as *tails* (1 to 15 tokens past a block
boundary, keyed as a block is but for their length, under the chain of
full blocks before them): a leaving row's last one, and a prompt's tokens
but its last once prefilled (all the same prompt sent again may take). A
later prompt that goes on past a stored tail takes the matched full
blocks and then the longest such tail, so its match may end inside a
block: what beam search needs (each step re-sends the prompt and the
beam's tokens, one token past the step before), a conversation's next
turn (which starts with the last turn's whole text), and a prompt sent
again (n choices, a retry). Tails are never parents: a block's key does
not depend on whether its tokens were once a tail.

Every rank must hold the same blocks in the same order (a hit changes the
prefill's shape, and under TP the forward's collectives must match): the
store changes only at points every rank reaches in plan order — blocks kept
the step after a prompt joined, and when a row leaves (`keep`, for the
requests the plan names), touched when a
joiner every rank agreed on takes its match (`take`) — and eviction is least
recently used by that order, never by time. A match's length and the
store's `history` (a digest of every change made to it, which determines
its blocks and their order) are part of the step's agreement digest, so
ranks whose stores somehow differ use no cached block. Within one chain a parent is always more recent than its
children (a chain is touched leaf first), so eviction never orphans a block.

A block is stored as one tensor ``[layers, 2 (keys, values), kv heads, BLOCK_TOKENS,
head dim]`` on the model's device, this rank's shard of the heads under TP.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmsplit_server.lru import ByteLRU

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Runs:
    """A prompt's multimodal items as the keys need them: per item, its
    digest and its placeholder runs ``(offset, length)``."""

    digests: tuple[bytes, ...] = ()
    placeholders: tuple[tuple[tuple[int, int], ...], ...] = ()

    def spans(self) -> list[tuple[int, int]]:
        """Each item's span: from its first placeholder to past its last."""
        return [(runs[0][0], runs[-1][0] + runs[-1][1]) for runs in self.placeholders if runs]


@dataclass(frozen=True)
class Match:
    """What a prompt could take from the store: the keys of its first
    full blocks, and the key and length of the tail after them (b"", 0:
    none)."""

    keys: tuple[bytes, ...]
    tail: bytes = b""
    tail_tokens: int = 0

    @property
    def tokens(self) -> int:
        return len(self.keys) * BLOCK_TOKENS + self.tail_tokens

    @property
    def all_keys(self) -> tuple[bytes, ...]:
        """The keys taken, root first (the tail last)."""
        return (*self.keys, self.tail) if self.tail else self.keys


NO_MATCH = Match(())


def root(salt: str = "") -> bytes:
    """The parent of a prompt's first block."""
    return hashlib.blake2b(b"mmsplit-prefix-v1|" + salt.encode(), digest_size=16).digest()


def chain(
    ids: Sequence[int], runs: Runs, salt: str = "", *, blocks: int | None = None, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The keys of the first `blocks` full blocks of `ids` (all by default),
    going on from `known`, the first keys of this very chain (a row's, made
    when it joined or was kept before: its tokens only grow)."""
    n = len(ids) // BLOCK_TOKENS if blocks is None else min(blocks, len(ids) // BLOCK_TOKENS)
    if len(known) >= n:
        return list(known[:n])
    # Per block, the runs it overlaps: (item, run index, where in the run the block starts).
    overlaps: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for item, item_runs in enumerate(runs.placeholders):
        for r, (offset, length) in enumerate(item_runs):
            first, last = offset // BLOCK_TOKENS, (offset + length - 1) // BLOCK_TOKENS
            for b in range(first, min(last + 1, n)):
                overlaps[b].append((item, r, b * BLOCK_TOKENS - offset))
    keys = list(known)
    parent = keys[-1] if keys else root(salt)
    for b in range(len(keys), n):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(struct.pack(f"<{BLOCK_TOKENS}q", *ids[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]))
        for item, r, start in overlaps[b]:
            h.update(runs.digests[item] + struct.pack("<IIq", item, r, start))
        parent = h.digest()
        keys.append(parent)
    return keys


def tail_key(parent: bytes, ids: Sequence[int], start: int, tokens: int, runs: Runs) -> bytes:
    """The key of the tail of `tokens` (1 to BLOCK_TOKENS - 1) tokens of
    `ids` from `start` (a block boundary) under the block `parent` (the
    chain's root for a tail at 0): a block's key but for its length, which
    it names."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"tail" + struct.pack(f"<I{tokens}q", tokens, *ids[start : start + tokens]))
    end = start + tokens
    for item, item_runs in enumerate(runs.placeholders):
        for r, (offset, length) in enumerate(item_runs):
            if offset < end and start < offset + length:
                h.update(runs.digests[item] + struct.pack("<IIq", item, r, start - offset))
    return h.digest()


def outside_items(blocks: int, runs: Runs) -> int:
    """The most leading blocks, `blocks` at most, that end outside every
    item's span."""
    spans = runs.spans()
    while blocks > 0 and any(lo < blocks * BLOCK_TOKENS < hi for lo, hi in spans):
        blocks -= 1
    return blocks


def leading_text_keys(ids: Sequence[int], first_item: int | None, salt: str = "") -> list[bytes]:
    """The keys of a prompt's usable full blocks before its first item
    (`first_item`: that item's first placeholder, None for a text-only
    prompt): what it shares with another prompt that starts with the same
    text, whatever media either holds later. The same keys `chain` gives
    those blocks, since they overlap no item."""
    end = len(ids) - 1 if first_item is None else min(first_item, len(ids) - 1)
    return chain(ids, Runs(), salt, blocks=end // BLOCK_TOKENS)


class PrefixCache:
    def __init__(self, capacity_bytes: int) -> None:
        self._blocks: ByteLRU[torch.Tensor] = ByteLRU(capacity_bytes)
        # Counted on every rank alike; the services report rank 0's.
        self.lookups = 0  # prompts looked up (requests joining)
        self.hits = 0  # of them, those that took at least one block
        self.prompt_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, the ones taken from the store
        # Every change so far, chained: equal on two ranks exactly when
        # their stores went through the same changes (so hold the same blocks
        # in the same order).
        self.history = bytes(16)
        self.block_bytes = 0  # of one block, once one was kept

    @property
    def enabled(self) -> bool:
        return self._blocks.enabled

    @property
    def nbytes(self) -> int:
        return self._blocks.bytes

    @property
    def capacity(self) -> int:
        return self._blocks.capacity

    @property
    def evictions(self) -> int:
        return self._blocks.evictions

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> list[bytes]:
        """Every block's key, least recently used first."""
        return self._blocks.keys()

    def fingerprint(self) -> str:
        """A digest of `keys()` (for the debug log that tests compare across ranks)."""
        return hashlib.blake2b(b"".join(self.keys()), digest_size=8).hexdigest()

    def match(self, ids: Sequence[int], runs: Runs, salt: str = "") -> Match:
        """The longest usable run of stored blocks `ids` starts with; changes
        nothing. The stored blocks may end inside an item (the same image,
        then other text in the block holding its end): the match then ends
        before that item."""
        if not self.enabled:
            return NO_MATCH
        keys = chain(ids, runs, salt, blocks=(len(ids) - 1) // BLOCK_TOKENS)
        keys = keys[: self.held(keys)]
        # The longest stored tail after every stored block that leaves the
        # last token and ends outside every item's span (the blocks before
        # it may end inside one: the match ends after the tail)...
        start, parent, spans = len(keys) * BLOCK_TOKENS, keys[-1] if keys else root(salt), runs.spans()
        for tokens in range(min(BLOCK_TOKENS - 1, len(ids) - 1 - start), 0, -1):
            if any(lo < start + tokens < hi for lo, hi in spans):
                continue
            tail = tail_key(parent, ids, start, tokens, runs)
            if self.holds(tail):
                return Match(tuple(keys), tail, tokens)
        # ... else the blocks up to the last that ends outside every span.
        return Match(tuple(keys[: outside_items(len(keys), runs)]))

    def take(self, match: Match, prompt_tokens: int) -> torch.Tensor | None:
        """A match's KV ``[layers, 2, heads, tokens, head dim]`` (None for an
        empty match), its blocks made most recent; counts the lookup."""
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        taken = match.all_keys
        if not taken:
            return None
        blocks = [self._blocks.peek(key) for key in taken]
        if any(block is None for block in blocks):
            raise RuntimeError("a matched block left the prefix cache before it was taken")
        self._record(b"take", taken)
        self._touch(taken)
        self.hits += 1
        self.hit_tokens += match.tokens
        return torch.cat(blocks, dim=3)  # type: ignore[arg-type]

    def holds(self, key: bytes) -> bool:
        """Whether the block `key` is stored (its place in the order unchanged)."""
        return self._blocks.peek(key) is not None

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks are stored."""
        n = 0
        while n < len(keys) and self.holds(keys[n]):
            n += 1
        return n

    def keep(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        *,
        first: int = 0,
        tail: tuple[bytes, torch.Tensor] | None = None,
    ) -> int:
        """Store a leaving row's blocks under `keys` (one per block, as `chain`
        made them), the first `first` of which are stored already; `blocks`
        (``[layers, 2, heads, BLOCK_TOKENS, head dim]`` each, tensors of their
        own) are the others; and its `tail` (its key, as `tail_key` made it,
        and its ``[layers, 2, heads, 1 to BLOCK_TOKENS - 1, head dim]``)
        after the last of them. As many blocks as the budget holds are kept,
        the tail only after all of them, and the chain made most recent, the
        tail least. The blocks added (the tail counted)."""
        if not self.enabled or not (keys or tail):
            return 0
        self._record(b"keep", [*keys, *(tail[:1] if tail else ())])
        # The stored parents first made the most recent, so that storing
        # their children evicts other chains' blocks, never these (the
        # chain fits: at most `capacity` bytes of it are kept).
        self._touch(keys[:first])
        added = 0
        if blocks:
            block_bytes = self.block_bytes = blocks[0].numel() * blocks[0].element_size()
            fits = self.capacity // block_bytes
            for key, block in zip(keys[first:fits], blocks, strict=False):
                self._blocks.put(key, block, block_bytes)
                added += 1
            if fits < len(keys):
                keys, tail = keys[:fits], None
        if tail is not None:
            key, block = tail
            tail_bytes = block.numel() * block.element_size()
            chain_bytes = len(keys) * tail_bytes * BLOCK_TOKENS // block.shape[3]
            if chain_bytes + tail_bytes <= self.capacity:
                self._touch(keys)  # the chain most recent first: storing the tail evicts none of it
                self._blocks.put(key, block, tail_bytes)
                added += 1
                keys = [*keys, key]
        self._touch(keys)
        return added

    def spoil(self, rank: int) -> None:
        """This rank's store may differ from the others' (a change failed
        half done): make its history its own, so no rank uses a cached
        prefix from now on."""
        self._record(b"spoiled by rank %d" % rank, ())

    def _record(self, change: bytes, keys: Sequence[bytes]) -> None:
        self.history = hashlib.blake2b(self.history + change + b"".join(keys), digest_size=16).digest()

    def _touch(self, keys: Sequence[bytes]) -> None:
        # Leaf first, so the root ends most recent: eviction takes a
        # chain's deepest blocks before their parents.
        for key in reversed(keys):
            self._blocks.touch(key)
