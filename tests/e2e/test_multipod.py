"""Multi-pod, proven here: a TP=2 scheduler with each rank in a network
namespace of its own (and a /dev/shm of its own), started with
`--launch env` from the variables a LeaderWorkerSet sets, and the tokenizer in a third.
They meet over veth links only (tests/support/pods.py): requests succeed
over inline tensors (chosen because the shared-memory namespace ids
differ), a read failure injected on rank 1 fails that request alone on
every rank, and killing rank 1's pod fails the requests in flight with
SCHEDULER_UNAVAILABLE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mmsplit_cli.launch import ServiceProcess
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE
from tests.support import netns as netns_support
from tests.support.faults import failing_request_id
from tests.support.leaks import wait_until
from tests.support.pods import Pods, pods
from tests.support.services import ENV, stop_all

pytestmark = pytest.mark.e2e
WHY_NOT = netns_support.available()
GRPC_PORT = 50051  # inside the pods: no clash with anything on the host


@pytest.fixture
def cluster(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Pods, list[ServiceProcess], ServiceProcess]]:
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    token = tmp_path / "scheduler-token"
    token.write_text("a-token-shared-by-the-pods\n")
    with pods(["rank0", "rank1", "tok"], [("rank0", "rank1"), ("rank0", "tok")]) as net:
        ranks_link, front_link = net.link("rank0", "rank1"), net.link("rank0", "tok")
        leader = front_link.address("rank0")
        started: list[ServiceProcess] = []
        try:
            for rank in (0, 1):
                pod = f"rank{rank}"
                env = {
                    **ENV,
                    # What a LeaderWorkerSet gives each pod (MASTER_PORT is 29500).
                    "LWS_WORKER_INDEX": str(rank),
                    "LWS_GROUP_SIZE": "2",
                    "LWS_LEADER_ADDRESS": ranks_link.address("rank0"),
                    # gloo picks its interface by the host name, which
                    # resolves to loopback here: name the link instead.
                    "GLOO_SOCKET_IFNAME": ranks_link.interface(pod),
                }
                args = [
                    "scheduler",
                    "--model", str(tiny_model),
                    "--launch", "env",
                    "--host", leader,
                    "--port", str(GRPC_PORT),
                    "--auth-token-file", str(token),
                    "--tensor-reader", "tests.support.faults:make_reader",
                ]  # fmt: skip
                started.append(
                    ServiceProcess(
                        pod, args, tmp_path / f"{pod}.log", env=env, wrapper=net.wrapper(pod, shm_size="64m")
                    )
                )
            tok_args = [
                "tokenizer",
                "--model", str(tiny_model),
                "--scheduler", f"{leader}:{GRPC_PORT}",
                "--scheduler-auth-token-file", str(token),
                "--port", "0",
            ]  # fmt: skip
            tokenizer = ServiceProcess(
                "tokenizer", tok_args, tmp_path / "tokenizer.log", env=ENV, wrapper=net.wrapper("tok", shm_size="64m")
            )
            started.append(tokenizer)
            started[0].wait_logged(f"{SCHEDULER_SERVICE} readiness: SERVING", 180)
            tokenizer.wait_logged(f"{TOKENIZER_SERVICE} readiness: SERVING", 180)
            yield net, started[:2], tokenizer
        finally:
            stop_all(started)


def outcomes(proc: subprocess.Popen[str]) -> dict[str, dict[str, Any]]:
    out, _ = proc.communicate(timeout=120)
    lines = [json.loads(line) for line in out.splitlines()]
    return {line["request_id"]: line for line in lines if "request_id" in line}


@pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "namespaces can be made")
def test_a_group_spread_over_three_pods_serves_agrees_and_fails_cleanly(cluster) -> None:  # type: ignore[no-untyped-def]
    net, (rank0, rank1), tokenizer = cluster
    assert "tensors go by TRANSPORT_INLINE" in tokenizer.log_path.read_text()

    # Good requests with images, and one whose read fails on rank 1 only.
    bad = failing_request_id(1, "multipod")
    specs = [{"request_id": f"pod-{i}", "max_tokens": 3, "image": True} for i in range(6)]
    specs.append({"request_id": bad, "max_tokens": 3, "image": True})
    results = outcomes(net.client("tok", tokenizer.address, specs))
    assert len(results) == 7, results
    assert results.pop(bad)["reason"] == "FEATURE_TRANSPORT_FAILED"
    assert all(r["ok"] and r["completion_tokens"] == 3 for r in results.values()), results
    # Rank 1 could not read; rank 0 learned it through the agreement and
    # aborted it on every rank, the others of its step going on.
    assert "could not use tensors" not in rank0.log_path.read_text()
    assert "rank 1 could not use tensors of request" in rank1.log_path.read_text()
    assert f"{bad} failed on rank(s) 1, aborted on all ranks" in rank0.log_path.read_text()

    # Rank 1's pod dies with requests in flight.
    specs = [{"request_id": f"long-{i}", "max_tokens": 900, "image": True} for i in range(3)]
    running = net.client("tok", tokenizer.address, specs)
    assert running.stdout is not None
    started = set()
    while len(started) < 3:
        line = running.stdout.readline()
        assert line, "the client ended before its requests started"
        started.add(json.loads(line).get("started"))
    for pid in net.pids("rank1"):
        os.kill(pid, signal.SIGKILL)
    rest = running.communicate(timeout=120)[0]
    ended = [json.loads(line) for line in rest.splitlines() if "request_id" in line]
    assert [r["reason"] for r in ended] == ["SCHEDULER_UNAVAILABLE"] * 3, ended
    assert rank0.proc.wait(60) != 0, "rank 0 outlived its group"
    assert wait_until(lambda: "readiness: NOT_SERVING" in tokenizer.log_path.read_text(), timeout=20)
