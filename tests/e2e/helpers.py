"""Small helpers for the end-to-end tests."""

from __future__ import annotations

import io
import socket
import threading
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from mmsplit.common.v1 import common_pb2
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli.client import Outcome, make_request, run_request
from tests.support import family_kit
from tests.support.leaks import wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import SCHEDULER_SERVICE, Pair


def tokenizer_stub(channel: grpc.Channel) -> tokenizer_pb2_grpc.TokenizerServiceStub:
    return tokenizer_pb2_grpc.TokenizerServiceStub(channel)


# The deadline of these reads. Short by default: some tests read a server
# they froze (SIGSTOP) and expect to be told quickly. A test that reads a
# busy server (a storm just ended, a loaded host) passes a longer one.
READ_TIMEOUT_S = 5.0


def tokenizer_info(address: str, timeout: float = READ_TIMEOUT_S) -> tokenizer_pb2.GetServerInfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=timeout)


def health_status(address: str, service: str, timeout: float = READ_TIMEOUT_S) -> str:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def scheduler_info(scheduler_address: str, timeout: float = READ_TIMEOUT_S) -> common_pb2.ServerInfo:
    with scheduler_channel(scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return stub.GetServerInfo(scheduler_pb2.GetServerInfoRequest(), timeout=timeout).info


def rank_active_requests(scheduler_address: str, timeout: float = READ_TIMEOUT_S) -> list[int]:
    return list(scheduler_info(scheduler_address, timeout).rank_active_requests)


def exposition(port: int) -> str:
    """A service's /metrics text."""
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, keyed by (name, sorted labels); parsing fails on a format error."""
    text = exposition(port)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def rank_processes(scheduler_pid: int) -> list[psutil.Process]:
    """Ranks 1..N-1 of a local group, in rank order: rank 0's children that
    call themselves mmsplit-rankN (forked or spawned, `scheduler_svc.group`)."""
    ranks = [p for p in psutil.Process(scheduler_pid).children() if p.name().startswith("mmsplit-rank")]
    return sorted(ranks, key=lambda p: int(p.name().removeprefix("mmsplit-rank")))


def png(height: int, width: int, seed: int) -> bytes:
    """A PNG of random pixels."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def sent_together(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub,
    requests: Sequence[tokenizer_pb2.GenerateRequest],
    timeout: float = 120,
) -> list[Outcome]:
    """Each request from a thread of its own, all let go at once (so that
    they share the scheduler's steps); their outcomes, in order."""
    barrier = threading.Barrier(len(requests))

    def send(request: tokenizer_pb2.GenerateRequest) -> Outcome:
        barrier.wait()
        return run_request(stub, request, timeout=timeout)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, requests))


def the_group_went_on(pair: Pair, pid: int) -> None:
    """After one request failed alone: the scheduler kept its process (`pid`),
    serves, and no rank still holds a request."""
    assert pair.scheduler.pid == pid
    assert pair.scheduler.proc.poll() is None
    assert health_status(pair.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def served_over_http(port: int, sockets: list[socket.socket], source: str | None = None) -> bool:
    """Open a connection to the HTTP port on 127.0.0.1 (from `source`, an
    address of the loopback network, if given) and ask for /health on it;
    True (and the connection kept in `sockets`) when an answer comes, False
    when the server closes it unread (a reset, or an end)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0) if source else None)
    try:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = conn.recv(4096)
    except (ConnectionResetError, BrokenPipeError):  # closed with our request unread: the kernel resets
        answer = b""
    if not answer:
        conn.close()
        return False
    assert answer.startswith(b"HTTP/1.1 "), answer
    sockets.append(conn)
    return True


def kept_of_one_image(pair: Pair, kit: family_kit.Kit, image: bytes) -> int:
    """The bytes the pair's tokenizer keeps in its preprocessing cache for
    `image` (one never sent before), a request of it answered: the item's
    tensors as its worker made them and sent them on."""
    before = tokenizer_info(pair.tokenizer_address).info.preprocess_cache_bytes
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        outcome = run_request(stub, make_request(f"What is in {kit.marker}?", [image], max_tokens=2), timeout=120)
    assert outcome.ok, outcome
    return tokenizer_info(pair.tokenizer_address).info.preprocess_cache_bytes - before


def kit_rows_bytes(kit: family_kit.Kit, image: bytes, *, one_frame: bool) -> int:
    """The bytes of `image`'s item tensors as the model's processor makes them."""
    from PIL import Image

    ((rows, _),) = kit.items([Image.open(io.BytesIO(image)).convert("RGB")], one_frame=one_frame)
    return sum(array.nbytes for array in rows.values())
