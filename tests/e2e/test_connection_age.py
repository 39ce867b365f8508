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
from mmsplit_cli.client import make_request, run_request
from tests.conftest import TOKENIZER_SERVICE, Services
from tests.support.services import ENV, ServiceProcess, tokenizer_args

pytestmark = pytest.mark.e2e
AGE_S = 1.0
LONG = 600  # tokens: seconds here (TP=2 on the CPU), well past the age


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
    args = tokenizer_args(tiny_model, services.scheduler_address, extra=["--max-connection-age-s", str(AGE_S)])
    tok = ServiceProcess("tokenizer", args, tmp_path / "tokenizer.log", env=ENV)
    try:
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        assert tok.port is not None
        with grpc.insecure_channel(tok.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            started = time.monotonic()
            outcome = []
            long = threading.Thread(
                target=lambda: outcome.append(
                    run_request(stub, make_request("Go on.", max_tokens=LONG, min_tokens=LONG), timeout=120)
                )
            )
            long.start()
            # Past the age (and gRPC's +10 % of it): the long call's connection has had its GOAWAY.
            time.sleep(max(0.0, started + 1.5 * AGE_S - time.monotonic()))
            short = run_request(stub, make_request("Hi.", max_tokens=2), timeout=60)
            assert short.ok, short
            assert not outcome, "the long call ended before the check: make it longer"
            # The short call went on a new connection; the old one stays for the long call.
            assert connections_to(tok.port) == 2
            long.join(120)
        (done,) = outcome
        assert done.ok, done
        assert len(done.token_ids) == LONG
    finally:
        tok.stop()
