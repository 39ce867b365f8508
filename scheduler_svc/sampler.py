"""Picking each row's next token on rank 0 (DESIGN.md §6).

One call per step for the whole batch: greedy rows share one argmax, sampled
rows each draw from their own `torch.Generator` (seeded per request), so a
request's tokens do not depend on what else is in the batch. The order of
the processors is transformers' own: temperature, then top_k, then top_p.

Before any of that, a request's bans take its tokens that may not come
next to -inf (`Bans`: every token outside its allowed_token_ids, and the
last token of each bad word whose earlier tokens the output ends with,
vLLM's order); then its logit_bias is added to its logits and its
penalties applied (`LogitAdjust`; repetition, then frequency and presence,
in vLLM's order), then its structured output's mask (a json_schema, regex
or choice: the tokens its matcher does not allow next go to -inf), for greedy and sampled
rows alike; rows that ask for none cost nothing.

Log probabilities (rows whose request asked) are of the distribution the
token was drawn from: log_softmax of the logits (after logit_bias, the
penalties, the mask and the min_tokens suppression) for greedy rows; the log of the
renormalized probabilities after temperature, top_k and top_p for sampled
ones.

A row with bans left with nothing to draw (every token banned by its own
allowed_token_ids, bad words, min_tokens or structure) fails its request
with INVALID_REQUEST (`NothingToDraw`), not as a model fault.

Isolation: nothing one row carries can fail the others. A row whose logits
are not finite, or whose sampling raises, gets an error message instead of
a token; the step loop fails that request alone and drops it on every rank
in the next plan.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmsplit_server import structured
from mmsplit_server.sampling import InvalidSampling, Sampling
from mmsplit_server.structured import Broken, Constraint

log = logging.getLogger(__name__)


class LogitAdjust:
    """One request's logit_bias and penalties, kept sparse: the token ids
    they touch (the biased ones, the prompt's when the repetition penalty is
    on, the generated ones), each with its bias, whether it was seen (prompt
    or output: the repetition penalty) and what frequency and presence take
    from it, in numpy arrays grown in place as tokens come. A step costs the
    batch a few operations over the ids touched (`adjust_logits`), never
    over the vocabulary, and the token a row was given an entry or two.
    The prompt's ids are read at the first token, when the vocabulary's
    width is known."""

    def __init__(self, params: Sampling, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self._prompt_ids: Sequence[int] | None = prompt_ids if params.repetition_penalty != 1.0 else ()
        self._where: dict[int, int] = {}  # token id -> its index in the arrays
        self._generated: set[int] = set()
        self.n = 0
        self.ids = np.zeros(0, dtype=np.int64)
        self.bias = np.zeros(0, dtype=np.float32)
        self.seen = np.zeros(0, dtype=bool)
        self.taken = np.zeros(0, dtype=np.float32)  # frequency and presence penalties, summed

    def start(self, vocab: int) -> None:
        """Before the first token: the biased ids and the prompt's (within the vocabulary)."""
        if self._prompt_ids is None:
            return
        for token, bias in self.params.logit_bias:
            if token < vocab:
                i = self._at(token)  # (before naming an array: it may grow them)
                self.bias[i] = bias
        for token in self._prompt_ids:
            if token < vocab:
                i = self._at(token)
                self.seen[i] = True
        self._prompt_ids = None

    def took(self, token: int) -> None:
        p = self.params
        if p.repetition_penalty == 1.0 and not (p.frequency_penalty or p.presence_penalty):
            return  # logit_bias alone: the output changes nothing
        i = self._at(token)
        self.seen[i] = True
        self.taken[i] += p.frequency_penalty + (p.presence_penalty if token not in self._generated else 0.0)
        self._generated.add(token)

    def _at(self, token: int) -> int:
        """The index of `token`'s entry, made if new."""
        i = self._where.get(token)
        if i is None:
            i = self._where[token] = self.n
            if self.n == len(self.ids):
                size = max(16, 2 * self.n)
                self.ids = np.resize(self.ids, size)
                self.bias, self.seen, self.taken = (np.resize(a, size) for a in (self.bias, self.seen, self.taken))
            self.ids[i], self.bias[i], self.seen[i], self.taken[i] = token, 0.0, False, 0.0
            self.n += 1
        return i


class Bans:
    """One request's tokens that may not come next: those outside its
    allowed_token_ids (sorted; empty for any), and the last token of each
    of its bad words (token sequences) whose earlier tokens the generated
    tokens end with, as vLLM matches them (the output's tokens only, not
    the prompt's). A step costs a row one write over the vocabulary when it
    has allowed ids, and a comparison per bad word of two or more tokens."""

    def __init__(self, allowed: Sequence[int], bad_words: Sequence[Sequence[int]]) -> None:
        self.allowed = tuple(allowed)
        self._allowed: torch.Tensor | None = None  # as an index, on the logits' device (first use)
        self.single = tuple(sorted({word[0] for word in bad_words if len(word) == 1}))
        self.longer = tuple((tuple(word[:-1]), word[-1]) for word in bad_words if len(word) > 1)
        # The last generated tokens, as many as the longest bad word's earlier ones.
        self._tail: deque[int] = deque(maxlen=max((len(prefix) for prefix, _ in self.longer), default=0))

    def took(self, token: int) -> None:
        if self.longer:
            self._tail.append(token)

    def banned(self) -> list[int]:
        """The bad words' tokens that may not come next."""
        out = list(self.single)
        if self.longer:
            tail = tuple(self._tail)
            out += [last for prefix, last in self.longer if tail[len(tail) - len(prefix) :] == prefix]
        return out

    def apply(self, row: torch.Tensor) -> None:
        """Ban them in one row of float32 logits (``[vocab]``), in place."""
        if self.allowed:
            if self._allowed is None:
                self._allowed = torch.tensor(self.allowed, dtype=torch.long, device=row.device)
            kept = row[self._allowed]
            row.fill_(float("-inf"))
            row[self._allowed] = kept
        banned = self.banned()
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")


class NothingToDraw(InvalidSampling):
    """Every token is banned at this step by the request's own parameters."""

    def __init__(self) -> None:
        super().__init__(
            "sampling.allowed_token_ids: no token is left to draw at this step (every one is outside "
            "allowed_token_ids, or a bad word's, or an end-of-sequence or stop token before min_tokens, "
            "or outside the structure)"
        )


def adjust_logits(logits: torch.Tensor, adjusts: Sequence[tuple[int, LogitAdjust]]) -> None:
    """Each (row index, its LogitAdjust) of the float32 ``[rows, vocab]``
    logits, in vLLM's order: the bias added, then the repetition penalty
    (seen ids: divided where positive, multiplied where not), then the
    frequency and presence penalties subtracted. The touched entries are
    gathered, changed and written back at once: if this raises, `logits`
    is as it was."""
    for _, a in adjusts:
        a.start(logits.shape[1])
    sizes = [a.n for _, a in adjusts]
    if not any(sizes):
        return
    device = logits.device
    rows = torch.from_numpy(np.repeat(np.array([i for i, _ in adjusts], dtype=np.int64), sizes)).to(device)
    ids = torch.from_numpy(np.concatenate([a.ids[: a.n] for _, a in adjusts])).to(device)

    def joined(name: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([getattr(a, name)[: a.n] for _, a in adjusts])).to(device)

    factor = torch.from_numpy(
        np.repeat(np.array([a.params.repetition_penalty for _, a in adjusts], dtype=np.float32), sizes)
    ).to(device)
    values = logits[rows, ids] + joined("bias")
    values = torch.where(joined("seen"), torch.where(values > 0, values / factor, values * factor), values)
    logits[rows, ids] = values - joined("taken")


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
    # Its structured output's matcher (mmsplit_server.structured); None when it asks for none.
    constraint: Constraint | Broken | None = None
    # Its allowed_token_ids and bad words; None when it has neither.
    bans: Bans | None = None

    def took(self, token: int) -> None:
        """The token this row was given."""
        self.generated += 1
        if self.bans is not None:
            self.bans.took(token)
        if self.adjust is not None:
            self.adjust.took(token)
        if self.constraint is not None:
            self.constraint.took(token)


def make_generator(params: Sampling, seed: int, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True)
class Logprob:
    """A drawn token's log probability and the top alternatives (ids and
    log probabilities, most likely first); a prompt token's also its rank
    (1: the most likely; 0: not reported)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[int | str | InvalidSampling]:
        """`logits` is ``[rows, vocab]``; returns each row's token, or for a
        row that cannot be sampled an error message (a fault) or the
        request's own error (`NothingToDraw`)."""
        return self.sample_rows(logits, rows)[0]

    def sample_rows(
        self, logits: torch.Tensor, rows: Sequence[RowSampling]
    ) -> tuple[list[int | str | InvalidSampling], dict[int, Logprob]]:
        """`sample`, and the log probabilities of the rows that asked (by row index)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} requests")
        logits = logits.float()
        # Rows whose bans, bias, penalties or constraint failed: each fails alone, with its message.
        failed = self._ban(logits, rows) if any(row.bans is not None for row in rows) else {}
        if any(row.adjust is not None for row in rows):
            failed = self._adjust(logits, rows) | failed
        if any(row.constraint is not None for row in rows):
            failed = self._constrain(logits, rows) | failed
        self._suppress_stops(logits, rows)
        # One pass gives both the greedy tokens and a finiteness check: a row
        # holding NaN or +inf has a non-finite maximum (max propagates NaN).
        top, greedy_t = row_argmax(logits)
        finite = torch.isfinite(top).tolist()
        greedy = greedy_t.tolist()
        out: list[int | str | InvalidSampling] = []
        logprobs: dict[int, Logprob] = {}
        for i, row in enumerate(rows):
            if i in failed:
                out.append(failed[i])
            elif not finite[i]:
                # -inf everywhere: its own parameters banned every token (the
                # model's logits are finite, or a NaN would be the maximum).
                nothing = row.bans is not None and top[i].item() == float("-inf")
                out.append(NothingToDraw() if nothing else "the model produced non-finite logits for this request")
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
    def _ban(logits: torch.Tensor, rows: Sequence[RowSampling]) -> dict[int, str]:
        """Each banning row's tokens that may not come next to -inf; the
        rows whose banning raised, with their message (such a row is not
        sampled)."""
        failed: dict[int, str] = {}
        for i, row in enumerate(rows):
            if row.bans is None:
                continue
            try:
                row.bans.apply(logits[i])
            except Exception as exc:  # one row's failure must not fail the batch
                log.exception("applying allowed_token_ids or bad_words failed for request %s", row.request_id)
                failed[i] = f"applying allowed_token_ids or bad_words failed: {type(exc).__name__}"
        return failed

    @staticmethod
    def _adjust(logits: torch.Tensor, rows: Sequence[RowSampling]) -> dict[int, str]:
        """The rows' logit_bias and penalties, all at once; if that raises,
        row by row, so that only the rows whose own adjusting raises fail
        (returned, with the message their request fails with)."""
        adjusts = [(i, row.adjust) for i, row in enumerate(rows) if row.adjust is not None]
        try:
            adjust_logits(logits, adjusts)
            return {}
        except Exception:
            log.exception("adjusting the logits of %d rows at once failed; row by row", len(adjusts))
        failed: dict[int, str] = {}
        for i, adjust in adjusts:
            try:
                adjust_logits(logits, [(i, adjust)])
            except Exception as exc:  # one row's failure must not fail the batch
                log.exception("adjusting the logits failed for request %s", rows[i].request_id)
                failed[i] = f"applying logit_bias or a penalty failed: {type(exc).__name__}"
        return failed

    @staticmethod
    def _constrain(logits: torch.Tensor, rows: Sequence[RowSampling]) -> dict[int, str]:
        """Structured output: each constrained row's tokens that cannot come
        next to -inf (one fill over the rows' masks, made together); the
        rows whose matcher failed, with their message."""
        failed: dict[int, str] = {}
        live: list[tuple[int, Constraint]] = []
        for i, row in enumerate(rows):
            if row.constraint is None:
                continue
            why = row.constraint.failure()
            if why is None and isinstance(row.constraint, Constraint):
                live.append((i, row.constraint))
            else:
                log.warning("structured output failed for request %s: %s", row.request_id, why)
                failed[i] = f"structured output failed: {why}"
        if not live:
            return failed
        try:
            bans = structured.banned(live, (len(rows), logits.shape[1]))
        except Exception as exc:  # these rows fail, not the batch
            log.exception("computing the masks of %d structured rows failed", len(live))
            return failed | {i: f"structured output failed: {type(exc).__name__}" for i, _ in live}
        logits.masked_fill_(torch.from_numpy(bans).to(logits.device), float("-inf"))
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
    """The token's log probability and the top alternatives, as many as
    asked: where fewer tokens could be drawn (banned, masked, cut by top_k),
    the rest are -inf, which the HTTP API writes as OpenAI's -9999.0."""
    if not params.top_logprobs:
        return Logprob(float(logprobs[token]))
    top = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[0]))
    return Logprob(float(logprobs[token]), tuple(top.indices.tolist()), tuple(top.values.tolist()))


def _draw(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """The drawn token and the distribution it was drawn from."""
    # Subtract the maximum first: every value is then <= 0 and dividing by
    # any positive temperature, however small, cannot make +inf or NaN.
    scores = (logits - logits.max()) / params.temperature
    if params.min_p:
        # The most likely token's score is 0 now: a token's probability is
        # under min_p times its where the score is under log(min_p).
        scores = scores.masked_fill(scores < math.log(params.min_p), float("-inf"))
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
