"""Rank 0's step loop against a fake engine: admission waits for room
(rows, prefill tokens, the KV budget) instead of failing, a full queue is
OVERLOADED, a request failed on rank 0 is dropped everywhere next step, and a
failing step types every request it holds — the ones joining it too."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mmsplit.errors import E
from scheduler_svc.errors import MmsplitError, Overloaded
from scheduler_svc.loop import Admission, Event, Failed, Finished, StepLoop, Token
from scheduler_svc.plan import Failure, Plan, StepOutcome
from scheduler_svc.settings import SchedulerSettings
from tests.support.engine_kit import SoloGroup, request
from tests.support.leaks import wait_until

EOS = 2
SETTINGS = SchedulerSettings(model_dir=Path("unused"), heartbeat_s=0.05, batch_window_s=0.0, janitor_interval_s=1e9)


class FakeEngine:
    """Holds rows like the real engine; every row samples token 7. Request
    ids choose trouble: "bad" fails the agreement, "reject" fails on rank 0,
    "oom" ends at its first decode (a decode forward that raised), and a
    step that a "doomed" request joins raises (a broken collective)."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.rows: set[str] = set()
        self.plans: list[Plan] = []
        self.widest = 0
        # Set: from the second step on, each step waits for it (a test that
        # must act while a request is still running, however slow its thread).
        self.hold = hold

    def step(self, plan: Plan) -> StepOutcome:
        if self.hold is not None and self.plans:
            assert self.hold.wait(10), "the test never let the engine go on"
        self.plans.append(plan)
        if any("doomed" in r.request_id for r in plan.new):
            raise RuntimeError("a collective broke")
        self.rows.difference_update(plan.drop)
        assert {rid for rid, _ in plan.feed} == self.rows, "every running row is fed, nothing else"
        failed = {r.request_id: Failure(E.ERROR_CODE_INVALID_REQUEST, (0,)) for r in plan.new if "bad" in r.request_id}
        self.rows.update(r.request_id for r in plan.new if r.request_id not in failed)
        self.widest = max(self.widest, len(self.rows))
        rejected = {rid: "non-finite logits" for rid in self.rows if "reject" in rid}
        fed = {rid for rid, _ in plan.feed}
        oom = Failure(E.ERROR_CODE_OVERLOADED, (0,), {0: "the server ran out of memory in a decode step; retry"})
        ended = {rid: oom for rid in fed if "oom" in rid}
        sampled = {rid: 7 for rid in self.rows if rid not in rejected and rid not in ended}
        return StepOutcome(
            sampled=sampled, failed=failed, active_per_rank=[len(self.rows)], rejected=rejected, ended=ended
        )


class Harness:
    def __init__(self, engine: FakeEngine, *, budget: int = 10**6, **settings: object) -> None:
        self.events: dict[str, list[Event]] = {}
        self.fatal: list[BaseException] = []
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.loop = StepLoop(
            engine,  # type: ignore[arg-type]
            SoloGroup(),
            replace(SETTINGS, **settings),  # type: ignore[arg-type]
            eos_token_ids=frozenset([EOS]),
            max_context=1024,
            kv_budget_tokens=budget,
            post=lambda fn: fn(),
            on_fatal=self.fatal.append,
        )
        self.thread = threading.Thread(target=self.loop.run, daemon=True)

    def submit(self, rid: str, prompt: int = 10, max_tokens: int = 4) -> None:
        req = request(rid, [5] * prompt, max_tokens=max_tokens)

        def emit(event: Event, rid: str = rid) -> None:
            with self.done:
                self.events.setdefault(rid, []).append(event)
                self.done.notify_all()

        self.loop.submit(Admission(req, emit, reserve=min(prompt + max_tokens, 1024)))

    def wait_ended(self, rids: list[str], timeout: float = 10.0) -> None:
        def ended() -> bool:
            return all(any(isinstance(e, Finished | Failed) for e in self.events.get(r, [])) for r in rids)

        with self.done:
            assert self.done.wait_for(ended, timeout), f"not ended: {[r for r in rids if r not in self.events]}"

    def stop(self) -> None:
        self.loop.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


def ends(h: Harness, rid: str) -> Event:
    return h.events[rid][-1]


def test_requests_beyond_the_kv_budget_wait_and_all_finish() -> None:
    engine = FakeEngine()
    h = Harness(engine, budget=300)  # each request reserves 10 + 90 = 100 tokens
    for i in range(7):
        h.submit(f"r{i}", max_tokens=90)
    h.thread.start()
    h.wait_ended([f"r{i}" for i in range(7)], timeout=30)
    h.stop()
    for i in range(7):
        assert ends(h, f"r{i}") == Finished(reason=1, prompt_tokens=10, completion_tokens=90)
        assert [e for e in h.events[f"r{i}"] if isinstance(e, Token)] == [Token(7)] * 90
    assert engine.widest == 3, "the budget allows exactly three rows of 100"


def test_the_rows_and_the_prefill_tokens_of_a_step_bound_admission() -> None:
    engine = FakeEngine()
    h = Harness(engine, max_running=4, max_prefill_tokens=50)
    for i in range(9):
        h.submit(f"r{i}", prompt=20, max_tokens=3)
    h.thread.start()
    h.wait_ended([f"r{i}" for i in range(9)])
    h.stop()
    assert max(len(p.new) for p in engine.plans) == 2  # 3 x 20 tokens would pass the 50 per step
    assert engine.widest == 4
    assert all(isinstance(ends(h, f"r{i}"), Finished) for i in range(9))


def test_one_prompt_longer_than_the_prefill_budget_still_runs_alone() -> None:
    engine = FakeEngine()
    h = Harness(engine, max_prefill_tokens=50)
    h.submit("long", prompt=200, max_tokens=2)
    h.submit("short", prompt=10, max_tokens=2)
    h.thread.start()
    h.wait_ended(["long", "short"])
    h.stop()
    assert [p.new[0].request_id for p in engine.plans if p.new] == ["long", "short"]


def test_a_full_queue_is_overloaded_at_once() -> None:
    h = Harness(FakeEngine(), max_queue=3)
    for i in range(3):
        h.submit(f"q{i}")
    with pytest.raises(Overloaded, match="queue is full"):
        h.submit("one-too-many")
    h.thread.start()
    h.wait_ended([f"q{i}" for i in range(3)])
    h.stop()


def failed_beside_a_fine_one(rid: str) -> tuple[FakeEngine, Harness, Failed]:
    """`rid` and a request that finishes, run together to their ends:
    `rid`'s last event, a Failed, with the engine and harness to look at."""
    engine = FakeEngine()
    h = Harness(engine)
    h.submit(rid, max_tokens=5)
    h.submit("fine", max_tokens=5)
    h.thread.start()
    h.wait_ended([rid, "fine"])
    h.stop()
    assert isinstance(ends(h, "fine"), Finished)
    failed = ends(h, rid)
    assert isinstance(failed, Failed)
    return engine, h, failed


def test_a_request_failed_on_rank_0_is_typed_and_dropped_next_step() -> None:
    engine, _, failed = failed_beside_a_fine_one("reject-me")
    assert failed.error.error_code == E.ERROR_CODE_INTERNAL
    assert "non-finite" in failed.error.message
    joined = next(i for i, p in enumerate(engine.plans) if p.new)
    assert "reject-me" in engine.plans[joined + 1].drop


def test_a_request_ended_by_a_failed_decode_is_typed_and_dropped_next_step() -> None:
    engine, h, failed = failed_beside_a_fine_one("oom-1")
    assert not h.fatal, "the group goes on"
    assert failed.error.error_code == E.ERROR_CODE_OVERLOADED
    assert "out of memory in a decode step" in failed.error.message
    assert [type(e).__name__ for e in h.events["oom-1"]] == ["Token", "Failed"], "its prefill token, then the end"
    ended_at = next(i for i, p in enumerate(engine.plans) if any(rid == "oom-1" for rid, _ in p.feed))
    assert "oom-1" in engine.plans[ended_at + 1].drop


def test_a_failing_step_types_every_request_including_those_joining_it() -> None:
    # "early" is still running when "doomed" comes: the engine holds its
    # second step until then (on a busy host the loop once ran all of
    # early's 500 steps before this thread submitted "doomed").
    going = threading.Event()
    engine = FakeEngine(hold=going)
    h = Harness(engine)
    h.submit("early", max_tokens=500)
    h.thread.start()
    with h.done:
        assert h.done.wait_for(lambda: len(h.events.get("early", [])) >= 1, 10)
    h.submit("doomed", max_tokens=50)
    going.set()
    h.wait_ended(["early", "doomed"])
    h.thread.join(10)
    assert len(h.fatal) == 1
    assert [r.request_id for r in engine.plans[-1].new] == ["doomed"], "it joined the step that failed"
    for rid in ("early", "doomed"):
        failed = ends(h, rid)
        assert isinstance(failed, Failed)
        assert isinstance(failed.error, MmsplitError)
        assert failed.error.error_code == E.ERROR_CODE_SCHEDULER_UNAVAILABLE


def test_an_idle_loop_told_to_drain_is_idle_at_once_not_at_its_next_heartbeat() -> None:
    """A stop (SIGTERM) waits for `idle` before it stops the ranks; an idle
    loop waits up to a heartbeat for work, so `begin_drain` wakes it."""
    engine = FakeEngine()
    h = Harness(engine, heartbeat_s=30.0)
    h.thread.start()
    h.submit("r0", max_tokens=2)
    h.wait_ended(["r0"])
    steps = len(engine.plans)
    started = time.monotonic()
    h.loop.begin_drain()
    assert h.loop.idle.wait(5), "idle was not set"
    assert time.monotonic() - started < 1
    assert len(engine.plans) <= steps + 2  # a step or two (r0's row dropped, the drain seen), no more
    h.stop()


def test_a_janitor_sweep_that_fails_is_logged_and_the_loop_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep runs on the step loop's thread, where an exception takes
    the group down: one that fails (out of descriptors, say) is logged and
    tried again next interval, and requests are served meanwhile."""
    sweeps: list[str] = []

    def failing_sweep(prefix: str, **_: object) -> list[str]:
        sweeps.append(prefix)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr("scheduler_svc.loop.files.sweep", failing_sweep)
    h = Harness(FakeEngine(), janitor_interval_s=0.01)
    h.thread.start()
    assert wait_until(lambda: len(sweeps) >= 1, timeout=5)
    for i in range(3):
        h.submit(f"r{i}", max_tokens=20)
    h.wait_ended([f"r{i}" for i in range(3)])
    assert all(isinstance(ends(h, f"r{i}"), Finished) for i in range(3))
    assert wait_until(lambda: len(sweeps) >= 3, timeout=5), "not tried again after it failed"
    h.stop()
    assert not h.fatal
    assert "the janitor's sweep failed" in caplog.text
