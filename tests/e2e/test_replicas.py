"""Several scheduler groups behind one tokenizer (`--scheduler A,B,C`).

Three groups (TP=1) on loopback; the third runs in a mount namespace of its
own (a /dev/shm that is not the tokenizer's), so the tokenizer hands it
tensors inline while the other two get shared memory. Then, in order:
12 requests at once sit 4 on each group, and while one group holds a
long request the next ones go to the others (fewest in flight); 150 more
are all served, by every group; a SIGTERM to one group under
load fails nothing (what it had not accepted goes elsewhere, what it had
finishes within its grace); a SIGKILL to another fails exactly the requests
it had accepted, with SCHEDULER_UNAVAILABLE; the tokenizer stays SERVING
throughout, and finds the killed group again once it is restarted."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import ServiceProcess, scheduler_args
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, scheduler_info
from tests.support.leaks import wait_until
from tests.support.services import ENV, start_tokenizer

pytestmark = pytest.mark.e2e
GROUPS = 3
IMAGES = [samples.encode(samples.gradient(320, 240, seed=i), "JPEG") for i in range(6)]  # small: cheap to send


def backends(tokenizer: str) -> dict[str, tokenizer_pb2.SchedulerBackend]:
    with grpc.insecure_channel(tokenizer) as channel:
        reply = tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetServerInfo(
            tokenizer_pb2.GetServerInfoRequest(), timeout=5
        )
    return {b.address: b for b in reply.backends}


def served_since(groups: list[ServiceProcess], before: list[int], total: int) -> list[int]:
    """Requests each group finished since `before`, once `total` of them are
    in the logs (a group logs a request a moment after its last token)."""
    wait_until(lambda: sum(served(g) for g in groups) - sum(before) >= total, timeout=10)
    return [served(g) - b for g, b in zip(groups, before, strict=True)]


def served(group: ServiceProcess) -> int:
    """Requests this group finished (its log's per-request lines)."""
    return group.log_path.read_text().count(" finished: ")


def run_all(
    address: str, n: int, *, max_tokens: int, tag: str, concurrency: int = 12, image: bytes = b""
) -> list[Outcome]:
    def one(i: int) -> Outcome:
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            picture = image or IMAGES[i % len(IMAGES)]
            request = make_request("Go on.", [picture], max_tokens=max_tokens, request_id=f"{tag}-{i}")
            request.sampling.min_tokens = max_tokens
            return run_request(stub, request, timeout=120)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture
def fleet(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[list[ServiceProcess], ServiceProcess, list[int]]]:
    started: list[ServiceProcess] = []
    groups: list[ServiceProcess] = []  # the test may add a restarted group
    try:
        for i in range(GROUPS):
            args = scheduler_args(tiny_model, tp=1, extra=["--shutdown-grace-s", "20"])  # on a port drawn by each
            # The last group has a /dev/shm of its own: a replica in another pod.
            wrapper = [sys.executable, "-m", "tests.support.mountns", "64m"] if i == GROUPS - 1 else []
            started.append(ServiceProcess(f"group{i}", args, tmp_path / f"group{i}.log", env=ENV, wrapper=wrapper))
        ports = [group.wait_bound(180) for group in started]
        targets = ",".join(f"127.0.0.1:{p}" for p in ports)
        tokenizer = start_tokenizer(tiny_model, targets, tmp_path / "tokenizer.log")
        started.append(tokenizer)
        for group in started[:GROUPS]:
            group.wait_serving(SCHEDULER_SERVICE, 180)
        tokenizer.wait_serving(TOKENIZER_SERVICE, 180)
        assert wait_until(lambda: all(b.ready for b in backends(tokenizer.address).values()), timeout=30)
        groups.extend(started[:GROUPS])
        yield groups, tokenizer, ports
    finally:
        everyone = [*started, *(g for g in groups if g not in started)]
        for proc in everyone:
            proc.terminate()
        for proc in everyone:
            proc.stop()


def test_groups_share_the_load_and_one_going_away_fails_only_what_it_had(fleet, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    groups, tokenizer, ports = fleet
    address = tokenizer.address
    transports = {a: common_pb2.Transport.Name(b.transport) for a, b in backends(address).items()}
    assert transports == {
        f"127.0.0.1:{ports[0]}": "TRANSPORT_SHM",
        f"127.0.0.1:{ports[1]}": "TRANSPORT_SHM",
        f"127.0.0.1:{ports[2]}": "TRANSPORT_INLINE",
    }

    # Requests the groups have finished so far. A group logs a request a
    # moment after its last token: each phase's count starts once the last
    # phase's are all in the logs (the long request's line, logged after the
    # 150 began, once made them 151).
    done = [sum(served(g) for g in groups)]

    def settled(finished: int) -> list[int]:
        done[0] += finished
        assert wait_until(lambda: sum(served(g) for g in groups) >= done[0], timeout=30), done
        return [served(g) for g in groups]

    # The same greedy request on all three: the same tokens by shared memory and inline.
    before = [served(g) for g in groups]
    same = run_all(address, 9, max_tokens=6, tag="same", concurrency=9, image=IMAGES[0])
    assert all(o.ok for o in same), same
    assert len({tuple(o.token_ids) for o in same}) == 1, [o.token_ids for o in same]
    assert all(n > 0 for n in served_since(groups, before, 9)), "a group served none of them"
    settled(9)

    # Fewest in flight: 12 long requests at once sit 4 on each group. (How
    # many each group serves over time depends on its speed, which on a busy
    # host differs: a faster group rightly takes more.)
    seen: list[list[int]] = []

    def all_placed() -> bool:
        counts = [b.requests_in_flight for b in backends(address).values()]
        seen.append(counts)
        return sum(counts) == 12

    with ThreadPoolExecutor(1) as side:
        load = side.submit(run_all, address, 12, max_tokens=300, tag="even", concurrency=12)
        assert wait_until(all_placed, timeout=30), seen[-3:]
        placed = load.result(timeout=120)
    settled(12)
    assert sorted(seen[-1]) == [4, 4, 4], seen[-1]
    assert all(o.ok for o in placed), [o for o in placed if not o.ok][:3]

    # While one group holds a long request, requests one at a time go to the
    # other two (turn by turn would give it one of every three).
    with ThreadPoolExecutor(1) as side:
        long = side.submit(run_all, address, 1, max_tokens=600, tag="long", concurrency=1)
        assert wait_until(lambda: sum(b.requests_in_flight for b in backends(address).values()) == 1, timeout=30)
        busy = next(a for a, b in backends(address).items() if b.requests_in_flight == 1)
        before = [served(g) for g in groups]
        short = run_all(address, 3, max_tokens=2, tag="short", concurrency=1)
        after = served_since(groups, before, 3)
        still = backends(address)[busy].requests_in_flight  # so `after` cannot hold the long one
        assert long.result(timeout=120)[0].ok
    assert all(o.ok for o in short), short
    assert still == 1, "the long request ended before the short ones: nothing was shown"
    assert after[ports.index(int(busy.rsplit(":", 1)[1]))] == 0, (busy, after)

    # 150 short requests, 12 at a time: every one served, by every group.
    before = settled(1 + 3)
    outcomes = run_all(address, 150, max_tokens=2, tag="spread")
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    shares = served_since(groups, before, 150)
    assert sum(shares) == 150, shares
    assert min(shares) > 0, shares

    # SIGTERM to group 0 under load: nothing fails.
    with ThreadPoolExecutor(1) as side:
        load = side.submit(run_all, address, 60, max_tokens=24, tag="drain")
        assert wait_until(lambda: backends(address)[f"127.0.0.1:{ports[0]}"].requests_in_flight > 0, timeout=30)
        groups[0].terminate()
        drained = load.result(timeout=120)
    assert all(o.ok for o in drained), [o for o in drained if not o.ok][:3]
    assert groups[0].proc.wait(60) == 0
    assert health_status(address, TOKENIZER_SERVICE) == "SERVING"

    # SIGKILL to group 1 with requests running on it: those fail, typed; no other does.
    killed = f"127.0.0.1:{ports[1]}"
    with ThreadPoolExecutor(1) as side:
        load = side.submit(run_all, address, 8, max_tokens=600, tag="kill", concurrency=8)

        def all_running() -> bool:
            info = backends(address)
            return sum(b.requests_in_flight for b in info.values()) == 8 and info[killed].requests_in_flight > 0

        assert wait_until(all_running, timeout=30)
        # Every request accepted and in its group's batch (streaming).
        live = [f"127.0.0.1:{p}" for p in ports[1:]]
        assert wait_until(lambda: sum(scheduler_info(a).running_requests for a in live) == 8, timeout=30)
        on_killed = backends(address)[killed].requests_in_flight
        os.kill(groups[1].pid, signal.SIGKILL)
        results = load.result(timeout=120)
    failed = [o for o in results if not o.ok]
    assert len(failed) == on_killed, (on_killed, results)
    assert {(o.grpc_code, o.reason) for o in failed} == {("UNAVAILABLE", "SCHEDULER_UNAVAILABLE")}
    assert health_status(address, TOKENIZER_SERVICE) == "SERVING"
    assert wait_until(lambda: not backends(address)[killed].ready, timeout=10)

    # Group 1 comes back on its port: the tokenizer uses it again.
    args = scheduler_args(tiny_model, tp=1, extra=["--port", str(ports[1])])
    again = ServiceProcess("group1-again", args, groups[0].log_path.parent / "group1-again.log", env=ENV)
    groups.append(again)  # the fixture stops it
    again.wait_serving(SCHEDULER_SERVICE, 180)
    assert wait_until(lambda: backends(address)[killed].ready, timeout=30)
    back = run_all(address, 6, max_tokens=2, tag="back")
    assert all(o.ok for o in back), back
    assert wait_until(lambda: served(again) > 0, timeout=10)


def test_a_dns_target_makes_every_address_a_backend(services: Services, tmp_path: Path) -> None:
    """`dns:///localhost:PORT`: localhost's addresses become backends (the
    one the scheduler listens on is ready; another, if any, is not and gets
    nothing), and requests are served."""
    target = f"dns:///localhost:{services.scheduler.port}"
    tokenizer = start_tokenizer(services.model, target, tmp_path / "tokenizer.log")
    try:
        tokenizer.wait_serving(TOKENIZER_SERVICE, 180)
        found = backends(tokenizer.address)
        listening = f"127.0.0.1:{services.scheduler.port}"
        assert found[listening].ready, found
        assert all(not b.ready for a, b in found.items() if a != listening), found
        outcomes = run_all(tokenizer.address, 4, max_tokens=2, tag="dns")
        assert all(o.ok for o in outcomes), outcomes
    finally:
        assert tokenizer.stop() == 0
