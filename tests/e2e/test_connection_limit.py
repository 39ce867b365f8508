"""`--max-connections`: past that many open connections on a public port,
a new one is closed at once, unread, so a flood of connections (idle
keep-alives, half-sent requests) cannot take the descriptors that requests
need; the connections already open go on, and once some close, new ones
are served again."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import Arg, FreePort, Pair
from tests.e2e.helpers import scrape, served_over_http
from tests.support.leaks import wait_until
from tests.support.origins import Origin, local_origin
from tests.support.services import ServiceProcess, started_tokenizer

pytestmark = pytest.mark.e2e
LIMIT = 4


@dataclass
class Limited:
    """A tokenizer of its own with --max-connections 4, its HTTP and
    metrics ports, and an origin it may fetch images from."""

    tok: ServiceProcess
    http: int
    metrics: int
    origin: Origin


@pytest.fixture(scope="module")
def limited(services: Pair, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    http, metrics = FreePort(), FreePort()
    with local_origin(samples.good_png(seed=21)) as origin:
        extra: list[Arg] = ["--max-connections", str(LIMIT), "--http-port", http, "--metrics-port", metrics]
        extra += ["--private-fetch-exempt", origin.address]
        log = tmp_path_factory.mktemp("limited") / "tok.log"
        tok = started_tokenizer(tiny_model, services.scheduler_address, log, extra=extra)
        try:
            yield Limited(tok, http.number, metrics.number, origin)
        finally:
            tok.stop()


def _accepted(port: int, sockets: list[socket.socket]) -> bool:
    """Open a TCP connection to the gRPC port; True (kept) when the server
    sends its HTTP/2 settings, False when it closes it unread."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    if not conn.recv(9):  # a SETTINGS frame's header, sent as the server accepts
        conn.close()
        return False
    sockets.append(conn)
    return True


def test_connections_past_the_limit_are_closed_unread_and_the_open_ones_go_on(limited: Limited) -> None:
    tok, http, metrics = limited.tok, limited.http, limited.metrics
    held: list[socket.socket] = []
    try:
        for _ in range(LIMIT):
            assert served_over_http(http, held)
        assert not served_over_http(http, held), "a connection past the limit was served"
        assert scrape(metrics)[("mmsplit_tokenizer_http_connections_refused_total", ())] >= 1
        assert scrape(metrics)[("mmsplit_tokenizer_http_connections", ())] == LIMIT
        # The open ones are served as before: a second request on each.
        for conn in held:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 ")
        held.pop().close()
        # Once the server sees it closed, a new connection is served: a completion through the SDK.
        assert wait_until(lambda: served_over_http(http, held), timeout=30)
        held.pop().close()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=5)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"min_tokens": 2})
        assert done.usage is not None
        assert done.usage.completion_tokens == 2
    finally:
        for conn in held:
            conn.close()
    assert "connection(s) open, the limit (--max-connections)" in tok.log_path.read_text()


def test_grpc_connections_past_the_limit_are_refused_and_served_again_after(limited: Limited) -> None:
    tok = limited.tok
    assert tok.port is not None
    held: list[socket.socket] = []
    try:
        # The health check that found the service SERVING may hold its
        # connection a moment longer: until the server has let it go, a
        # connection past the limit is closed, and is tried again.
        for _ in range(LIMIT):
            assert wait_until(lambda: _accepted(tok.port, held), timeout=30)
        assert not _accepted(tok.port, held), "a connection past the limit was accepted"
        refused = _generate(tok.address)
        assert refused.grpc_code == "UNAVAILABLE", refused
    finally:
        for conn in held:
            conn.close()
    # Once the server sees them closed (a moment), a new connection is served.
    outcomes: list[Outcome] = []

    def served() -> bool:
        outcomes.append(_generate(tok.address))
        return outcomes[-1].ok

    assert wait_until(served, timeout=30, interval=0.2), outcomes[-1]
    assert len(outcomes[-1].token_ids) == 2, outcomes[-1]


def test_a_flood_of_connections_leaves_the_descriptors_requests_need(limited: Limited) -> None:
    """With the open-file limit lowered to 1,024, 1,100 connections to the
    HTTP port. Without the limit they took every descriptor (accept failing
    with EMFILE, over and over in the log): a request on a gRPC connection
    opened before failed to fetch its image (no descriptor left for the
    fetch's socket), and a new gRPC client could not connect. With it, all
    but 4 are closed unread (exactly 4 stay open) and both are served. (The last test here: the
    tokenizer keeps the lowered limit.)"""
    tok = limited.tok
    subprocess.run(["prlimit", "--pid", str(tok.pid), "--nofile=1024:1024"], check=True)
    flood: list[socket.socket] = []
    with grpc.insecure_channel(tok.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        assert run_request(stub, make_request("Hi", max_tokens=1)).ok  # the connection, open before the flood
        try:
            for _ in range(1100):
                flood.append(socket.create_connection(("127.0.0.1", limited.http), timeout=30))
            # Exactly the limit open, however fast they came (aiohttp counts
            # a connection a turn of the event loop after its accept).
            assert scrape(limited.metrics)[("mmsplit_tokenizer_http_connections", ())] == LIMIT
            hits = limited.origin.hits
            fetched = run_request(stub, make_request("Hi", urls=[limited.origin.url("flood.png")], max_tokens=2))
            assert fetched.ok, fetched
            assert limited.origin.hits > hits
            newcomer = _generate(tok.address)
            assert newcomer.ok, newcomer
        finally:
            for conn in flood:
                conn.close()
    assert "Too many open files" not in tok.log_path.read_text()


def _generate(address: str) -> Outcome:
    """One request of two tokens over a new channel."""
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return run_request(stub, make_request("Hi", max_tokens=2, min_tokens=2), timeout=30)
