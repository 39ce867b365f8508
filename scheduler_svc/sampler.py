"""Picking each row's next token on rank 0 (DESIGN.md §6).

One call per step for the whole batch: greedy rows share one argmax, sampled
rows each draw from their own `torch.Generator` (seeded per request), so a
request's tokens do not depend on what else is in the batch. The order of
the processors is transformers' own: temperature, then top_k, then top_p.

Before any of that, a request's logit_bias is added to its logits and its
penalties applied (`LogitAdjust`; repetition, then frequency and presence,
in vLLM's order), for greedy and sampled rows alike; rows that ask for none
cost nothing.

Log probabilities (rows whose request asked) are of the distribution the
token was drawn from: log_softmax of the logits (after logit_bias, the
penalties and the min_tokens suppression) for greedy rows; the log of the
renormalized probabilities after temperature, top_k and top_p for sampled
ones.

Isolation: nothing one row carries can fail the others. A row whose logits
are not finite, or whose sampling raises, gets an error message instead of
a token; the step loop fails that request alone and drops it on every rank
in the next plan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmsplit_server.sampling import Sampling

log = logging.getLogger(__name__)


class LogitAdjust:
    """One request's logit_bias and penalties, and what they need to know
    of it: the tokens it has generated (counted) and, for the repetition
    penalty, the tokens of its prompt. Its tensors are made at the first
    token, when the vocabulary's width is known."""

    def __init__(self, params: Sampling, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self._prompt_ids = prompt_ids
        self._counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated
        self._seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or generated (repetition)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, biases)

    def apply(self, logits: torch.Tensor) -> None:
        """Adjust one row's ``[vocab]`` float32 logits in place."""
        p = self.params
        if self._counts is None:
            self._start(logits)
        if self._bias is not None:
            ids, bias = self._bias
            logits[ids] += bias
        if self._seen is not None:
            seen = logits[self._seen]
            logits[self._seen] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        counts = self._counts
        assert counts is not None
        if p.frequency_penalty:
            logits -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits -= p.presence_penalty * (counts > 0)

    def _start(self, logits: torch.Tensor) -> None:
        vocab, device, p = logits.shape[0], logits.device, self.params
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = [t for t in self._prompt_ids if t < vocab]
            if prompt:
                self._seen[torch.tensor(prompt, device=device)] = True
        self._prompt_ids = ()
        biased = [(t, b) for t, b in p.logit_bias if t < vocab]
        if biased:
            ids, bias = zip(*biased, strict=True)
            self._bias = (torch.tensor(ids, device=device), torch.tensor(bias, dtype=torch.float32, device=device))

    def took(self, token: int) -> None:
        if self._counts is not None and token < self._counts.shape[0]:
            self._counts[token] += 1
            if self._seen is not None:
                self._seen[token] = True


@dataclass
class RowSampling:
    """What the sampler needs of one row."""

    request_id: str
    params: Sampling
    # Tokens this request has generated so far (for min_tokens).
    generated: int
    generator: torch.Generator | None
    # Its logit_bias and penalties; None when it asks for none.
    adjust: LogitAdjust | None = None

    def took(self, token: int) -> None:
        """The token this row was given."""
        self.generated += 1
        if self.adjust is not None:
            self.adjust.took(token)


def make_generator(params: Sampling, seed: int, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True)
class Logprob:
    """A drawn token's log probability and the top alternatives (ids and
    log probabilities, most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[int | str]:
        """`logits` is ``[rows, vocab]``; returns each row's token, or an
        error message for a row that cannot be sampled."""
        return self.sample_rows(logits, rows)[0]

    def sample_rows(
        self, logits: torch.Tensor, rows: Sequence[RowSampling]
    ) -> tuple[list[int | str], dict[int, Logprob]]:
        """`sample`, and the log probabilities of the rows that asked (by row index)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} requests")
        logits = logits.float()
        unadjusted = self._adjust(logits, rows) if any(row.adjust is not None for row in rows) else {}
        self._suppress_stops(logits, rows)
        # One pass gives both the greedy tokens and a finiteness check: a row
        # holding NaN or +inf has a non-finite maximum (max propagates NaN).
        top, greedy_t = row_argmax(logits)
        finite = torch.isfinite(top).tolist()
        greedy = greedy_t.tolist()
        out: list[int | str] = []
        logprobs: dict[int, Logprob] = {}
        for i, row in enumerate(rows):
            if i in unadjusted:
                out.append(unadjusted[i])
            elif not finite[i]:
                out.append("the model produced non-finite logits for this request")
            elif row.params.greedy:
                out.append(int(greedy[i]))
                if row.params.logprobs:
                    logprobs[i] = _logprob(torch.log_softmax(logits[i], dim=0), int(greedy[i]), row.params)
            else:
                try:
                    token, probs = _draw(logits[i], row.params, row.generator)
                    out.append(token)
                    if row.params.logprobs:
                        # top_p leaves the kept probabilities as they were: renormalize.
                        logprobs[i] = _logprob(torch.log(probs / probs.sum()), token, row.params)
                except Exception as exc:  # one row's failure must not fail the batch
                    log.exception("sampling failed for request %s", row.request_id)
                    out.append(f"sampling failed: {type(exc).__name__}")
        return out, logprobs

    @staticmethod
    def _adjust(logits: torch.Tensor, rows: Sequence[RowSampling]) -> dict[int, str]:
        """Each row's logit_bias and penalties; the rows whose adjusting
        raised, with the message their request fails with."""
        failed: dict[int, str] = {}
        for i, row in enumerate(rows):
            if row.adjust is not None:
                try:
                    row.adjust.apply(logits[i])
                except Exception as exc:  # one row's failure must not fail the batch
                    log.exception("adjusting the logits failed for request %s", row.request_id)
                    failed[i] = f"applying logit_bias or a penalty failed: {type(exc).__name__}"
        return failed

    def _suppress_stops(self, logits: torch.Tensor, rows: Sequence[RowSampling]) -> None:
        """Before min_tokens, neither EOS nor a request's stop ids may be
        drawn: one indexed write per set of banned ids (most rows share
        one: the model's EOS ids), not one per row."""
        by_banned: dict[tuple[int, ...], list[int]] = {}
        for i, row in enumerate(rows):
            if row.generated < row.params.min_tokens:
                banned = (*self.eos_token_ids, *row.params.stop_token_ids)
                if banned:
                    by_banned.setdefault(banned, []).append(i)
        for banned, at in by_banned.items():
            rows_at = torch.tensor(at, device=logits.device)[:, None]
            logits[rows_at, torch.tensor(banned, device=logits.device)[None, :]] = float("-inf")


# Widths of the column blocks `row_argmax` reduces first, widest first.
_BLOCKS = (256, 128, 64, 32)


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the index of its first occurrence, as
    ``torch.max(dim=1)`` gives them and with `torch.argmax`'s rule (a NaN
    counts as the maximum; the first of equal values wins), several times
    faster on CPU: torch's index-tracking reduction is not vectorized, its
    plain maximum is. So: the maximum of each block of columns (vectorized),
    the first block holding the row's maximum (a reduction over
    vocabulary / block values), then the first maximum inside that block.
    Where no block width divides the vocabulary (LLaVA's 32,001: 32,000
    words and the image token), the columns past the last whole block are
    reduced apart and win only where they hold a greater value, or the
    row's first NaN (for one row, those extra steps cost what they save:
    `torch.max` then, bench/sampler.py)."""
    rows, vocab = logits.shape
    width = next((b for b in _BLOCKS if vocab % b == 0 and vocab > b), _BLOCKS[0])
    whole = vocab - vocab % width
    if whole < 2 * width or not logits.is_contiguous() or (rows == 1 and whole < vocab):
        top, index = logits.max(dim=1)
        return top, index
    blocks = logits[:, :whole].view(rows, whole // width, width)
    block = blocks.amax(dim=2).argmax(dim=1)  # amax propagates NaN; argmax takes the first NaN or maximum
    inside = blocks[torch.arange(rows, device=logits.device), block]  # [rows, width]
    within = inside.argmax(dim=1, keepdim=True)
    top, index = inside.gather(1, within)[:, 0], block * width + within[:, 0]
    if whole == vocab:
        return top, index
    tail_top, tail_index = logits[:, whole:].max(dim=1)
    later = (tail_top > top) | (tail_top.isnan() & ~top.isnan())
    return torch.where(later, tail_top, top), torch.where(later, tail_index + whole, index)


def _logprob(logprobs: torch.Tensor, token: int, params: Sampling) -> Logprob:
    if not params.top_logprobs:
        return Logprob(float(logprobs[token]))
    top = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[0]))
    return Logprob(float(logprobs[token]), tuple(top.indices.tolist()), tuple(top.values.tolist()))


def _draw(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """The drawn token and the distribution it was drawn from."""
    # Subtract the maximum first: every value is then <= 0 and dividing by
    # any positive temperature, however small, cannot make +inf or NaN.
    scores = (logits - logits.max()) / params.temperature
    vocab = scores.shape[0]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the tokens before it already reach top_p; the
        # most likely token always stays.
        drop = (torch.cumsum(sorted_probs, dim=0) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
