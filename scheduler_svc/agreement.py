"""The per-step failure vote (DESIGN.md §6, step 3).

Every rank contributes one row ``[active requests, code of new request 0, ...]``
and ONE all_gather gives every rank the whole table, so every rank derives the
same failed set from the same numbers. Error messages travel (to rank 0 only)
in a second, rarer collective that happens exactly when some code is non-zero
— a condition every rank sees identically in the table, so all ranks take part
or none does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler_svc.collective import Collective
from scheduler_svc.plan import Failure


def agree_on_failures(
    coll: Collective,
    codes: Sequence[int],
    messages: Sequence[str],
    active: int,
    *,
    digest: int = 0,
    digests: list[int] | None = None,
) -> tuple[dict[int, Failure], list[int]]:
    """Return (index of failed new request -> Failure, active requests per rank).

    `codes[i]` is this rank's verdict on new request i (0 = read fine) and
    `messages[i]` its explanation. The failed code reported is the first
    failing rank's. `digest` rides along in the same collective (what this
    rank would take from its encoder cache); every rank's lands in
    `digests`, by rank."""
    if len(codes) != len(messages):
        raise ValueError("one message per code")
    row = torch.tensor([active, digest, *codes], dtype=torch.int64)
    table = coll.all_gather_row(row)
    active_per_rank = [int(v) for v in table[:, 0]]
    if digests is not None:
        digests[:] = [int(v) for v in table[:, 1]]
    verdicts = table[:, 2:]
    failed_any = (verdicts != 0).any(dim=0)
    if not bool(failed_any.any()):
        return {}, active_per_rank
    local = {i: messages[i] for i, c in enumerate(codes) if c != 0}
    gathered = coll.gather_to_0(local)
    failures: dict[int, Failure] = {}
    for i in torch.nonzero(failed_any).flatten().tolist():
        ranks = tuple(int(r) for r in torch.nonzero(verdicts[:, i]).flatten().tolist())
        text = {r: gathered[r].get(i, "") for r in ranks} if gathered is not None else {}
        failures[i] = Failure(code=int(verdicts[ranks[0], i]), ranks=ranks, messages=text)
    return failures, active_per_rank
