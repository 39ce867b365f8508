"""Log probabilities against a reference's: the tolerances. No imports of
the suite's support (this module is also read by tests/gpu/checks.py, a
script outside pytest, where tests.support.leaks would set the services'
runtime directory to one nobody removes)."""

from __future__ import annotations

from typing import Any

# Float noise between a batched step and `generate` is ~1e-6 here.
LOGPROB_TOLERANCE = 1e-4


def rank_within_ties(rank: int, row: Any, token: int, tolerance: float = LOGPROB_TOLERANCE) -> bool:
    """Whether `rank` is `token`'s rank in `row` (log probabilities over the
    vocabulary): 1 + how many are above its own, where those within
    `tolerance` of it may count either way. A random model's 32,000 log
    probabilities lie close together, so near ties are common, and a
    computation in another order (a head laid out by columns, another
    rank's sums) moves a token's value past a neighbour's by ~1e-6."""
    value = float(row[token])
    surely_above = int((row > value + tolerance).sum())
    maybe_above = int((row > value - tolerance).sum()) - 1  # not the token itself
    return surely_above + 1 <= rank <= maybe_above + 1
