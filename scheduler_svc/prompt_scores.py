"""Prompt log probabilities (`SamplingParams.prompt_logprobs`).

A joiner that asks keeps its prefill's hidden states of every prompt
position (but the last); after the forward the LM head scores them
SCORED_POSITIONS at a time, chunk by chunk for a long prompt: each prompt
token's log probability given those before it on the model's own
log_softmax, its rank, and its position's most likely tokens (vLLM's
semantics). Under TP the head's gather is a collective every rank makes,
slice by slice whatever happens; only rank 0 reduces the logits to scores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from scheduler_svc.plan import NewRequest
from scheduler_svc.sampler import Logprob

log = logging.getLogger(__name__)

# Prompt positions whose logits are made at once (a [positions, vocab]
# float32 block each, never a whole long prompt's).
SCORED_POSITIONS = 256


def score_prompt(
    head: Callable[[torch.Tensor], torch.Tensor],
    req: NewRequest,
    hidden: torch.Tensor,
    first: int,
    *,
    rank: int,
    alone: bool,
    hook: Any = None,
) -> list[Logprob] | None:
    """The log probabilities of `req`'s prompt tokens ``first + 1`` on, one
    per row of `hidden` (the hidden states of positions ``first`` on), with
    the most likely tokens and the token's rank. Every rank runs it (`alone`:
    TP=1; else `head` gathers to rank 0, a collective outside what may fail
    here alone); only rank 0 gets scores, or None when making them raised
    (out of memory, say): that request then fails alone."""
    top = req.sampling.prompt_logprobs or 0
    targets = torch.tensor(req.input_ids[first + 1 : first + 1 + hidden.shape[0]], device=hidden.device)
    scores: list[Logprob] | None = []
    for lo in range(0, len(targets), SCORED_POSITIONS):
        rows = slice(lo, lo + SCORED_POSITIONS)
        logits = None if alone else head(hidden[rows])
        try:
            if alone:
                logits = head(hidden[rows])
            if rank == 0 and scores is not None:
                if hook is not None and hasattr(hook, "before_scoring"):
                    hook.before_scoring(rank, req)
                scores += scored(logits, targets[rows], top)  # type: ignore[arg-type]
        except Exception:
            log.exception("request %s: its prompt log probabilities could not be made", req.request_id)
            scores = None
    return scores


def scored(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list[Logprob]:
    """Each row's target's log probability, rank and `top` most likely tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    best, best_ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    rows = zip(chosen[:, 0].tolist(), ranks.tolist(), best_ids.tolist(), best.tolist(), strict=True)
    return [Logprob(lp, tuple(ids), tuple(values), rank) for lp, rank, ids, values in rows]
