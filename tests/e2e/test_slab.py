"""The shared-memory slab (`mmsplit_server.handoff.slab`) through the real services.

- Under a 2,000-request mixed load on the shared pair (distinct images
  through the workers, repeats from the preprocessing cache, corrupt images,
  text only), /dev/shm holds exactly the tokenizer's slab the whole time:
  no segment per tensor. Afterwards no slice is held.
- A slab too small for a burst: every request succeeds or fails OVERLOADED
  (retriable), nothing else; afterwards nothing is held, the next request
  succeeds and health is SERVING. The slab goes with the tokenizer's stop.
- A first request whose other image fails while the slab is being made
  (the request is cancelled then): one slab in all, made once, and none
  after the stop.
(A worker SIGKILLed mid-write: tests/e2e/test_pool.py. Locks, allocation and
hand-over: tests/shared/test_slab.py.)
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from tests.conftest import HOLDING_LIMIT, HOLDING_TOKENS, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, tokenizer_info
from tests.support.leaks import PROJECT_PREFIX, live_grants, wait_until
from tests.support.services import running_pair

pytestmark = pytest.mark.e2e
REQUESTS = 2000


def segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{pid}-")}


def test_under_a_2000_request_mixed_load_dev_shm_holds_exactly_the_slab_and_the_grants(services: Services) -> None:
    pid = services.tokenizer.pid
    # 10 % corrupt images, 10 % text only, the rest images: 200 distinct
    # ones (through the workers) and repeats of them (from the cache).
    # Small JPEGs (about 20 KB): the pixel tensors are the model's size
    # whatever the file's, and the client's cost stays small.
    images = [samples.encode(samples.gradient(320, 240, seed=10_000 + i), "JPEG") for i in range(200)]
    corrupt = samples.good_png(seed=1)[:300]

    def request(i: int) -> tokenizer_pb2.GenerateRequest:
        if i % 10 == 3:
            return make_request("Look.", [corrupt], max_tokens=1)
        if i % 10 == 7:
            return make_request("Say something.", max_tokens=1)
        return make_request("Look.", [images[i % 200]], max_tokens=1)

    seen: set[frozenset[str]] = set()
    polls = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal polls
        while not done.is_set():
            seen.add(frozenset(segments_of(pid)))
            polls += 1
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # One asyncio client, 32 requests at a time: a client of threads cost
        # the two cores more than the services did.
        started = time.monotonic()
        reasons = asyncio.run(_drive(services.tokenizer_address, [request(i) for i in range(REQUESTS)], 32))
        load_s = time.monotonic() - started
    finally:
        done.set()
        watcher.join()
    expected = ["MEDIA_DECODE_FAILED" if i % 10 == 3 else "" for i in range(REQUESTS)]
    assert reasons == expected
    info = tokenizer_info(services.tokenizer_address).info
    slab = f"{PROJECT_PREFIX}-{pid}-slab"
    assert info.shm_slab_bytes == 128 << 20
    # A poll every 20 ms: at least a quarter of those the load had time for
    # (a fixed count would fail on a machine fast enough to finish early).
    assert polls > 10, "the watcher did not run during the load"
    assert polls >= load_s / 0.02 / 4, ("the watcher was starved during the load", polls, load_s)
    names = set().union(*seen)
    # The slab and the grant table (`mmsplit_server.handoff.grants`), made once, whose
    # entries all end with their requests.
    assert len(names) == 2, f"not only the slab and the grant table: {sorted(names)[:5]}"
    (table,) = {n for n in names if "-grant" in n}
    assert wait_until(lambda: not live_grants(table), timeout=10), f"{live_grants(table)} grants outlived requests"
    assert (names - {table}).pop().startswith(slab)
    assert wait_until(lambda: tokenizer_info(services.tokenizer_address).info.shm_slab_used_bytes == 0, timeout=10)
    assert health_status(services.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"


async def _drive(address: str, requests: list[tokenizer_pb2.GenerateRequest], at_once: int) -> list[str]:
    """Each request's outcome: "" for success, else its ErrorCode name."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        slots = asyncio.Semaphore(at_once)

        async def one(request: tokenizer_pb2.GenerateRequest) -> str:
            async with slots:
                try:
                    async for _ in stub.Generate(request, timeout=120):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return RemoteError.from_rpc_error(exc).reason
                return ""

        return list(await asyncio.gather(*(one(r) for r in requests)))


def test_a_full_slab_is_overloaded_and_nothing_else(long_context_model: Path, tmp_path: Path) -> None:
    """A slab of four tiny-LLaVA tensors (600 KB each), a scheduler running
    one request at a time, busy with a long one: a burst of 11 queues behind
    it, and queued requests hold their slices until their first step, so
    the burst fills the slab. Those that find no room within 0.3 s are
    OVERLOADED (retriable by the error table); the others succeed. (With a
    context of 1,024 the long request once ended by itself before a busy
    host had sent the burst: none was refused.)"""
    slab_bytes = 40 << 16  # 40 pages of 64 KiB; its largest slice, a quarter, takes one tensor
    extra = ["--shm-slab-bytes", str(slab_bytes), "--shm-slab-wait-s", "0.3", "--preprocess-cache-bytes", "0"]
    with running_pair(
        long_context_model,
        tmp_path,
        scheduler_extra=["--tp", "1", "--max-running", "1", *HOLDING_LIMIT],
        tokenizer_extra=[*extra, *HOLDING_LIMIT],
    ) as pair:
        burst = [make_request(f"x{i}", [samples.good_png(seed=i)], max_tokens=2) for i in range(11)]
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            # min_tokens: the running request holds the line until it is cancelled.
            holding = make_request("Go on.", max_tokens=HOLDING_TOKENS, min_tokens=HOLDING_TOKENS, request_id="long")
            long = stub.Generate(holding)
            assert next(iter(long)).HasField("delta")
            with ThreadPoolExecutor(11) as pool:
                futures = [pool.submit(run_request, stub, r, 120) for r in burst]
                assert wait_until(lambda: sum(f.done() for f in futures) >= 7, timeout=60)
                long.cancel()
                results: list[Outcome] = [f.result() for f in futures]
            reasons = [r.reason for r in results if not r.ok]
            assert reasons, "the burst never filled the slab"
            assert set(reasons) == {"OVERLOADED"}, reasons
            assert "shared-memory slab" in next(r.message for r in results if not r.ok)
            info = tokenizer_info(pair.tokenizer_address).info
            assert info.shm_slab_bytes == slab_bytes
            assert wait_until(lambda: tokenizer_info(pair.tokenizer_address).info.shm_slab_used_bytes == 0, 10)
            mine = segments_of(pair.tokenizer.pid)
            assert mine == {n for n in mine if "-slab" in n or ("-grant" in n and not live_grants(n))}
            assert run_request(stub, make_request("again", [samples.good_png(seed=99)], max_tokens=2)).ok
            assert health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING"
        pid = pair.tokenizer.pid
    assert not segments_of(pid), "the slab outlived its tokenizer"


def test_a_request_cancelled_while_the_slab_is_made_leaves_no_second_slab(tiny_model: Path, tmp_path: Path) -> None:
    """The first shared-memory request makes the slab (a 128 MiB fallocate,
    tens of ms). A data URL that is not base64 beside a good image fails at
    once, before any slab is needed, which cancels the good image's work
    while the slab is being made: the slab is still recorded, so the next
    request uses it instead of making another (the first would stay in
    /dev/shm, unowned by any code, until the tokenizer's pid is reused or a
    janitor outlives it)."""
    with running_pair(tiny_model, tmp_path, scheduler_extra=["--tp", "1"]) as pair:
        pid = pair.tokenizer.pid
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            first = make_request("<image> <image>", [samples.good_png()], max_tokens=1)
            first.images.add(url="data:image/png;base64,@@@")
            failed = run_request(stub, first)
            assert failed.reason == "INVALID_REQUEST", failed
            assert run_request(stub, make_request("Look.", [samples.good_png(seed=3)], max_tokens=1)).ok
        # The cancelled request's slab is made in a thread: it may land after the answer.
        time.sleep(1.0)
        slabs = {n for n in segments_of(pid) if "-slab" in n}
        assert len(slabs) == 1, f"{len(slabs)} slabs: {sorted(slabs)}"
        log = (tmp_path / "tokenizer.log").read_text()
        assert log.count("shared-memory slab") == 1
    assert not segments_of(pid), "a slab outlived its tokenizer"
