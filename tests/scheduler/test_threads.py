"""The step's thread count on CPU: all of a rank's threads or one fewer,
whichever has been faster lately for steps of that kind, the other
re-measured now and then; and an engine that switches between them makes
the tokens of plain greedy decoding."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from scheduler_svc.engine import Engine
from scheduler_svc.plan import NewRequest, Plan
from scheduler_svc.threads import IDLE, StepKind, StepThreads
from tests.support.engine_kit import InlineReader, SoloGroup, drive, image_prompt, pixels, reference, request

DECODE_32 = StepKind.of(32)


def feed(tuner: StepThreads, kind: StepKind, seconds: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps of `kind`, each taking `seconds[threads]`; the choices made."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(kind)
        tuner.record(kind, threads, seconds[threads])
        chosen.append(threads)
    return chosen


def test_one_thread_leaves_nothing_to_choose() -> None:
    tuner = StepThreads(1)
    assert not tuner.tuning
    assert feed(tuner, DECODE_32, {1: 0.01}, 5) == [1] * 5
    assert tuner.summary() == {}


def test_each_choice_is_measured_then_the_faster_runs_and_the_other_is_remeasured() -> None:
    tuner = StepThreads(4, explore_every=8, warmup=2)
    assert tuner.choices == (4, 3)
    chosen = feed(tuner, DECODE_32, {4: 0.0060, 3: 0.0056}, 40)
    assert sorted(chosen[:4]) == [3, 3, 4, 4], "both choices are measured first, in turn"
    rest = chosen[4:]
    # 7 % behind: a near tie, re-measured every 8 steps (steps 8, 16, ..., 40).
    assert rest.count(4) == len([s for s in range(5, 41) if s % 8 == 0])
    assert set(rest) == {3, 4}
    assert tuner.summary()[DECODE_32] == pytest.approx({4: 0.0060, 3: 0.0056})


def test_a_choice_far_behind_is_remeasured_more_rarely() -> None:
    """Twice as slow: re-run every ~80 steps, not every 8, so re-measuring
    it costs about as much as re-measuring a near tie."""
    tuner = StepThreads(2, explore_every=8, warmup=1)
    rest = feed(tuner, DECODE_32, {2: 0.010, 1: 0.005}, 200)[2:]
    assert rest.count(2) == 2, rest


def test_it_follows_the_load_when_the_other_choice_becomes_faster(caplog: pytest.LogCaptureFixture) -> None:
    tuner = StepThreads(2, explore_every=4, warmup=2)
    with caplog.at_level(logging.DEBUG, logger="scheduler_svc.threads"):
        feed(tuner, DECODE_32, {2: 0.004, 1: 0.008}, 12)
        # The tokenizer gets busy: two threads now lose to one, by a little.
        later = feed(tuner, DECODE_32, {2: 0.0090, 1: 0.0085}, 40)
    # One thread from then on, but for the re-measure of two every 4th step (a near tie).
    assert later[-8:] == [1, 1, 1, 2, 1, 1, 1, 2], later
    switches = [r.getMessage() for r in caplog.records]
    assert switches[0].startswith("steps with 32-63 running rows now run on 2 threads")
    assert switches[-1].startswith("steps with 32-63 running rows now run on 1 thread ")


def test_a_verdict_that_flips_near_a_tie_is_logged_at_info_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """Near a tie the verdict may flip every few steps: one INFO line per
    kind per LOG_EVERY_S, saying how many changes it left out; the rest at
    DEBUG."""
    now = [0.0]
    tuner = StepThreads(2, explore_every=2, warmup=1, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="scheduler_svc.threads"):
        for second in range(150):
            now[0] = float(second)
            # Each choice in turn is the faster by a little: the verdict flips.
            feed(tuner, DECODE_32, {2: 0.010, 1: 0.012} if second % 2 else {2: 0.012, 1: 0.010}, 4)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(info) == 3, info  # at 0 s, 60 s and 120 s
    assert "more changes in the 60s before" in info[1], info[1]
    assert len(debug) > 50, "every other change is still there at DEBUG"


def test_prefills_are_tuned_by_their_prompt_tokens_apart_from_decode_steps() -> None:
    """A prefill meets another load than a decode step (nothing streams for
    the rows it joins): once it ran on the verdict of the decode steps with
    the most rows, and an 8-row one-thread verdict put a 28-prompt 8x512
    prefill on one thread, 1.31 s against ~0.8 on two. Now each size of
    prefill (prompt tokens by powers of two) is timed per token on its own:
    every thread first (a wrong choice costs a whole prefill), one fewer
    once, then the faster, whatever the decode steps say."""
    tuner = StepThreads(2, explore_every=1000, warmup=1, prefill_first=2)
    feed(tuner, DECODE_32, {2: 0.050, 1: 0.040}, 10)  # decode steps: one thread
    big, small = StepKind.of(3, prefill=2230), StepKind.of(0, prefill=160)
    assert big == StepKind.of(30, prefill=3000), "a prefill's kind is its tokens, not its running rows"
    # Per token: 0.36 ms on two threads, 0.56 on one.
    chosen = []
    for _ in range(8):
        threads = tuner.choose(big)
        tuner.record(big, threads, {2: 0.80, 1: 1.25}[threads] / 2230)
        chosen.append(threads)
    assert chosen == [2, 2, 1, 2, 2, 2, 2, 2], chosen
    assert tuner.choose(DECODE_32) == 1, "the decode steps keep their own verdict"
    # A small prefill while the workers take a core: one thread wins there.
    chosen = feed(tuner, small, {2: 0.30 / 160, 1: 0.12 / 160}, 6)
    assert chosen == [2, 2, 1, 1, 1, 1], chosen
    assert tuner.summary()[big] == pytest.approx({2: 0.80 / 2230, 1: 1.25 / 2230})
    assert str(big) == "prefills of 2048-4095 prompt tokens"
    assert str(StepKind.of(5, prefill=0)) == "steps with 4-7 running rows"
    assert str(StepKind.of(0)) == "steps with no running rows"


def test_a_prefill_is_timed_per_token(caplog: pytest.LogCaptureFixture) -> None:
    """Prefills of one kind differ in size by up to twice: each is timed per
    prompt token, and the verdict says so."""
    tuner = StepThreads(2, explore_every=1000, warmup=1, prefill_first=1)
    kind = StepKind.of(0, prefill=1500)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="scheduler_svc.threads"):
            for tokens, threads, seconds in ((1100, 2, 0.44), (2000, 1, 0.60)):
                clock = mock.patch.object(time, "perf_counter", side_effect=[0.0, seconds])
                with clock, tuner.run(kind, tokens=tokens) as step:
                    assert step.threads == threads
    finally:
        torch.set_num_threads(before)
    # 0.40 ms a token on two threads against 0.30 on one: one wins, though
    # its prefill took longer.
    assert tuner.summary()[kind] == pytest.approx({2: 0.0004, 1: 0.0003})
    assert tuner.choose(kind) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "prefills of 1024-2047 prompt tokens now run on 1 thread (lately 400 µs a token on 2, 300 µs a token on 1)"
    ]


def test_a_step_with_no_forward_runs_on_one_thread_fewer_and_gives_no_verdict() -> None:
    """Heartbeats (no rows, no prefill) take no time on either choice: were
    they a kind of their own, noise would pick a thread count. A step that
    only ends rows copies their prefixes, thousands of small copies while
    the event loop streams their last tokens: one thread fewer (in service
    ~30 ms against 160-520 on every thread)."""
    tuner = StepThreads(2, explore_every=1000, warmup=1)
    assert StepKind.of(0, prefill=0) == IDLE
    assert feed(tuner, IDLE, {2: 0.3, 1: 0.03}, 10) == [1] * 10
    assert tuner.summary() == {}
    assert StepThreads(1).choose(IDLE) == 1, "nothing to choose on one thread"


def test_the_step_runs_on_its_choice_and_every_thread_comes_back_even_when_it_raises() -> None:
    before = torch.get_num_threads()
    tuner = StepThreads(before + 1, explore_every=1000, warmup=1)
    seen = []
    try:
        torch.set_num_threads(tuner.threads)
        for _ in range(2):
            with tuner.run(DECODE_32) as step:
                seen.append((step.threads, torch.get_num_threads()))
            assert torch.get_num_threads() == tuner.threads
        assert sorted(seen) == [(before, before), (before + 1, before + 1)]
        with pytest.raises(RuntimeError), tuner.run(DECODE_32):
            raise RuntimeError("the forward failed")
        assert torch.get_num_threads() == tuner.threads
    finally:
        torch.set_num_threads(before)
    assert sum(tuner._seen[DECODE_32].runs.values()) == 2, "a step that raised is not timed"


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()


def test_an_engine_switching_thread_counts_makes_greedy_decodings_tokens(model: torch.nn.Module) -> None:
    """Every other step on two threads, the rest on one (the test's
    processes run on one): continuous batching with images still equals
    plain greedy decoding, and the thread count is back afterwards."""
    before = torch.get_num_threads()
    tuner = StepThreads(2, explore_every=2, warmup=1)
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset([eos]),
                    token_chunk=32, threads=tuner)  # fmt: skip
    rng = random.Random(11)
    arrivals: dict[int, list[NewRequest]] = {}
    requests = []
    for i in range(8):
        ids = image_prompt(model, i % 2, [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 20))])
        req = request(f"t{i}", ids, [pixels(40 + i)] * (i % 2), max_tokens=rng.randrange(4, 12))
        requests.append(req)
        arrivals.setdefault(rng.randrange(0, 6), []).append(req)
    try:
        torch.set_num_threads(2)
        results = drive(engine, arrivals, eos)
    finally:
        torch.set_num_threads(before)
    assert results == {req.request_id: reference(model, req) for req in requests}
    decode_steps = {kind: seen for kind, seen in tuner.summary().items() if not kind.prefill and kind.rows}
    assert any(set(seen) == {1, 2} for seen in decode_steps.values()), tuner.summary()


class _Seeing(StepThreads):
    """A tuner that remembers every step it timed, by kind."""

    def __init__(self) -> None:
        super().__init__(2, explore_every=1000, warmup=1)
        self.timed: list[StepKind] = []
        self.chosen_for: list[StepKind] = []

    def record(self, kind: StepKind, threads: int, seconds: float) -> None:
        self.timed.append(kind)
        super().record(kind, threads, seconds)

    def choose(self, kind: StepKind) -> int:
        self.chosen_for.append(kind)
        return super().choose(kind)


def test_a_step_is_timed_by_the_rows_its_forward_runs_not_those_it_drops(model: torch.nn.Module) -> None:
    """The rows a plan drops leave before the forward. A step that only
    ends rows (their prefixes kept: copies, no forward) once counted as a
    decode step of all of them: its copies (160-520 ms on two contended
    cores against ~30 on one, in service) were taken for that kind's
    decode time."""
    before = torch.get_num_threads()
    tuner = _Seeing()
    engine = Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset(),
                    threads=tuner)  # fmt: skip
    prompts = [request(f"d{i}", [1, 10 + i, 20, 30], max_tokens=8) for i in range(5)]
    try:
        torch.set_num_threads(2)
        outcome = engine.step(Plan(step=1, new=tuple(prompts)))
        outcome = engine.step(Plan(step=2, feed=tuple(outcome.sampled.items())))
        # Three of five leave (kept by the prefix cache); two decode on.
        leaving = ("d0", "d1", "d2")
        feed = tuple((rid, t) for rid, t in outcome.sampled.items() if rid not in leaving)
        engine.step(Plan(step=3, drop=leaving, keep=leaving, feed=feed))
        engine.step(Plan(step=4, drop=("d3", "d4"), keep=("d3", "d4")))
    finally:
        torch.set_num_threads(before)
    decode_5, decode_2, prefill_20 = StepKind.of(5), StepKind.of(2), StepKind.of(0, prefill=20)
    # Step 4 runs no forward: no verdict from it.
    assert tuner.timed == [prefill_20, decode_5, decode_2, IDLE], tuner.timed
    assert set(tuner.summary()) == {prefill_20, decode_5, decode_2}


def test_a_prefill_is_sized_by_the_tokens_it_prefills(model: torch.nn.Module) -> None:
    """A prefill's kind and per-token time count each prompt once (twins
    are prefilled once) and one chunk of the first long prompt, joining or
    under way."""
    engine = Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset(),
                    prefill_chunk=16)  # fmt: skip
    twins = [request(f"t{i}", [1, *range(100, 109)], max_tokens=4) for i in range(3)]  # 10 tokens, 3 times
    long = request("long", [1, *range(200, 239)], max_tokens=4)  # 40 tokens: chunks of 16, 16, 8
    plan = Plan(step=0, new=(*twins, long))
    assert engine._prefill_tokens(plan.new) == 10 + 16
    out = engine.step(plan)
    assert engine._prefill_tokens(Plan(step=1, feed=tuple(out.sampled.items())).new) == 16


def test_a_prefill_taken_mostly_from_the_prefix_cache_is_chosen_and_timed_by_the_tokens_it_ran(
    model: torch.nn.Module,
) -> None:
    """A step's thread count is first chosen by its prompts' whole length,
    then again, before its forward, by the tokens left past their cached
    prefixes; its time is recorded under the tokens the forward ran. Timed
    as whole prompts, a chat's cached later turns (45-85 µs a token at
    8x512) shared a kind's average with uncached prefills of that size
    (370-690), and which thread count won was a matter of which one the
    cached turns fell to; chosen as whole prompts, they ran on those
    prefills' verdict."""
    before = torch.get_num_threads()
    tuner = _Seeing()
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset([eos]),
                    prefix_cache_bytes=64 << 20, threads=tuner)  # fmt: skip
    first = request("first", [1, *range(300, 450)], max_tokens=1)  # 151 tokens
    again = request("again", [*first.input_ids, *range(500, 512)], max_tokens=1)  # 163: the first's, then 12 more
    cached: dict[str, int] = {}
    try:
        torch.set_num_threads(2)
        drive(engine, {0: [first]}, eos, cached)
        start, first_choice = len(tuner.timed), len(tuner.chosen_for)
        whole = StepKind.of(0, prefill=163)  # the first prompt's kind too (151 tokens: 128-255)
        steps = tuner._seen[whole].steps
        drive(engine, {0: [again]}, eos, cached)
    finally:
        torch.set_num_threads(before)
    assert cached == {"first": 0, "again": 151}, "the whole first prompt from the store"
    assert StepKind.of(0, prefill=163) != StepKind.of(0, prefill=12)
    assert tuner.timed[start] == StepKind.of(0, prefill=12), tuner.timed
    # Chosen for the whole prompt as it started, then for what it prefilled; the first taken back.
    assert tuner.chosen_for[first_choice : first_choice + 2] == [whole, StepKind.of(0, prefill=12)]
    assert tuner._seen[whole].steps == steps, "the first choice is taken back"
    assert tuner.timed[0] == StepKind.of(0, prefill=151)
