"""The step's thread count on CPU: all of a rank's threads or one fewer,
whichever has been faster lately for steps of that kind, the other
re-measured now and then; and an engine that switches between them makes
the tokens of plain greedy decoding."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from scheduler_svc.engine import Engine
from scheduler_svc.plan import NewRequest
from scheduler_svc.threads import StepKind, StepThreads
from tests.support.engine_kit import InlineReader, SoloGroup, drive, image_prompt, pixels, reference, request

DECODE_32 = StepKind.of(32, prefill=False)


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


def test_decode_kinds_are_tuned_apart_and_a_prefill_step_follows_the_heaviest_verdict() -> None:
    """A prefill step runs on the verdict of the decode steps with the most
    rows that have one, whatever its own running rows: a burst's 30 prompts
    joining 2 running rows is no 2-row step (it once followed the latest
    verdict of any kind, and ran on one thread after a contended 16-31-row
    verdict)."""
    tuner = StepThreads(2, explore_every=1000, warmup=1)
    decode_4, decode_16 = StepKind.of(5, prefill=False), StepKind.of(20, prefill=False)
    prefill_32, prefill_4, prefill_2 = (StepKind.of(n, prefill=True) for n in (32, 5, 2))
    assert tuner.choose(prefill_32) == 2, "no verdict yet: every thread"
    feed(tuner, decode_4, {2: 0.004, 1: 0.002}, 10)
    assert tuner.choose(prefill_32) == 1, "the one verdict there is"
    feed(tuner, DECODE_32, {2: 0.005, 1: 0.010}, 10)
    feed(tuner, decode_16, {2: 0.050, 1: 0.008}, 10)  # measured while something else took a core
    assert (tuner.choose(DECODE_32), tuner.choose(decode_16), tuner.choose(decode_4)) == (2, 1, 1)
    assert [tuner.choose(k) for k in (prefill_32, prefill_4, prefill_2)] == [2, 2, 2], "32-63 rows' verdict"
    feed(tuner, DECODE_32, {2: 0.020, 1: 0.010}, 10)
    assert tuner.choose(prefill_2) == 1, "it follows that verdict as it changes"
    # A prefill step is never an experiment, and its time teaches nothing.
    assert [tuner.choose(prefill_32) for _ in range(50)] == [1] * 50
    tuner.record(prefill_32, 2, 0.001)
    assert set(tuner.summary()) == {DECODE_32, decode_16, decode_4}
    assert str(prefill_4) == "steps with 4-7 running rows and a prefill"
    assert str(StepKind.of(0, prefill=False)) == "steps with no running rows"


def test_a_step_with_nothing_to_run_gives_no_verdict_for_the_prefill_after_it() -> None:
    """Heartbeats (no rows, no prefill) take no time on either choice: were
    they a kind of their own, noise would pick a thread count for the first
    prefill after an idle spell."""
    tuner = StepThreads(2, explore_every=1000, warmup=1)
    idle, first_prefill = StepKind.of(0, prefill=False), StepKind.of(0, prefill=True)
    assert feed(tuner, idle, {2: 0.00002, 1: 0.00001}, 10) == [2] * 10
    assert tuner.summary() == {}
    assert tuner.choose(first_prefill) == 2, "no verdict: every thread"
    feed(tuner, DECODE_32, {2: 0.010, 1: 0.005}, 10)
    assert tuner.choose(first_prefill) == 1, "the verdict of steps that ran a forward"


def test_the_step_runs_on_its_choice_and_every_thread_comes_back_even_when_it_raises() -> None:
    before = torch.get_num_threads()
    tuner = StepThreads(before + 1, explore_every=1000, warmup=1)
    seen = []
    try:
        torch.set_num_threads(tuner.threads)
        for _ in range(2):
            with tuner.run(DECODE_32) as chosen:
                seen.append((chosen, torch.get_num_threads()))
            assert torch.get_num_threads() == tuner.threads
        assert sorted(seen) == [(before, before), (before + 1, before + 1)]
        with pytest.raises(RuntimeError), tuner.run(DECODE_32) as chosen:
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
