"""Beam search over the scheduler's next-token distributions
(GenerateRequest.beam_search, vLLM's use_beam_search).

The scheduler draws tokens; it does not search. As vLLM's server does, the
tokenizer searches: each step asks the scheduler for one token of every
live beam (its prompt followed by the beam's tokens, the prefix cache
holding what they share) with the K most likely next tokens and their log
probabilities (`SamplingParams.top_logprobs`), and `Search.advance` picks
the next beams from those as transformers' beam search (5.x) does:

- K = max(2, 1 + the end tokens) x n candidates, at most MAX_TOP_LOGPROBS:
  the K highest sums of log probabilities over every live beam's
  alternatives; of those, one that ends the generation (`Search.ends`)
  completes a hypothesis when it is among the first n, any other continues
  a beam, until n beams continue; at the last step (max_tokens, the
  context) each of the first n completes;
- at most n hypotheses are kept, the best by score: the sum of log
  probabilities / (tokens generated, the ending one counted) ^
  length_penalty;
- the search is over when no beam continues, or once n hypotheses are
  complete and the best live beam, scored at its length now, would score
  no better than the worst of them (transformers' early_stopping=False).

This module is the arithmetic alone; `TokenizerService` asks the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server.sampling import MAX_TOP_LOGPROBS, InvalidSampling
from tokenizer_svc.errors import InvalidRequest

STOP = common_pb2.FINISH_REASON_STOP

# length_penalty within [-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY].
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class Beam:
    """A partial or complete output: its tokens, their summed log
    probabilities, each token's log probability with its step's
    alternatives, and why it ended (0 while it goes on)."""

    tokens: tuple[int, ...] = ()
    logprob: float = 0.0
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    finish_reason: int = 0


def candidates(width: int, ends: frozenset[int]) -> int:
    """K: the alternatives each step weighs (and asks of every live beam)."""
    return min(max(2, 1 + len(ends)) * width, MAX_TOP_LOGPROBS)


class Search:
    """The live beams and the complete hypotheses of one beam search of
    width `width`; `ends`: the token ids that end a generation."""

    def __init__(self, width: int, length_penalty: float, ends: frozenset[int]) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.ends = ends
        self.k = candidates(width, ends)
        self.live: list[Beam] = [Beam()]
        self.done: list[Beam] = []

    def score(self, beam: Beam) -> float:
        return beam.logprob / max(len(beam.tokens), 1) ** self.length_penalty

    def advance(self, steps: list[common_pb2.TokenLogprob], *, last: bool = False, last_reason: int = 0) -> None:
        """One step: `steps[i]`, live beam i's next-token alternatives
        (`top_token_ids` and `top_logprobs`, most likely first; a token that
        cannot be drawn, at -inf, is no candidate). `last`: no step follows
        (the first n candidates complete, those that end no generation with
        `last_reason`)."""
        if len(steps) != len(self.live):
            raise ValueError(f"{len(steps)} distributions for {len(self.live)} live beams")
        found = [
            (beam.logprob + lp, i, token, lp)
            for i, (beam, step) in enumerate(zip(self.live, steps, strict=True))
            for token, lp in zip(step.top_token_ids, step.top_logprobs, strict=True)
            if lp != -math.inf
        ]
        # Highest sum first; ties in the order the beams and their alternatives came (sort is stable).
        found.sort(key=lambda c: -c[0])
        live: list[Beam] = []
        for rank, (total, i, token, lp) in enumerate(found[: self.k]):
            step = steps[i]
            entry = common_pb2.TokenLogprob(
                logprob=lp, top_token_ids=step.top_token_ids, top_logprobs=step.top_logprobs
            )
            beam = self.live[i]
            grown = Beam((*beam.tokens, token), total, (*beam.logprobs, entry))
            if token in self.ends or last:
                if rank < self.width:
                    self._complete(
                        dataclasses.replace(grown, finish_reason=STOP if token in self.ends else last_reason)
                    )
                continue
            live.append(grown)
            if len(live) == self.width:
                break
        self.live = live

    def _complete(self, beam: Beam) -> None:
        self.done.append(beam)
        self.done.sort(key=self.score, reverse=True)
        del self.done[self.width :]

    @property
    def over(self) -> bool:
        """No beam goes on, or none that goes on could do better than the
        complete hypotheses kept (transformers' heuristic)."""
        if not self.live:
            return True
        if len(self.done) < self.width:
            return False
        best = max(beam.logprob for beam in self.live) / len(self.live[0].tokens) ** self.length_penalty
        return min(self.score(beam) for beam in self.done) >= best

    def best(self) -> list[Beam]:
        """The complete hypotheses, best first."""
        return list(self.done)


# What beam search cannot honour: it draws no output for these to act on.
_NOT_WITH_BEAMS = (
    "stop", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "bad_words", "prompt_logprobs",
    "json_schema", "regex", "choice", "grammar",
)  # fmt: skip


def checked(request: tokenizer_pb2.GenerateRequest) -> float:
    """`request`'s length_penalty (1 unset), or INVALID_REQUEST for a
    penalty out of bounds or a sampling field beam search cannot honour."""
    beams = request.beam_search
    penalty = beams.length_penalty if beams.HasField("length_penalty") else 1.0
    if not math.isfinite(penalty) or abs(penalty) > MAX_LENGTH_PENALTY:
        raise InvalidRequest(
            f"beam_search.length_penalty {penalty!r} must be within [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]",
            metadata={"param": "length_penalty"},
        )
    s = request.sampling
    for name in _NOT_WITH_BEAMS:
        if s.HasField(name) if name in ("top_p", "prompt_logprobs") else getattr(s, name):
            raise InvalidSampling(
                f"sampling.{name} cannot go with beam search, which ranks the model's own next tokens and draws "
                "none; leave it out"
            )
    return penalty


def step_request(request: tokenizer_pb2.GenerateRequest, k: int, step: int) -> tokenizer_pb2.GenerateRequest:
    """What step `step` (from 0) asks of the scheduler for each live beam:
    one token, with the `k` most likely and their log
    probabilities; the end tokens held back while `step` is under
    min_tokens. The prompt (with the beam's tokens) is the caller's."""
    sub = tokenizer_pb2.GenerateRequest()
    sub.CopyFrom(request)
    sub.ClearField("beam_search")
    sub.n = 1
    sub.return_prompt_token_ids = False
    s = sub.sampling
    s.max_tokens = 1
    s.logprobs = True
    s.top_logprobs = k
    s.min_tokens = 1 if step < request.sampling.min_tokens else 0
    return sub
