"""`mmsplit conformance` against our services passes every check, and against
a server that breaks the contract (every Generate ends INTERNAL without an
ErrorInfo) exits non-zero, naming the checks that failed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mmsplit.common.v1 import common_pb2
from mmsplit.conformance import CLIENT_ERRORS, HEALTH_SERVICE, TOKENIZER_SERVICE
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.conftest import ROOT, Services
from tests.e2e.helpers import scheduler_info
from tests.support.leaks import wait_until

pytestmark = pytest.mark.e2e


def conformance(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mmsplit_cli", "conformance", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def verdicts(output: str) -> dict[str, str]:
    rows = [line.split() for line in output.splitlines() if line.startswith(("tokenizer.", "scheduler."))]
    return {" ".join(row[: row.index(v)]): v for row in rows for v in ("PASS", "FAIL", "SKIP") if v in row[1:]}


def test_our_services_pass_every_check(services: Services) -> None:
    # The kit wants an idle server: nothing of an earlier test still running.
    idle = lambda: scheduler_info(services.scheduler_address).running_requests == 0  # noqa: E731
    assert wait_until(idle, timeout=30)
    run = conformance(
        "--tokenizer",
        services.tokenizer_address,
        "--scheduler",
        services.scheduler_address,
        "--not-found-url",
        "no-such-file.png",  # inside the pair's --allowed-media-dir
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = verdicts(run.stdout)
    assert len(got) >= 30, run.stdout
    assert set(got.values()) == {"PASS"}, run.stdout
    for name in (
        "tokenizer.error.MEDIA_NOT_FOUND",
        "tokenizer.cancel_propagates",
        "scheduler.deadline_propagates",
        "tokenizer.stream.choice",
        "tokenizer.stream.split_reasoning",
    ):
        assert got[name] == "PASS"
    said = next(line for line in run.stdout.splitlines() if line.startswith("tokenizer.stream.split_reasoning "))
    assert "no reasoning parser (says none)" in said, said
    # Reflection is asked as v1 first (its current name), which ours serves.
    listed = next(line for line in run.stdout.splitlines() if line.startswith("tokenizer.reflection "))
    assert "grpc.reflection.v1.ServerReflection" in listed, listed


def test_a_tokenizer_alone_passes_its_checks(services: Services) -> None:
    """As against a public front end, whose scheduler is out of reach: the
    kit sees the scheduler only through the tokenizer's view of it (a few
    seconds old), which its cancel and deadline checks count on."""
    idle = lambda: scheduler_info(services.scheduler_address).running_requests == 0  # noqa: E731
    assert wait_until(idle, timeout=30)
    run = conformance("--tokenizer", services.tokenizer_address, "--not-found-url", "no-such-file.png")
    assert run.returncode == 0, run.stdout + run.stderr
    got = verdicts(run.stdout)
    assert not any(name.startswith("scheduler.") for name in got), run.stdout
    assert len(got) >= 20, run.stdout
    assert set(got.values()) == {"PASS"}, run.stdout
    for name in ("tokenizer.cancel_propagates", "tokenizer.deadline_propagates", "tokenizer.error.MEDIA_NOT_FOUND"):
        assert got[name] == "PASS", run.stdout


class WrongTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Answers GetServerInfo well, and ends every Generate with a bare
    INTERNAL: no ErrorInfo, whatever the input."""

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        context.abort(grpc.StatusCode.INTERNAL, "something went wrong")

    def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        transports = [common_pb2.TRANSPORT_INLINE]
        return tokenizer_pb2.GetServerInfoResponse(
            info=common_pb2.ServerInfo(model="wrong", tp_size=1, version="0", transports=transports),
            scheduler=common_pb2.ServerInfo(model="wrong", tp_size=1, version="0", transports=transports),
            transport=common_pb2.TRANSPORT_INLINE,
        )


@pytest.fixture
def wrong_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(WrongTokenizer(), server)
    checker = health.HealthServicer()
    for name in ("", TOKENIZER_SERVICE):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection([TOKENIZER_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def test_a_server_that_breaks_the_contract_fails_naming_the_checks(wrong_server: str) -> None:
    run = conformance("--tokenizer", wrong_server, "--timeout", "10")
    assert run.returncode == 1, run.stdout + run.stderr
    got = verdicts(run.stdout)
    # What it does right passes...
    for name in ("tokenizer.health.live", "tokenizer.health.ready", "tokenizer.reflection", "tokenizer.server_info"):
        assert got[name] == "PASS", run.stdout
    # Its reflection is grpcio's, v1alpha alone: asked for v1, it answers UNIMPLEMENTED, and v1alpha passes.
    listed = next(line for line in run.stdout.splitlines() if line.startswith("tokenizer.reflection "))
    assert "grpc.reflection.v1alpha.ServerReflection" in listed, listed
    assert ".v1.ServerReflection" not in listed, listed
    # ...what it does wrong fails, each error check saying why.
    assert got["tokenizer.stream.events"] == "FAIL"
    assert got["tokenizer.stream.choice"] == "FAIL"
    errors = [line for line in run.stdout.splitlines() if line.startswith("tokenizer.error.")]
    errors = [line for line in errors if not line.startswith("tokenizer.error.MEDIA_NOT_FOUND ")]
    assert len(errors) == len(CLIENT_ERRORS) + 1, run.stdout  # and image_budget past the model's
    assert all(" FAIL " in line and "INTERNAL without a google.rpc.ErrorInfo" in line for line in errors), run.stdout
    assert got["tokenizer.error.MEDIA_NOT_FOUND"] == "SKIP"
    assert "failed" in run.stdout.splitlines()[-1]
