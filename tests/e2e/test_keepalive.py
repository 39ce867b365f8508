"""A connection whose peer vanishes without closing it (its node lost, a
network partition: no FIN, no RST) is found by keepalive pings, on both
sides, within --keepalive-s + --keepalive-timeout-s: the tokenizer fails the
request SCHEDULER_UNAVAILABLE, and the scheduler aborts it, where both
would otherwise wait for TCP's retransmissions (~15 minutes) or the
request's deadline, the scheduler generating all the while.

The same holds between a client and the tokenizer: the client's stream
ends UNAVAILABLE, and the tokenizer and the scheduler abort the request.

The scheduler, the tokenizer and a client are in network namespaces of
their own (tests/support/pods.py), joined by veth links; setting a link
down mid-generation drops every packet across it, and setting it up again
brings the two sides back together."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.client import make_request, run_request
from mmsplit_cli.launch import ServiceProcess
from tests.conftest import HOLDING_LIMIT, HOLDING_TOKENS, SCHEDULER_SERVICE, TOKENIZER_SERVICE
from tests.e2e.helpers import scheduler_info
from tests.support import netns as netns_support
from tests.support.leaks import wait_until
from tests.support.pods import Pods, ip, pods, start_client
from tests.support.services import ENV, running_pair, stop_all

pytestmark = pytest.mark.e2e
WHY_NOT = netns_support.available()
GRPC_PORT = 50051
TOKENIZER_PORT = 50052
# Pings every 2 s, 1 s to answer: a vanished peer is found within ~3 s.
KEEPALIVE = ["--keepalive-s", "2", "--keepalive-timeout-s", "1"]
FOUND_WITHIN_S = 10.0


@pytest.fixture
def pair(long_context_model: Path, tmp_path: Path) -> Iterator[tuple[Pods, ServiceProcess, ServiceProcess]]:
    """A model whose long request outlasts the cut's discovery however fast
    this host generates: `tiny_model`'s 1,024 positions ended one OK in
    0.9 s on an idle host, before a keepalive could find the cut."""
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    with pods(["sched", "tok", "cli"], [("sched", "tok"), ("tok", "cli")]) as net:
        address = net.link("sched", "tok").address("sched")
        started: list[ServiceProcess] = []
        try:
            scheduler = [
                "scheduler", "--model", str(long_context_model), "--tp", "1",
                "--host", address, "--port", str(GRPC_PORT), "--insecure", "true", *KEEPALIVE, *HOLDING_LIMIT,
            ]  # fmt: skip
            started.append(
                ServiceProcess(
                    "scheduler", scheduler, tmp_path / "scheduler.log", env=ENV, wrapper=net.wrapper("sched")
                )
            )
            tokenizer = [
                "tokenizer", "--model", str(long_context_model),
                "--scheduler", f"{address}:{GRPC_PORT}", "--host", "0.0.0.0", "--port", str(TOKENIZER_PORT),
                *KEEPALIVE, *HOLDING_LIMIT,
            ]  # fmt: skip
            started.append(
                ServiceProcess("tokenizer", tokenizer, tmp_path / "tokenizer.log", env=ENV, wrapper=net.wrapper("tok"))
            )
            started[0].wait_logged(f"{SCHEDULER_SERVICE} readiness: SERVING", 180)
            started[1].wait_logged(f"{TOKENIZER_SERVICE} readiness: SERVING", 180)
            yield net, started[0], started[1]
        finally:
            stop_all(started)


def next_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The client's next JSON line; fails when none comes within `timeout_s`."""
    stdout = proc.stdout
    assert stdout is not None
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert any(got), f"nothing from the client within {timeout_s:g}s"
    line: dict[str, Any] = json.loads(got[0])
    return line


def cut_mid_stream(
    net: Pods, client_pod: str, address: str, rid: str, cut: tuple[str, str], *, keepalive_s: float | None = None
) -> tuple[dict[str, Any], float]:
    """A long request from `client_pod` to `address`; once it streams, the
    link `cut` (pod, its peer) goes down at the pod's end. The client's last
    line (it must come within FOUND_WITHIN_S), and when the cut was."""
    cut_pod = cut[0]
    link = net.link(*cut)
    running = net.client(
        client_pod, address, [{"request_id": rid, "max_tokens": HOLDING_TOKENS}], keepalive_s=keepalive_s
    )
    try:
        assert next_line(running, 60) == {"started": rid}
        ip("-n", net.namespaces[cut_pod], "link", "set", link.interface(cut_pod), "down")
        cut = time.monotonic()
        ended = next_line(running, FOUND_WITHIN_S)
        assert ended["request_id"] == rid
        assert not ended["ok"]
        assert ended["completion_tokens"] < HOLDING_TOKENS
        assert running.wait(10) == 0
        return ended, cut
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()


def aborted(service: ServiceProcess, rid: str, by: float) -> bool:
    """Whether `service` logs request `rid` (a pattern) ended CANCELLED by monotonic time `by`."""
    found = re.compile(rf"request {rid} finished: CANCELLED")
    return wait_until(lambda: found.search(service.log_path.read_text()), timeout=max(0.0, by - time.monotonic()))


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "namespaces can be made")
def test_a_peer_that_vanishes_is_found_on_both_sides(pair) -> None:  # type: ignore[no-untyped-def]
    net, scheduler, tokenizer = pair
    ended, cut = cut_mid_stream(net, "tok", tokenizer.address, "long", ("sched", "tok"))
    assert ended["reason"] == "SCHEDULER_UNAVAILABLE", ended
    # The scheduler found the tokenizer gone too, and aborted the request.
    assert aborted(scheduler, r"\S+\.long", cut + FOUND_WITHIN_S), "the scheduler generated on for nobody"
    link = net.link("sched", "tok")
    ip("-n", net.namespaces["sched"], "link", "set", link.interface("sched"), "up")

    def served() -> bool:
        again = net.client("tok", tokenizer.address, [{"request_id": "after", "max_tokens": 2}])
        out, _ = again.communicate(timeout=60)
        return any(json.loads(line).get("ok") for line in out.splitlines())

    assert wait_until(served, timeout=30, interval=1.0), "the tokenizer did not get back to its scheduler"


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "namespaces can be made")
def test_a_client_that_vanishes_is_found_and_its_request_aborted(pair) -> None:  # type: ignore[no-untyped-def]
    net, scheduler, tokenizer = pair
    address = f"{net.link('tok', 'cli').address('tok')}:{TOKENIZER_PORT}"
    _, cut = cut_mid_stream(net, "cli", address, "gone", ("cli", "tok"), keepalive_s=2)
    assert aborted(tokenizer, "gone", cut + FOUND_WITHIN_S), "the tokenizer did not notice its client gone"
    assert aborted(scheduler, r"\S+\.gone", time.monotonic() + 5), "the scheduler generated on for nobody"


def test_a_frozen_scheduler_is_found_and_the_group_serves_once_it_thaws(tiny_model: Path, tmp_path: Path) -> None:
    """A scheduler whose process stops running (SIGSTOP: a frozen cgroup, a
    node in swap death) keeps its TCP connections open, and the kernel keeps
    accepting: only unanswered pings show it. Its requests fail
    SCHEDULER_UNAVAILABLE within seconds; once it runs again it aborts them
    (their tokenizer has gone from them) and serves new ones."""
    with (
        running_pair(tiny_model, tmp_path, scheduler_extra=["--tp", "1", *KEEPALIVE], tokenizer_extra=KEEPALIVE) as p,
        grpc.insecure_channel(p.tokenizer_address) as channel,
    ):
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        events = stub.Generate(
            make_request("Go on.", max_tokens=3000, min_tokens=3000, request_id="frozen"), timeout=120
        )
        next(events)  # it streams
        os.kill(p.scheduler.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as failed:
                for _ in events:
                    pass
            assert time.monotonic() - stopped < FOUND_WITHIN_S
            assert RemoteError.from_rpc_error(failed.value).reason == "SCHEDULER_UNAVAILABLE"
        finally:
            os.kill(p.scheduler.pid, signal.SIGCONT)
        assert aborted(p.scheduler, r"\S+\.frozen", time.monotonic() + FOUND_WITHIN_S), "it generated on for nobody"
        assert wait_until(lambda: run_request(stub, make_request("Hi.", max_tokens=2), timeout=30).ok, timeout=30)


def test_a_frozen_client_s_queued_request_is_aborted(tiny_model: Path, tmp_path: Path) -> None:
    """A client whose process stops running (a stopped consumer) while its
    request waits in the scheduler's queue would keep that place until the
    request's turn came and its output filled the connection's window; the
    tokenizer's pings find it, and the request is aborted where it waits."""
    # The check needs blockers still queued after the client was found (up
    # to FOUND_WITHIN_S + 5 s); a blocker takes ~1-2 s here, less on a fast
    # host, where 8 once ran out. Only the first runs to completion (the rest
    # are let go): more cost nothing.
    blockers = 32
    scheduler = ["--tp", "1", "--max-running", "1", *KEEPALIVE]
    with (
        running_pair(tiny_model, tmp_path, scheduler_extra=scheduler, tokenizer_extra=KEEPALIVE) as p,
        grpc.insecure_channel(p.tokenizer_address) as channel,
        ThreadPoolExecutor(blockers) as pool,
    ):
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        # One runs, the others queue: ~2 s each here, the batch holding one.
        long = [make_request("Go on.", max_tokens=1000, min_tokens=1000, request_id=f"b{i}") for i in range(blockers)]
        ahead = [pool.submit(run_request, stub, request, 120) for request in long]
        assert wait_until(lambda: scheduler_info(p.scheduler_address).queued_requests == blockers - 1, timeout=30)
        client = start_client(p.tokenizer_address, [{"request_id": "stopped", "max_tokens": 4}], keepalive_s=0)
        try:
            assert wait_until(lambda: scheduler_info(p.scheduler_address).queued_requests == blockers, timeout=30)
            os.kill(client.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            assert aborted(p.tokenizer, "stopped", frozen + FOUND_WITHIN_S), "its request kept its place in the queue"
            assert aborted(p.scheduler, r"\S+\.stopped", time.monotonic() + 5)
            # Aborted where it waited: it never ran a step (blockers that
            # finished meanwhile, fast on an idle host, do not matter while
            # some are still ahead of it).
            # (The step loop logs it when it takes the abort, which may come
            # after the call's own end is logged on a loaded host.)
            where = re.compile(r"request \S+\.stopped aborted before its first step")
            assert wait_until(lambda: where.search(p.scheduler.log_path.read_text()), timeout=15), (
                "it ran before it was found"
            )
            assert not all(f.done() for f in ahead), (
                "the queue ran out before the check: add blockers",
                [f.result() for f in ahead if f.done()],
            )
        finally:
            client.kill()
            client.wait()
        # The blocker that ran meanwhile finishes as it would have, and none
        # failed; the rest are let go of, not waited out (seconds each).
        first = next(as_completed(ahead, timeout=120)).result()
        assert first.ok, first
        assert all(f.result().ok for f in ahead if f.done())
        channel.close()
        assert all(f.result().ok or f.result().grpc_code == "CANCELLED" for f in ahead), [f.result() for f in ahead]
        assert wait_until(lambda: scheduler_info(p.scheduler_address).queued_requests == 0, timeout=30)
        with grpc.insecure_channel(p.tokenizer_address) as again:
            assert run_request(tokenizer_pb2_grpc.TokenizerServiceStub(again), make_request("Hi.", max_tokens=2)).ok
