"""`--max-inflight-per-client`: one client (an API key over HTTP, else an
address) with that many requests in progress gets OVERLOADED for its next
one, while other clients are served; once its requests end it is served
again. Without the flag nothing is counted by client."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import FreePort, Pair
from tests.e2e.helpers import scrape, served_over_http
from tests.support.leaks import wait_until
from tests.support.services import ServiceProcess, started_tokenizer
from tokenizer_svc.server import client_address

pytestmark = pytest.mark.e2e
LIMIT = 2
KEYS = ("sk-client-a", "sk-client-b")
# Long enough to be in progress while the test sends the next requests (a
# stream is left unread meanwhile), short enough to end soon once closed.
LONG = {"max_tokens": 300, "extra_body": {"min_tokens": 300}}
MODEL = "tiny-llava"  # the directory's name, as the API serves it


@dataclass
class Limited:
    tok: ServiceProcess
    http: int
    metrics: int

    def client(self, key: str) -> openai.OpenAI:
        # No retries: a 429 is what the test looks for, not something to wait out.
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key=key, max_retries=0)

    def refusals(self) -> float:
        return scrape(self.metrics)[("mmsplit_tokenizer_client_limit_refusals_total", ())]


@contextlib.contextmanager
def _limited_tokenizer(services: Pair, model: Path, logs: Path, extra: list[str]) -> Iterator[Limited]:
    """A tokenizer of its own in front of the shared scheduler, with `extra`,
    an HTTP port and a metrics port."""
    http, metrics = FreePort(), FreePort()
    ports = ["--http-port", http, "--metrics-port", metrics]
    tok = started_tokenizer(model, services.scheduler_address, logs / "tok.log", extra=[*extra, *ports])
    try:
        yield Limited(tok, http.number, metrics.number)
    finally:
        tok.stop()


@pytest.fixture(scope="module")
def limited(services: Pair, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    logs = tmp_path_factory.mktemp("client-limit")
    (logs / "keys").write_text("\n".join(KEYS) + "\n")
    extra = ["--max-inflight-per-client", str(LIMIT), "--api-key-file", str(logs / "keys")]
    with _limited_tokenizer(services, tiny_model, logs, extra) as tok:
        yield tok


def _started(client: openai.OpenAI, prompt: str) -> Any:
    """A streamed completion whose first chunk has come: in progress."""
    stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, **LONG)
    next(iter(stream))
    return stream


def test_a_client_at_its_limit_is_refused_while_another_is_served(limited: Limited) -> None:
    a, b = limited.client(KEYS[0]), limited.client(KEYS[1])
    before = limited.refusals()
    streams = [_started(a, "Count to a thousand:"), _started(a, "Name every colour:")]
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            a.completions.create(model=MODEL, prompt="One more", max_tokens=2)
        assert refused.value.body["code"] == "OVERLOADED", refused.value.body  # type: ignore[index]
        assert "this client has 2 requests in flight, the limit per client is 2" in str(refused.value)
        # Another key is another client: served while the first is at its limit.
        other = b.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert other.choices[0].finish_reason == "length"
        assert limited.refusals() == before + 1
    finally:
        for stream in streams:
            stream.close()

    def served_again() -> bool:
        try:
            a.completions.create(model=MODEL, prompt="Again", max_tokens=2)
        except openai.RateLimitError:
            return False  # its closed streams not yet ended in the tokenizer
        return True

    assert wait_until(served_again, timeout=60)
    assert scrape(limited.metrics)[("mmsplit_tokenizer_clients_in_flight", ())] == 0


def test_over_grpc_a_client_is_its_address(limited: Limited) -> None:
    with grpc.insecure_channel(limited.tok.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        calls = []
        try:
            for prompt in ("Count to a thousand:", "Name every colour:"):
                call = stub.Generate(make_request(prompt, max_tokens=300, min_tokens=300))
                calls.append(call)
                next(r for r in call if r.HasField("delta"))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(make_request("One more", max_tokens=2)))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the limit per client is 2" in refused.value.details()
        finally:
            for call in calls:
                call.cancel()
        # Its requests ended (cancelled), the address is served again.
        assert wait_until(lambda: scrape(limited.metrics)[("mmsplit_tokenizer_clients_in_flight", ())] == 0, 60)
        finished = list(stub.Generate(make_request("Again", max_tokens=2)))
        assert finished[-1].HasField("finished")


@pytest.fixture(scope="module")
def behind_a_proxy(services: Pair, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    """A tokenizer without API keys that trusts 127.0.0.1 as a proxy, at
    most 2 requests and 2 HTTP connections per client."""
    extra = ["--max-inflight-per-client", str(LIMIT), "--max-connections-per-client", str(LIMIT)]
    extra += ["--forwarded-allow-ips", "127.0.0.1"]
    with _limited_tokenizer(services, tiny_model, tmp_path_factory.mktemp("client-limit-proxy"), extra) as tok:
        yield tok


def test_behind_a_trusted_proxy_a_client_is_the_address_it_forwards(behind_a_proxy: Limited) -> None:
    """Every request comes from 127.0.0.1 here, the proxy; X-Forwarded-For
    tells its clients apart (what a client wrote itself, left of the hop
    the proxy added, is not read)."""

    def client(forwarded: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{behind_a_proxy.http}/v1", api_key="none", max_retries=0,
            default_headers={"X-Forwarded-For": forwarded},
        )  # fmt: skip

    first = client("203.0.113.5")
    streams = [_started(first, "Count to a thousand:"), _started(client("9.9.9.9, 203.0.113.5"), "Name every colour:")]
    try:
        with pytest.raises(openai.RateLimitError):
            first.completions.create(model=MODEL, prompt="One more", max_tokens=2)
        other = client("203.0.113.6").completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert other.choices[0].finish_reason == "length"
    finally:
        for stream in streams:
            stream.close()


def test_an_address_at_its_connection_limit_is_closed_unread_while_others_connect(behind_a_proxy: Limited) -> None:
    port = behind_a_proxy.http
    sockets: list[socket.socket] = []
    refused = ("mmsplit_tokenizer_http_connections_refused_per_client_total", ())
    try:
        assert served_over_http(port, sockets, "127.0.0.2")
        assert served_over_http(port, sockets, "127.0.0.2")
        assert not served_over_http(port, sockets, "127.0.0.2")  # its third: closed unread
        assert served_over_http(port, sockets, "127.0.0.3")  # another address
        assert all(served_over_http(port, sockets, "127.0.0.1") for _ in range(4))  # the trusted proxy: not limited
        assert scrape(behind_a_proxy.metrics)[refused] == 1
        sockets.pop(0).close()
        # Once the server has let the closed one go, the address connects again.
        assert wait_until(lambda: served_over_http(port, sockets, "127.0.0.2"), timeout=30)
    finally:
        for conn in sockets:
            conn.close()


def test_a_grpc_peer_is_named_by_its_address_without_the_port() -> None:
    assert client_address("ipv4:10.0.0.7:51234") == "addr:10.0.0.7"
    assert client_address("ipv6:[::1]:5") == "addr:::1"
    assert client_address("unix:/tmp/s") == "peer:unix:/tmp/s"
