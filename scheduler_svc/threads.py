"""How many threads a step runs on, on a CPU device.

A rank runs its model's operators on its share of the host's cores (torch's
intra-op threads; `ranks.bootstrap` divides them among the ranks). When the
front end shares those cores (the tokenizer, its gRPC, the rank's own event
loop), a step that takes every core fights it: an OpenMP team waits at each
operator's end for its slowest thread, and that thread is the one the kernel
just gave away, while its idle thread spins for the next operator on a core
the tokenizer wanted. Leaving one core free can then be faster for everyone;
for a wider model or a quieter host every core is. Which one wins depends on
the model, the batch and the load of the moment (on this project's 2-core
host, in service: the tiny model's 32-row decode 7.6 ms on one thread against
10.8 on two, the 8-layer 512-wide model's the other way; bench/RESULTS.md),
so `StepThreads` measures instead of guessing. vLLM's CPU backend reserves
cores for its front end by a setting; this is that choice, made per step.

For each kind of step it keeps an exponential average of the step's time
on each choice: all of the rank's threads, or one fewer. A decode step's
kind is its running rows by powers of two, those its forward runs (the rows
it drops leave first); a step that prefills is known by the prompt tokens
it prefills, by powers of two, and timed per token. It runs each choice a
few times, then the faster one, and now and then the other one again (every
`explore_every`-th step of that kind, more rarely the further behind it
is), so it follows the load when it changes.

Prefills are measured apart because the load they meet is not a decode
step's: while rows decode the tokenizer relays their tokens, while a burst
of prompts prefills nothing streams. They once ran on the verdict of the
decode steps with the most rows: in service at 8x512, a 28-prompt prefill
(2,230 tokens) then ran on one thread after an 8-row verdict, 1.31 s
against ~0.8 on two. Which one wins a prefill is no constant either: in
process on an idle host 0.68 s on two threads against 1.26 on one, and
2.19 against 1.43 while another process spins on one of the two cores
(bench/RESULTS.md). A wrong choice costs a whole prefill, so a prefill
kind runs on every thread its first `PREFILL_FIRST` times, then on one
fewer once, and is tuned from there like the rest.

A step's thread count is set as it starts (its drops' copies and its
reads run on it), by its prompts' whole length; once the step has matched
its prompts against the prefix cache, before any forward, it is chosen
again for the tokens left to prefill (`StepRun.refine`), and its time is
recorded under the tokens that went through the model. A multi-turn
chat's later turns take most of their prompt from the cache: timed as
whole prompts, the 8x512 model's 1,600-token prefills took 45-85 µs a
token when cached and 370-690 when not, in one kind's average, and which
thread count won was a matter of which one the cached turns fell to;
recorded apart but still chosen as whole prompts, a cached turn ran on
the verdict of uncached prefills of its length, and its own kind's
choices were never tried in turn.

A step with no running rows and no prefill runs no forward (a heartbeat,
a step that only drops): it gives no verdict, and runs on one thread
fewer. A heartbeat's times are noise, ~0.0 ms on either choice. A step
that ends a burst's 30 rows copies their prefixes into the cache, some
3,000 small copies while the event loop streams their last tokens: in
service 160-520 ms on two threads against ~30 on one (in process, alone,
6.3 against 7.6 ms; 10.4 against 7.7 with a busy core), and the next
burst's first prefill waited for it. It once counted as a 30-row decode
step.

The thread count only changes how operators split their work: the tokens
are the same either way up to the order of floating-point sums inside an
operator. The test suite's processes run on one thread, where there is no
choice to make; tests/scheduler/test_threads.py drives the tuner itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

# Steps of each choice, per kind, before the tuner trusts its averages.
WARMUP = 3
# Every this many steps of one kind, the slower choice runs once to be
# re-measured; more rarely the further behind it is: a choice slower by a
# fraction g is re-run every EXPLORE_EVERY * max(1, g / EXPLORE_COST) steps,
# so re-measuring costs at most EXPLORE_COST / EXPLORE_EVERY (~0.3 %) of
# the steps' time, and a near tie is re-checked most often.
EXPLORE_EVERY = 32
EXPLORE_COST = 0.1
# A prefill kind's first steps on every thread before one runs on one
# fewer (once: a wrong choice costs a whole prefill), then it is tuned as
# any kind is.
PREFILL_FIRST = 3
# Weight of the newest time in a choice's average.
ALPHA = 0.3
# A kind's change of verdict is logged at INFO at most this often (near a
# tie the verdict can flip every few steps: 1-row 8x512 decode steps at
# ~18 ms on either choice flipped ~10 times a second); the rest at DEBUG.
LOG_EVERY_S = 60.0


class StepKind(NamedTuple):
    """Steps alike enough to compare, by powers of two (bucket k holds
    2**(k-1) to 2**k - 1; 0 none): a decode step by its running rows, those
    its forward runs; a step that prefills by the prompt tokens it
    prefills (rows decoding beside them are small work, and not counted)."""

    rows: int
    prefill: int = 0

    @classmethod
    def of(cls, rows: int, *, prefill: int = 0) -> StepKind:
        return cls(0, prefill.bit_length()) if prefill else cls(rows.bit_length())

    def __str__(self) -> str:
        if self.prefill:
            return f"prefills of {_span(self.prefill)} prompt tokens"
        return f"steps with {_span(self.rows) if self.rows else 'no'} running rows"


def _span(bucket: int) -> str:
    return f"{1 << (bucket - 1)}-{(1 << bucket) - 1}"


# A step with nothing to run: no running rows, no prefill.
IDLE = StepKind(0)


@dataclass
class _Seen:
    """What the tuner knows about one kind of step."""

    seconds: dict[int, float] = field(default_factory=dict)  # average step time by thread count
    runs: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    best: int | None = None  # the faster choice when last compared (for the log)
    logged_at: float | None = None  # when a change of verdict was last logged at INFO
    unlogged: int = 0  # changes of verdict since then


class StepThreads:
    def __init__(
        self,
        threads: int,
        *,
        explore_every: int = EXPLORE_EVERY,
        warmup: int = WARMUP,
        prefill_first: int = PREFILL_FIRST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self._clock = clock
        self.choices = (threads, threads - 1) if threads > 1 else (threads,)
        self.explore_every = explore_every
        self.warmup = warmup
        self.prefill_first = prefill_first
        self._seen: dict[StepKind, _Seen] = {}

    @property
    def tuning(self) -> bool:
        return len(self.choices) > 1

    def choose(self, kind: StepKind) -> int:
        """The thread count for the next step of this kind."""
        if not self.tuning:
            return self.threads
        if kind == IDLE:
            return self.choices[-1]  # one fewer: its copies gain nothing from every thread
        seen = self._seen.setdefault(kind, _Seen())
        seen.steps += 1
        untried = self._untried(kind, seen)
        if untried:
            # A prefill kind: every thread first. A decode kind alternates:
            # the choices see the same stretch of load.
            return untried[0] if kind.prefill else min(untried, key=lambda c: seen.runs.get(c, 0))
        best, other = sorted(self.choices, key=lambda c: seen.seconds[c])
        behind = seen.seconds[other] / max(seen.seconds[best], 1e-9) - 1
        every = self.explore_every * max(1, int(behind / EXPLORE_COST))
        return other if seen.steps % every == 0 else best

    def _untried(self, kind: StepKind, seen: _Seen) -> list[int]:
        """The choices still warming up for this kind, every thread first."""
        if kind.prefill:
            # One fewer only once every thread has had its runs.
            first, other = self.choices[0], self.choices[-1]
            if seen.runs.get(first, 0) < self.prefill_first:
                return [first]
            return [other] if seen.runs.get(other, 0) < 1 else []
        return [c for c in self.choices if seen.runs.get(c, 0) < self.warmup]

    def record(self, kind: StepKind, threads: int, seconds: float) -> None:
        """One step's time: seconds, or for a prefill seconds per prompt token."""
        if not self.tuning or kind == IDLE:
            return
        seen = self._seen.setdefault(kind, _Seen())
        seen.runs[threads] = seen.runs.get(threads, 0) + 1
        last = seen.seconds.get(threads)
        seen.seconds[threads] = seconds if last is None else last + ALPHA * (seconds - last)
        if self._untried(kind, seen):
            return
        best = min(self.choices, key=lambda c: seen.seconds[c])
        if best != seen.best:
            seen.best = best
            self._log_verdict(kind, seen)

    def _log_verdict(self, kind: StepKind, seen: _Seen) -> None:
        now = self._clock()
        ago = None if seen.logged_at is None else now - seen.logged_at
        if kind.prefill:
            times = ", ".join(f"{seen.seconds[c] * 1e6:.0f} µs a token on {c}" for c in self.choices)
        else:
            times = ", ".join(f"{seen.seconds[c] * 1e3:.1f} ms on {c}" for c in self.choices)
        threads = f"{seen.best} thread{'' if seen.best == 1 else 's'}"
        if ago is not None and ago < LOG_EVERY_S:
            seen.unlogged += 1
            log.debug("%s now run on %s (lately %s)", kind, threads, times)
            return
        since = f"; {seen.unlogged} more changes in the {ago:.0f}s before" if ago is not None and seen.unlogged else ""
        log.info("%s now run on %s (lately %s%s)", kind, threads, times, since)
        seen.logged_at, seen.unlogged = now, 0

    def _unchoose(self, kind: StepKind) -> None:
        """Take back a `choose` of a kind the step turned out not to be."""
        seen = self._seen.get(kind)
        if seen is not None:
            seen.steps -= 1

    @contextmanager
    def run(
        self, kind: StepKind, tokens: int = 1, *, ran: Callable[[], tuple[StepKind, int]] | None = None
    ) -> Iterator[StepRun]:
        """Run the block (one step of this kind) on the chosen thread count,
        time it (per token of a prefill of `tokens`), and set every thread
        back afterwards. The block may refine the step's kind before its
        forwards (`StepRun.refine`). `ran`, when given, says once the block
        is done what it really ran, its kind and prefill tokens: a step's
        prompts may turn out to come mostly from the prefix cache, and their
        time is then that of the tokens it did prefill."""
        step = StepRun(self, kind)
        try:
            start = time.perf_counter()
            yield step
            seconds = time.perf_counter() - start
            kind, tokens = ran() if ran is not None else (step.kind, tokens)
            self.record(kind, step.threads, seconds / max(tokens, 1))
        finally:
            if step.threads != self.threads:
                torch.set_num_threads(self.threads)

    def summary(self) -> dict[StepKind, dict[int, float]]:
        """Average step time (seconds; a prefill's per token) by kind and thread count."""
        return {kind: dict(seen.seconds) for kind, seen in sorted(self._seen.items())}


class StepRun:
    """A step under way: the kind its thread count was chosen for, and that count."""

    def __init__(self, tuner: StepThreads, kind: StepKind) -> None:
        self._tuner = tuner
        self.kind = kind
        self.threads = tuner.choose(kind)
        if self.threads != tuner.threads:
            torch.set_num_threads(self.threads)

    def refine(self, kind: StepKind) -> None:
        """The step's kind as it knows it better, before its forwards (the
        tokens left to prefill once its prompts are matched against the
        prefix cache): chosen for again, in place of the first choice."""
        if kind == self.kind:
            return
        self._tuner._unchoose(self.kind)
        threads = self._tuner.choose(kind)
        if threads != self.threads:
            torch.set_num_threads(threads)
        self.kind, self.threads = kind, threads
