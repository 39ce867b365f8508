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

For each kind of decode step (running rows by powers of two) it keeps an
exponential average of the step's time on each choice: all of the rank's
threads, or one fewer. It runs each choice a few times, then the faster one,
and now and then the other one again (every `explore_every`-th step of that
kind, more rarely the further behind it is), so it follows the load when it
changes. A step that prefills is never an experiment (trying the wrong
choice there costs a whole prefill: 8x512 at 32 concurrent lost 14 % of its
tokens/s to it in a short-lived service): it runs on the verdict of the
decode steps with the most rows that have one (a prefill's operators are
at least as large as theirs), else on every thread. It once followed the
decode steps with as many running rows, else the latest verdict of any
kind: a burst's second prefill (30 prompts joining 1-3 running rows, whose
decode steps never run alone) then ran on one thread whenever the last
verdict had been one thread for 16-31 rows (measured while the workers
preprocessed the next burst), ~0.5 s more on that step, 8x512 at 32
concurrent 370-390 tokens/s instead of 450-500 (bench/RESULTS.md). A step
with no running rows and no prefill runs no forward (a heartbeat, a step
that only drops): it is not timed, and gives no verdict (its times are
noise, ~0.0 ms on either choice, yet its verdict set the thread count of
the first prefill after an idle spell).

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
# Weight of the newest time in a choice's average.
ALPHA = 0.3
# A kind's change of verdict is logged at INFO at most this often (near a
# tie the verdict can flip every few steps: 1-row 8x512 decode steps at
# ~18 ms on either choice flipped ~10 times a second); the rest at DEBUG.
LOG_EVERY_S = 60.0


class StepKind(NamedTuple):
    """Steps alike enough to compare: running rows (bucket k holds 2**(k-1)
    to 2**k - 1 rows; 0 none), and whether the step prefills anything."""

    rows: int
    prefill: bool

    @classmethod
    def of(cls, rows: int, *, prefill: bool) -> StepKind:
        return cls(rows.bit_length(), prefill)

    def __str__(self) -> str:
        rows = "no running rows" if self.rows == 0 else f"{1 << (self.rows - 1)}-{(1 << self.rows) - 1} running rows"
        return f"steps with {rows}{' and a prefill' if self.prefill else ''}"


# A step with nothing to run: no running rows, no prefill.
IDLE = StepKind(0, False)


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self._clock = clock
        self.choices = (threads, threads - 1) if threads > 1 else (threads,)
        self.explore_every = explore_every
        self.warmup = warmup
        self._seen: dict[StepKind, _Seen] = {}

    @property
    def tuning(self) -> bool:
        return len(self.choices) > 1

    def choose(self, kind: StepKind) -> int:
        """The thread count for the next step of this kind."""
        if not self.tuning or kind == IDLE:
            return self.threads
        if kind.prefill:
            return self._heaviest_verdict()
        seen = self._seen.setdefault(kind, _Seen())
        seen.steps += 1
        untried = [c for c in self.choices if seen.runs.get(c, 0) < self.warmup]
        if untried:
            # Alternate while warming up: the choices see the same stretch of load.
            return min(untried, key=lambda c: seen.runs.get(c, 0))
        best, other = sorted(self.choices, key=lambda c: seen.seconds[c])
        behind = seen.seconds[other] / max(seen.seconds[best], 1e-9) - 1
        every = self.explore_every * max(1, int(behind / EXPLORE_COST))
        return other if seen.steps % every == 0 else best

    def _heaviest_verdict(self) -> int:
        """The thread count of the decode steps with the most rows that have
        a verdict; every thread before any has one."""
        judged = [(kind.rows, seen.best) for kind, seen in self._seen.items() if seen.best is not None]
        return max(judged)[1] if judged else self.threads

    def record(self, kind: StepKind, threads: int, seconds: float) -> None:
        if not self.tuning or kind.prefill or kind == IDLE:
            return
        seen = self._seen.setdefault(kind, _Seen())
        seen.runs[threads] = seen.runs.get(threads, 0) + 1
        last = seen.seconds.get(threads)
        seen.seconds[threads] = seconds if last is None else last + ALPHA * (seconds - last)
        if any(seen.runs.get(c, 0) < self.warmup for c in self.choices):
            return
        best = min(self.choices, key=lambda c: seen.seconds[c])
        if best != seen.best:
            seen.best = best
            self._log_verdict(kind, seen)

    def _log_verdict(self, kind: StepKind, seen: _Seen) -> None:
        now = self._clock()
        ago = None if seen.logged_at is None else now - seen.logged_at
        times = ", ".join(f"{seen.seconds[c] * 1e3:.1f} ms on {c}" for c in self.choices)
        threads = f"{seen.best} thread{'' if seen.best == 1 else 's'}"
        if ago is not None and ago < LOG_EVERY_S:
            seen.unlogged += 1
            log.debug("%s now run on %s (lately %s)", kind, threads, times)
            return
        since = f"; {seen.unlogged} more changes in the {ago:.0f}s before" if ago is not None and seen.unlogged else ""
        log.info("%s now run on %s (lately %s%s)", kind, threads, times, since)
        seen.logged_at, seen.unlogged = now, 0

    @contextmanager
    def run(self, kind: StepKind) -> Iterator[int]:
        """Run the block (one step of this kind) on the chosen thread count,
        time it, and set every thread back afterwards."""
        chosen = self.choose(kind)
        if chosen != self.threads:
            torch.set_num_threads(chosen)
        try:
            start = time.perf_counter()
            yield chosen
            self.record(kind, chosen, time.perf_counter() - start)
        finally:
            if chosen != self.threads:
                torch.set_num_threads(self.threads)

    def summary(self) -> dict[StepKind, dict[int, float]]:
        """Average step time (seconds) by kind of decode step and thread count."""
        return {kind: dict(seen.seconds) for kind, seen in sorted(self._seen.items())}
