"""Rank 0's step loop against a fake engine: admission waits for room
(rows, prefill tokens, the KV budget) instead of failing, a full queue is
OVERLOADED, a request failed on rank 0 is dropped everywhere next step, and a
failing step types every request it holds — the ones joining it too."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mmsplit.errors import E
from mmsplit_server.sampling import Sampling
from scheduler_svc.errors import MmsplitError, Overloaded
from scheduler_svc.loop import Admission, Event, Failed, Finished, IdleHeap, StepCosts, StepLoop, Token, run_follower
from scheduler_svc.plan import Failure, Item, Plan, StepOutcome
from scheduler_svc.prefix_cache import BLOCK_TOKENS, PrefixCache, leading_text_keys
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

    def __init__(self, hold: threading.Event | None = None, *, prefix_cache_bytes: int = 0) -> None:
        self.rows: set[str] = set()
        self.plans: list[Plan] = []
        self.widest = 0
        # Set: from the second step on, each step waits for it (a test that
        # must act while a request is still running, however slow its thread).
        self.hold = hold
        # Rank 0's store as the loop sees it (this fake never fills it itself).
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.prefilling = False  # no prompt comes in chunks here (the loop asks)
        self.share_prefills = True  # identical prompts are prefilled once (the planner's twins)
        self.keys_items = True  # and with media too (a cache digests the items)
        # A "chunked" request makes its first token only in its third step.
        self.steps_in: dict[str, int] = {}
        self.sampled: set[str] = set()  # rows that made a token

    def step(self, plan: Plan) -> StepOutcome:
        if self.hold is not None and self.plans:
            assert self.hold.wait(10), "the test never let the engine go on"
        self.plans.append(plan)
        if any("doomed" in r.request_id for r in plan.new):
            raise RuntimeError("a collective broke")
        self.rows.difference_update(plan.drop)
        assert {rid for rid, _ in plan.feed} == self.rows & self.sampled, "every running row is fed, nothing else"
        failed = {r.request_id: Failure(E.ERROR_CODE_INVALID_REQUEST, (0,)) for r in plan.new if "bad" in r.request_id}
        self.rows.update(r.request_id for r in plan.new if r.request_id not in failed)
        self.widest = max(self.widest, len(self.rows))
        rejected = {rid: "non-finite logits" for rid in self.rows if "reject" in rid}
        fed = {rid for rid, _ in plan.feed}
        oom = Failure(E.ERROR_CODE_OVERLOADED, (0,), {0: "the server ran out of memory in a decode step; retry"})
        ended = {rid: oom for rid in fed if "oom" in rid}
        for rid in self.rows:
            self.steps_in[rid] = self.steps_in.get(rid, 0) + 1
        prefilling = {rid for rid in self.rows if "chunked" in rid and self.steps_in[rid] < 3}
        sampled = {rid: 7 for rid in self.rows if rid not in rejected and rid not in ended and rid not in prefilling}
        self.sampled.update(sampled)
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

    def submit(self, rid: str, prompt: int | list[int] = 10, max_tokens: int = 4, **fields: Any) -> None:
        """`prompt`: its length (of one token repeated), or its ids; `fields`
        replace the request's (items, cache_salt)."""
        ids = [5] * prompt if isinstance(prompt, int) else prompt
        req = replace(request(rid, ids, max_tokens=max_tokens), **fields)

        def emit(event: Event, rid: str = rid) -> None:
            with self.done:
                self.events.setdefault(rid, []).append(event)
                self.done.notify_all()

        self.loop.submit(Admission(req, emit, reserve=min(len(ids) + max_tokens, 1024)))

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
        h.submit(f"r{i}", [5] * 19 + [i], max_tokens=3)  # each its own prompt: identical ones share a prefill
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
    assert time.monotonic() - started < 5  # not the 30 s heartbeat (a margin for a busy host)
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


SYSTEM = list(range(100, 180))  # 80 tokens: 5 blocks of text that several prompts start with


def admitted(engine: FakeEngine) -> list[list[str]]:
    """The request ids each step admitted, steps that admitted none left out."""
    return [[r.request_id for r in plan.new] for plan in engine.plans if plan.new]


def test_requests_that_start_like_one_being_prefilled_wait_for_it() -> None:
    """Arriving together with one system prompt, only the first prefills it;
    the others wait a step (taking it from the prefix cache then), and a
    request that shares nothing is not held up by them."""
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    h = Harness(engine)
    h.submit("a", [*SYSTEM, 1, 2, 3])
    h.submit("b", [*SYSTEM, 4, 5])
    h.submit("other", list(range(300, 380)))
    h.submit("c", [*SYSTEM, 6])
    h.thread.start()
    h.wait_ended(["a", "b", "other", "c"])
    h.stop()
    assert admitted(engine) == [["a", "other"], ["b", "c"]]
    assert all(isinstance(ends(h, r), Finished) for r in "abc")
    assert h.loop.waited_for_prefix == 2


def test_a_request_waits_for_every_step_of_a_prefill_in_chunks() -> None:
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    h = Harness(engine)
    h.submit("chunked", [*SYSTEM, 1, 2, 3])
    h.submit("b", [*SYSTEM, 4, 5])
    h.thread.start()
    h.wait_ended(["chunked", "b"])
    h.stop()
    first_token = next(i for i, plan in enumerate(engine.plans) if ("chunked", 7) in plan.feed)
    joined = next(i for i, plan in enumerate(engine.plans) if any(r.request_id == "b" for r in plan.new))
    # "chunked" makes its first token in its third step (the plan after it
    # feeds that token); "b" waits those three and joins with that plan,
    # the step whose start keeps the blocks.
    assert (first_token, joined) == (3, 3)
    assert h.loop.waited_for_prefix == 3


@pytest.mark.parametrize(
    ("case", "fields"),
    [
        ("shared text under the threshold", {}),
        ("another cache_salt", {"cache_salt": "tenant-b"}),
        ("the setting at 0", {}),
        ("the prefix cache off", {}),
        ("the text already cached", {}),
        ("an image before the shared text", {}),
        ("a store too small to keep the shared text", {}),
    ],
)
def test_when_a_request_does_not_wait(case: str, fields: dict[str, Any]) -> None:
    engine = FakeEngine(prefix_cache_bytes=0 if case == "the prefix cache off" else 1 << 20)
    settings = {"wait_for_shared_prefix": 0} if case == "the setting at 0" else {}
    h = Harness(engine, **settings)  # type: ignore[arg-type]
    system = SYSTEM[:48] if case == "shared text under the threshold" else SYSTEM  # 3 blocks < 64 tokens
    if case == "a store too small to keep the shared text":  # 4 blocks of 64 bytes, the text 5
        engine.prefix_cache = PrefixCache(4 * 64)
        engine.prefix_cache.keep([b"other"], [torch.zeros(16)])
    if case == "the text already cached":
        keys = leading_text_keys([*system, 1], None)
        engine.prefix_cache.keep(keys, [torch.zeros(1, 2, 1, BLOCK_TOKENS, 1) for _ in keys])
    h.submit("a", [*system, 1, 2, 3])
    if case == "an image before the shared text":
        image = Item(0, (), {}, ((0, 4),))
        fields = {"items": (image,)}
    h.submit("b", [*system, 4, 5], **fields)
    h.thread.start()
    h.wait_ended(["a", "b"])
    h.stop()
    assert admitted(engine) == [["a", "b"]], case
    assert h.loop.waited_for_prefix == 0


def test_leading_text_keys_are_the_prompt_s_own_keys_up_to_its_first_item() -> None:
    from scheduler_svc.prefix_cache import Runs, chain

    ids = list(range(1000, 1100))
    runs = Runs((b"digest",), (((40, 20),),))
    assert leading_text_keys(ids, 40) == chain(ids, runs)[:2]  # blocks 0-1 end before the item at 40
    assert leading_text_keys(ids, None, "s") == chain(ids, Runs(), "s")[:6]  # 99 tokens: the last is left to prefill
    assert leading_text_keys(ids, 0) == []


def test_a_plan_looks_past_at_most_max_new_per_step_waiting_requests() -> None:
    """A long queue of requests waiting for one prefill is not scanned whole
    every step: after max_new_per_step of them the plan looks no further."""
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    h = Harness(engine, max_new_per_step=2)
    h.submit("a", [*SYSTEM, 1])
    for k in range(3):
        h.submit(f"w{k}", [*SYSTEM, 10 + k])
    h.submit("other", list(range(300, 380)))
    h.thread.start()
    h.wait_ended(["a", "w0", "w1", "w2", "other"])
    h.stop()
    assert admitted(engine)[0] == ["a"], "two waited, and the plan stopped there"
    assert sorted(r for step in admitted(engine) for r in step) == ["a", "other", "w0", "w1", "w2"]


def test_leading_counts_a_chain_s_present_keys_by_bisection() -> None:
    from scheduler_svc.loop import _leading

    keys = [bytes([i]) for i in range(20)]
    for n in range(21):
        present = set(keys[:n])
        assert _leading(keys, present.__contains__) == n
    assert _leading([], set().__contains__) == 0


@pytest.mark.parametrize(("per_token", "waits"), [(1e-3, True), (1e-6, False)])
def test_a_request_waits_only_where_computing_the_shared_text_costs_more_than_a_step(
    per_token: float, waits: bool
) -> None:
    """With step costs seen (a decode forward 10 ms): 80 shared tokens at
    1 ms each are worth a step's wait; at 1 us each they are computed again."""
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    h = Harness(engine)
    h.loop.costs = StepCosts(per_token=per_token, decode=0.01)
    h.submit("a", [*SYSTEM, 1, 2, 3])
    h.submit("b", [*SYSTEM, 4, 5])
    h.thread.start()
    h.wait_ended(["a", "b"])
    h.stop()
    assert admitted(engine) == ([["a"], ["b"]] if waits else [["a", "b"]])


def test_step_costs_follow_the_engine_s_phases() -> None:
    """Prompt tokens cost the prefill phase over the tokens computed (those
    taken from the prefix cache and those of failed joiners left out); a
    step that feeds running rows gives the decode forward's time; a step
    with a prompt coming in chunks gives no prompt cost."""
    from scheduler_svc.plan import NewRequest

    costs = StepCosts()
    new = tuple(NewRequest(rid, (1,) * 100, (), None) for rid in ("x", "y", "bad"))  # type: ignore[arg-type]
    failed = {"bad": Failure(E.ERROR_CODE_INVALID_REQUEST, (0,))}
    outcome = StepOutcome({}, failed, [2], phases={"prefill": 0.15}, cached={"y": 50})
    costs.observe(Plan(step=1, new=new), outcome, chunking=False)
    assert (costs.per_token, costs.decode) == (0.15 / 150, None)
    costs.observe(Plan(step=2, feed=(("x", 7),)), StepOutcome({}, {}, [2], phases={"decode": 0.02}), chunking=False)
    assert costs.decode == 0.02
    costs.observe(Plan(step=3, new=new[:1]), StepOutcome({}, {}, [3], phases={"prefill": 9.0}), chunking=True)
    assert costs.per_token == 0.15 / 150, "a chunking step's prompt cost is not the prompt's"
    costs.observe(
        Plan(step=4, new=new[:1], feed=(("x", 7),)),
        StepOutcome({}, {}, [3], phases={"prefill": 0.3, "decode": 0.04}),
        chunking=False,
    )
    assert costs.per_token == pytest.approx(0.001 + 0.2 * (0.003 - 0.001))
    assert costs.decode == pytest.approx(0.02 + 0.2 * (0.04 - 0.02))


def test_requests_that_finish_at_their_first_token_do_not_serialize_a_burst() -> None:
    """A burst of one-token requests (a classifier's, say) with one long
    instruction: the first prefills it and leaves at once, its blocks kept
    as the next step starts; the others all join that step (each waiting
    for the one before would admit them one a step)."""
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    h = Harness(engine)
    for rid in ("a", "b", "c", "d"):
        h.submit(rid, [*SYSTEM, ord(rid)], max_tokens=1)
    h.thread.start()
    h.wait_ended(["a", "b", "c", "d"])
    h.stop()
    assert admitted(engine) == [["a"], ["b", "c", "d"]]


def test_under_the_priority_policy_lower_values_are_admitted_first_and_fcfs_within_one() -> None:
    """--scheduling-policy priority, one row at a time: while "first" runs,
    requests queue with priorities 5, 0, -3, 0, -3; they are admitted -3,
    -3, 0, 0, 5, each priority in arrival order; nobody is preempted."""
    hold = threading.Event()
    engine = FakeEngine(hold)
    h = Harness(engine, max_running=1, scheduling_policy="priority")
    h.submit("first", max_tokens=3)
    h.thread.start()
    assert wait_until(lambda: len(engine.plans) == 1, timeout=10)  # "first" joined; the next step waits for `hold`
    for rid, priority in (("p5", 5), ("p0a", 0), ("m3a", -3), ("p0b", 0), ("m3b", -3)):
        h.submit(rid, max_tokens=3, priority=priority)
    hold.set()
    h.wait_ended(["first", "p5", "p0a", "m3a", "p0b", "m3b"])
    h.stop()
    assert [p.new[0].request_id for p in engine.plans if p.new] == ["first", "m3a", "m3b", "p0a", "p0b", "p5"]
    assert all(isinstance(ends(h, rid), Finished) for rid in ("first", "p5", "m3b"))


def picture(content_hash: bytes) -> dict[str, Any]:
    """A request's fields for one image at its prompt's start, hashed by the tokenizer as `content_hash`."""
    return {"items": (Item(0, (), {}, ((0, 4),), content_hash),)}


@pytest.mark.parametrize("engine_shares", ["yes", "no", "not media"])
def test_identical_prompts_join_one_prefill_past_the_prefill_budget(engine_shares: str) -> None:
    """Three requests of one prompt and image (n choices, say) join one
    step though two such prompts would pass --max-prefill-tokens: the
    engine prefills one and copies its row. The same text with another
    image is no twin (its placeholder ids are the same: the tokenizer's
    content hash tells them apart), nor is the same prompt wanting prompt
    log probabilities; and with the engine not sharing prefills, or not
    digesting items (both caches off), each is admitted alone."""
    engine = FakeEngine()
    engine.share_prefills = engine_shares != "no"
    engine.keys_items = engine_shares != "not media"
    h = Harness(engine, max_prefill_tokens=50)
    same = [5] * 40
    for rid in ("a0", "a1", "a2"):
        h.submit(rid, same, **picture(b"image-1"))
    h.submit("other-image", same, **picture(b"image-2"))
    h.submit("scored", same, sampling=Sampling(max_tokens=4, prompt_logprobs=0), **picture(b"image-1"))
    h.submit("a3", same, **picture(b"image-1"))
    h.thread.start()
    rids = ["a0", "a1", "a2", "other-image", "scored", "a3"]
    h.wait_ended(rids)
    h.stop()
    assert all(isinstance(ends(h, rid), Finished) for rid in rids)
    if engine_shares == "yes":
        assert admitted(engine) == [["a0", "a1", "a2"], ["other-image"], ["scored"], ["a3"]]
    else:
        assert admitted(engine) == [[rid] for rid in rids]


@pytest.mark.parametrize("keys_items", [True, False])
def test_identical_prompts_do_not_wait_for_their_own_prefill(keys_items: bool) -> None:
    """With the prefix cache on, requests starting with the text a request
    of this step prefills wait for it; its identical twins do not (they
    take a copy of its row in this very step), while another prompt of the
    same start still waits. Text alone needs no digest of any item."""
    engine = FakeEngine(prefix_cache_bytes=1 << 20)
    engine.keys_items = keys_items
    h = Harness(engine)
    for rid in ("a1", "a2", "a3"):
        h.submit(rid, [*SYSTEM, 1, 2, 3])
    h.submit("b", [*SYSTEM, 4, 5])
    h.thread.start()
    h.wait_ended(["a1", "a2", "a3", "b"])
    h.stop()
    assert admitted(engine) == [["a1", "a2", "a3"], ["b"]]
    assert h.loop.waited_for_prefix == 1


def test_a_prompt_sent_again_while_it_is_prefilled_in_chunks_follows_those_chunks() -> None:
    """A long prompt prefilled over several steps ("chunked": its first
    token in its third step). The same prompt sent meanwhile joins at once
    (the engine has it follow those chunks); one that only starts the same
    waits for the last chunk and takes the text from the prefix cache."""
    hold = threading.Event()
    engine = FakeEngine(hold, prefix_cache_bytes=1 << 20)
    h = Harness(engine)
    h.submit("chunked", [*SYSTEM, 1, 2, 3])
    h.thread.start()
    assert wait_until(lambda: len(engine.plans) == 1, timeout=10)  # joined; its next step waits for `hold`
    h.submit("again", [*SYSTEM, 1, 2, 3])
    h.submit("b", [*SYSTEM, 4, 5])
    hold.set()
    h.wait_ended(["chunked", "again", "b"])
    h.stop()
    first_token = next(i for i, plan in enumerate(engine.plans) if ("chunked", 7) in plan.feed)
    joined = {r.request_id: i for i, plan in enumerate(engine.plans) for r in plan.new}
    assert joined["again"] < first_token == joined["b"] == 3, (joined, first_token)


class CountingBound:
    """Stands in for `mallocheap.Bound`: records what the engine held at each check."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.seen: list[tuple[int, Plan]] = []  # (rows held, the step's plan) at each check

    def check(self) -> int:
        self.seen.append((len(self.engine.rows), self.engine.plans[-1]))
        return 1000


def test_an_idle_rank_gives_its_heaps_free_memory_back_and_a_busy_one_never(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only after a heartbeat (an empty plan) with no row held: a trim locks
    the heaps, so it never runs beside a request's step. A prompt on its
    way in ("chunked": no token for two steps) runs empty plans too."""
    monkeypatch.setattr("scheduler_svc.loop.IDLE_HEAP_CHECK_S", 0.0)
    engine = FakeEngine()
    h = Harness(engine)
    bound = CountingBound(engine)
    h.loop.heap.bound = bound  # type: ignore[assignment]
    h.thread.start()
    assert wait_until(lambda: len(bound.seen) >= 2, timeout=10), "an idle loop never looked at its heaps"
    idle_checks = len(bound.seen)
    h.submit("chunked-r0", max_tokens=3)
    h.wait_ended(["chunked-r0"])
    assert isinstance(ends(h, "chunked-r0"), Finished)
    assert wait_until(lambda: len(bound.seen) > idle_checks + 1, timeout=10), "no check once idle again"
    h.stop()
    joined = next(i for i, plan in enumerate(engine.plans) if plan.new)
    after = engine.plans[joined + 1]
    assert (after.new, after.feed) == ((), ()), "no empty plan with the row held"
    for rows, plan in bound.seen:
        assert rows == 0, f"a check while a row was held (step {plan.step})"
        assert (plan.new, plan.drop, plan.feed) == ((), (), ()), f"a check after a step with work: {plan}"
        assert not plan.stop
    assert h.loop.heap.returned == 1000 * len(bound.seen)


def test_heap_free_limit_0_never_looks() -> None:
    h = Harness(FakeEngine(), heap_free_limit_bytes=0)
    assert h.loop.heap.bound is None


def test_a_follower_looks_at_its_heaps_only_after_an_empty_plan_with_nothing_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("scheduler_svc.loop.IDLE_HEAP_CHECK_S", 0.0)
    engine = FakeEngine()
    plans = [
        Plan(step=1),
        Plan(step=2, new=(request("chunked-r0", [5] * 4),)),
        Plan(step=3),  # its prompt still on its way in: held, nothing to feed
        Plan(step=4, drop=("chunked-r0",)),
        Plan(step=5),
        Plan(step=6, stop=True),
    ]

    class Scripted(SoloGroup):
        def broadcast_from_0(self, obj: object) -> object:
            return plans.pop(0)

    heap = IdleHeap(1)
    bound = CountingBound(engine)
    heap.bound = bound  # type: ignore[assignment]
    run_follower(engine, Scripted(), heap)  # type: ignore[arg-type]
    assert [plan.step for _, plan in bound.seen] == [1, 5]
    assert heap.returned == 2000
