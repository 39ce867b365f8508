"""Clients that leave at every moment of a request's life, under load:
cancelled or out of time while the media is fetched, waits for a worker,
is preprocessed, waits for the scheduler, or streams; some requests with a
sibling image that fails at once. Afterwards nothing is held anywhere (no
slab slice, no request on any rank, only the slab in /dev/shm), health is
SERVING and the next request succeeds."""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import grpc
import pytest

from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests, tokenizer_info, tokenizer_stub
from tests.support.leaks import PROJECT_PREFIX, holders, live_grants, wait_until

pytestmark = pytest.mark.e2e
REQUESTS = 400
# What a client that leaves may see: its own cancellation or deadline, or
# the request's own outcome when it ended first.
LEFT = {"CANCELLED", "DEADLINE_EXCEEDED"}


def storm(seed: int) -> list[tuple[tokenizer_pb2.GenerateRequest, str, float]]:
    """(request, how its client behaves, after how many seconds)."""
    rng = random.Random(seed)
    images = [samples.encode(samples.gradient(320, 240, seed=20_000 + i), "JPEG") for i in range(60)]
    plan = []
    for _ in range(REQUESTS):
        shape = rng.random()
        if shape < 0.15:  # a sibling that fails before any slab or worker is needed
            request = make_request("<image> <image> Compare.", [rng.choice(images)], max_tokens=4)
            request.images.add(url="data:image/png;base64,@@@")
        elif shape < 0.25:
            request = make_request("Say something.", max_tokens=rng.randint(1, 16))
        else:
            request = make_request("Look.", [rng.choice(images)], max_tokens=rng.randint(1, 16))
        behaviour = rng.choice(["cancel", "cancel", "deadline", "stay"])
        plan.append((request, behaviour, rng.uniform(0.0, 0.4)))
    return plan


async def _run(address: str, plan: list[tuple[tokenizer_pb2.GenerateRequest, str, float]]) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        slots = asyncio.Semaphore(32)

        async def one(request: tokenizer_pb2.GenerateRequest, behaviour: str, after_s: float) -> str:
            async with slots:
                timeout = after_s + 0.01 if behaviour == "deadline" else 120
                call = stub.Generate(request, timeout=timeout)
                if behaviour == "cancel":
                    asyncio.get_running_loop().call_later(after_s, call.cancel)
                try:
                    async for _ in call:
                        pass
                except asyncio.CancelledError:
                    return "CANCELLED"  # the call's own cancel, raised by its iterator
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.CANCELLED:
                        return "CANCELLED"
                    return RemoteError.from_rpc_error(exc).reason
                return ""

        return await asyncio.gather(*(one(*entry) for entry in plan))


# Reads of the servers just after the storm: they may still be busy letting
# its requests go (on a loaded host, for seconds), so a read waits this long.
# A 5 s read deadline was the one wait here that did not scale with load.
READ_S = 60.0


def test_clients_that_leave_at_any_moment_leave_nothing_behind(services: Services) -> None:
    plan = storm(seed=7)
    outcomes = asyncio.run(_run(services.tokenizer_address, plan))
    tally = Counter((behaviour, any(r.url for r in request.images), got) for (request, behaviour, _), got in
                    zip(plan, outcomes, strict=True))  # fmt: skip
    for (request, behaviour, _), got in zip(plan, outcomes, strict=True):
        bad_sibling = any(image.url for image in request.images)
        allowed = {"", *LEFT} if behaviour != "stay" else {""}
        if bad_sibling:
            allowed = {"INVALID_REQUEST", *LEFT}
        # The whole tally, so a failure here says what else happened.
        assert got in allowed, (behaviour, bad_sibling, got, sorted(tally.items()))
    assert outcomes.count("CANCELLED") > 20, f"too few requests were cancelled to test anything: {tally}"
    assert outcomes.count("") > 20, f"too few requests succeeded to test anything: {tally}"
    address = services.tokenizer_address
    held = lambda: tokenizer_info(address, READ_S).info.shm_slab_used_bytes  # noqa: E731
    if not wait_until(lambda: held() == 0, timeout=60):
        # Who holds it, for the record (tokenizer, a worker, a rank).
        slab = next(
            n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{services.tokenizer.pid}-slab")
        )
        raise AssertionError(f"a slice stayed held: {held()} bytes; holders: {holders(slab)}")
    active = lambda: rank_active_requests(services.scheduler_address, READ_S)  # noqa: E731
    assert wait_until(lambda: not any(active()), timeout=60), f"requests stayed on the ranks: {active()}"
    pid = services.tokenizer.pid
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{pid}-")]
    left = [n for n in mine if "-slab" not in n and not ("-grant" in n and not live_grants(n))]
    assert not left, f"segments besides the slab and an idle grant table: {left}"
    slabs = [n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{pid}-slab")]
    assert len(slabs) == 1, slabs
    with grpc.insecure_channel(address) as channel:
        after = run_request(tokenizer_stub(channel), make_request("Look.", [samples.good_png(seed=5)], max_tokens=2))
    assert after.ok, after
    assert health_status(address, TOKENIZER_SERVICE, READ_S) == "SERVING"
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE, READ_S) == "SERVING"
