"""What rank 0 broadcasts each step and what a step returns.

Invariant: every rank must apply the same plan in the same order, or the next
collective inside the model deadlocks. So the plan carries every decision that
could differ between ranks: which requests join, which leave, and the token
each running request feeds next (sampled on rank 0 only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmsplit.errors import MmsplitError
from mmsplit_server.handoff.reference import TensorSpec
from mmsplit_server.sampling import Sampling


@dataclass(frozen=True)
class Item:
    """One multimodal item, validated at admission (its shapes, side values
    and placeholder runs fit the model family's rule)."""

    modality: int
    # Encoder inputs, read on every rank: (forward name, reference), by name.
    encoder: tuple[tuple[str, TensorSpec], ...]
    # Side tensors (sizes, grids, timings): decoded once, on rank 0, and
    # carried in the plan, so every rank uses the same values.
    side: dict[str, np.ndarray] = field(default_factory=dict)
    placeholders: tuple[tuple[int, int], ...] = ()
    content_hash: bytes = b""

    @property
    def rows(self) -> int:
        """Its placeholder tokens, over all its runs: its encoder output's rows."""
        return sum(length for _, length in self.placeholders)

    @property
    def span(self) -> tuple[int, int]:
        """Prompt tokens from its first placeholder to past its last."""
        if not self.placeholders:
            return (0, 0)
        (first, _), (offset, length) = self.placeholders[0], self.placeholders[-1]
        return first, offset + length


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    input_ids: tuple[int, ...]
    items: tuple[Item, ...]
    # Validated at admission; only rank 0 samples, the others carry it along.
    sampling: Sampling
    # Isolates this request's prefix-cache blocks from those of other salts.
    cache_salt: str = ""
    # Token sequences it never generates (GenerateRequest.bad_words).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Admission order: lower first (GenerateRequest.priority; 0 under fcfs).
    priority: int = 0

    @property
    def specs(self) -> list[TensorSpec]:
        """Every tensor reference of the request that may name a segment."""
        return [spec for item in self.items for _, spec in item.encoder]


@dataclass(frozen=True)
class Plan:
    step: int
    new: tuple[NewRequest, ...] = ()
    # Requests leaving the batch (finished, aborted); unknown ids are ignored.
    drop: tuple[str, ...] = ()
    # Of those, the ones whose KV the prefix cache may keep (they finished
    # or were aborted; never one that failed, whose KV may be poisoned).
    keep: tuple[str, ...] = ()
    # (request id, token) for each running request that continues.
    feed: tuple[tuple[str, int], ...] = ()
    stop: bool = False


@dataclass(frozen=True)
class Failure:
    """A new request that failed on at least one rank, agreed by all ranks."""

    code: int
    ranks: tuple[int, ...]
    # rank -> message; filled on rank 0 only.
    messages: dict[int, str] = field(default_factory=dict)


@dataclass
class StepOutcome:
    # request id -> sampled token (rank 0 only).
    sampled: dict[str, int]
    # request id -> agreed failure (every rank).
    failed: dict[str, Failure]
    # requests each rank holds after the step, indexed by rank (gathered in
    # steps where requests join or leave; unchanged in the others).
    active_per_rank: list[int]
    # request id -> why it could not be sampled (rank 0 only): fails that
    # request alone, with this error (its own parameters banned every token)
    # or as INTERNAL with this message; the next plan drops it on every rank.
    rejected: dict[str, str | MmsplitError] = field(default_factory=dict)
    # Seconds this rank spent in each phase of the step (read, decode, prefill, sample).
    phases: dict[str, float] = field(default_factory=dict)
    # request id -> the sampled token's log probability, for the requests
    # that asked (rank 0 only).
    logprobs: dict[str, Any] = field(default_factory=dict)
    # request id -> prompt tokens taken from the prefix cache, for the
    # requests that joined this step (every rank).
    cached: dict[str, int] = field(default_factory=dict)
    # request id -> failure, for running requests whose decode forward, or
    # a chunk of whose prompt, failed (every rank; TP=1 today): the loop
    # fails them and drops them on every rank in the next plan.
    ended: dict[str, Failure] = field(default_factory=dict)
    # request id -> its prompt tokens' log probabilities (one per token
    # after the first), for the requests that asked and sampled their first
    # token this step (rank 0 only).
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
