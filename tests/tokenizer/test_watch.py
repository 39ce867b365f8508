"""The tokenizer's watch (`tokenizer_svc.server._watch`): the task that keeps
readiness true, the pool whole and /dev/shm swept outlives a round that fails."""

from __future__ import annotations

import asyncio
import errno
from types import SimpleNamespace

import pytest

from tokenizer_svc import server


class FakeLink:
    connected = True

    async def refresh(self) -> None:
        return None


class FlakyPool:
    """`ensure` fails its first `failures` calls (as a sweep or a spawn out
    of descriptors would)."""

    ready = True

    def __init__(self, failures: int = 1) -> None:
        self.failures = failures
        self.calls = 0

    async def ensure(self) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        return True


class FakeHealth:
    def __init__(self) -> None:
        self.ready: list[bool] = []

    async def set_ready(self, ready: bool) -> None:
        self.ready.append(ready)


def watch_until(health: FakeHealth, service: SimpleNamespace, ready_rounds: int) -> None:
    """Run the watch until it has set readiness `ready_rounds` times, then cancel it."""
    settings = SimpleNamespace(
        janitor_interval_s=1e9, shm_prefix="unused", segment_grace_s=1.0, heap_free_limit_bytes=256 << 20
    )

    async def scenario() -> None:
        watch = asyncio.create_task(server._watch(settings, health, service))  # type: ignore[arg-type]
        try:
            for _ in range(500):
                if len(health.ready) >= ready_rounds:
                    break
                await asyncio.sleep(0.01)
        finally:
            watch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await watch

    asyncio.run(scenario())


def test_a_round_that_fails_is_logged_and_the_watch_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "WATCH_INTERVAL_S", 0.01)
    health = FakeHealth()
    service = SimpleNamespace(
        link=FakeLink(), pool=FlakyPool(), held=set(), janitor_removed=0, heap_returned=0, inflight=0
    )
    watch_until(health, service, 2)
    assert health.ready[:2] == [True, True], "readiness was not refreshed after the failed round"
    assert service.pool.calls >= 3
    assert "a round of the tokenizer's watch failed" in caplog.text


def test_a_failure_that_persists_is_logged_in_full_once_then_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "WATCH_INTERVAL_S", 0.01)
    monkeypatch.setattr(server, "WATCH_LOG_EVERY", 3)
    health = FakeHealth()
    service = SimpleNamespace(
        link=FakeLink(), pool=FlakyPool(failures=7), held=set(), janitor_removed=0, heap_returned=0, inflight=0
    )
    # Two good rounds: the first has then run to its end (the recovery is
    # logged last in a round, after awaits a cancellation could cut short).
    watch_until(health, service, 2)
    assert health.ready[:2] == [True, True]
    watched = [r for r in caplog.records if r.name == server.log.name]
    tracebacks = [r for r in watched if r.exc_info]
    assert len(tracebacks) == 1, "a failure that persists must not log its traceback every round"
    assert "Too many open files" in caplog.text
    counted = [r.getMessage() for r in watched if "rounds in a row" in r.getMessage()]
    assert counted == [
        "the tokenizer's watch has failed 3 rounds in a row (the first is logged above)",
        "the tokenizer's watch has failed 6 rounds in a row (the first is logged above)",
    ]
    assert "the tokenizer's watch recovered after 7 failed round(s)" in caplog.text


def test_the_heaps_are_given_back_as_busy_while_requests_are_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trim makes the event loop's allocations wait (bench/trim_stall.py):
    the watch tells the bound whether requests are in flight, and a busy
    tokenizer waits for an idle moment (`mallocheap.Bound.check`)."""
    monkeypatch.setattr(server, "WATCH_INTERVAL_S", 0.01)
    asked: list[bool] = []
    monkeypatch.setattr(server.mallocheap.Bound, "check", lambda self, busy=False: asked.append(busy) or 0)
    for inflight in (3, 0):
        service = SimpleNamespace(
            link=FakeLink(), pool=FlakyPool(), held=set(), janitor_removed=0, heap_returned=0, inflight=inflight
        )
        watch_until(FakeHealth(), service, 2)
    assert True in asked, asked
    assert asked[-1] is False, asked
