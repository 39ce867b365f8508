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
    """`ensure` fails its first call (as a sweep or a spawn out of descriptors would)."""

    ready = True

    def __init__(self) -> None:
        self.calls = 0

    async def ensure(self) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return True


class FakeHealth:
    def __init__(self) -> None:
        self.ready: list[bool] = []

    async def set_ready(self, ready: bool) -> None:
        self.ready.append(ready)


def test_a_round_that_fails_is_logged_and_the_watch_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "WATCH_INTERVAL_S", 0.01)
    health = FakeHealth()
    service = SimpleNamespace(link=FakeLink(), pool=FlakyPool(), held=set(), janitor_removed=0)
    settings = SimpleNamespace(janitor_interval_s=1e9, shm_prefix="unused", segment_grace_s=1.0)

    async def scenario() -> None:
        watch = asyncio.create_task(server._watch(settings, health, service))  # type: ignore[arg-type]
        try:
            for _ in range(500):
                if len(health.ready) >= 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            watch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await watch

    asyncio.run(scenario())
    assert health.ready[:2] == [True, True], "readiness was not refreshed after the failed round"
    assert service.pool.calls >= 3
    assert "a round of the tokenizer's watch failed" in caplog.text
