"""`--max-connection-age-s`: a client's connection older than that is asked
to go (HTTP/2 GOAWAY). A call running on it goes on to its end; the
client's next call opens a new connection (which a Kubernetes Service may
send to another tokenizer: how clients spread over tokenizers the
autoscaler added)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from tests.conftest import TOKENIZER_SERVICE, Services
from tests.support.origins import local_origin
from tests.support.services import ENV, ServiceProcess, tokenizer_args

pytestmark = pytest.mark.e2e
AGE_S = 1.0


def connections_to(port: int) -> int:
    """This process's established TCP connections to `port` on loopback."""
    return sum(
        1
        for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
    )


def test_an_aged_connection_is_replaced_and_its_running_call_finishes(
    services: Services, tiny_model: Path, tmp_path: Path
) -> None:
    # The call that outlives its connection's age waits on an origin that
    # answers once the test releases it.
    with local_origin(samples.good_png(seed=5), held=True) as origin:
        extra = [
            "--max-connection-age-s", str(AGE_S),
            "--private-fetch-exempt", origin.address,
            "--fetch-timeout-s", "60",
        ]  # fmt: skip
        args = tokenizer_args(tiny_model, services.scheduler_address, extra=extra)
        tok = ServiceProcess("tokenizer", args, tmp_path / "tokenizer.log", env=ENV)
        try:
            tok.wait_serving(TOKENIZER_SERVICE, 180)
            assert tok.port is not None
            with grpc.insecure_channel(tok.address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
                started = time.monotonic()
                outcome: list[Outcome] = []
                held = make_request("Go on.", urls=[origin.url("held.png")], max_tokens=8, min_tokens=8)
                long = threading.Thread(target=lambda: outcome.append(run_request(stub, held, timeout=120)))
                long.start()
                assert origin.asked.wait(60), "the held call never fetched"
                # Past the age (and gRPC's +10 % of it): the held call's connection has had its GOAWAY.
                time.sleep(max(0.0, started + 1.5 * AGE_S - time.monotonic()))
                short = run_request(stub, make_request("Hi.", max_tokens=2), timeout=60)
                assert short.ok, short
                assert not outcome, "the held call ended before its origin answered"
                # The short call went on a new connection; the old one stays for the held call.
                assert connections_to(tok.port) == 2
                origin.release.set()
                long.join(120)
            (done,) = outcome
            assert done.ok, done
            assert len(done.token_ids) == 8
        finally:
            tok.stop()
