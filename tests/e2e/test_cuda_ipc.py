"""The CUDA-IPC transport through the real services, on the fake GPU
(`tests/support/fake_device.py`, `--cuda-ipc-backend` on both services):
everything but the device copy runs as it would on a GPU — the transport
choice by device UUID, staging into the tokenizer's pool, the lease map's
hand-over and release after the agreement, the accounting.

The shared TP=2 group (its scheduler opens the fake GPU's handles, and its
reader fails on request) and a tokenizer of this module's that stages into
a 1 MiB pool (a tiny-LLaVA image is 600 KB: one at a time) and sweeps
unowned segments every second.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from mmsplit_cli.launch import ServiceProcess, tokenizer_args
from tests.conftest import SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests, scheduler_info
from tests.support import fake_device
from tests.support.faults import failing_request_id
from tests.support.leaks import PROJECT_PREFIX, wait_until
from tests.support.services import ENV

pytestmark = pytest.mark.e2e
FAKE = ["--cuda-ipc-backend", "tests.support.fake_device:make", "--cuda-ipc-pool-bytes", str(1 << 20)]


@pytest.fixture(scope="module")
def tokenizer(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    extra = [*FAKE, "--shm-slab-wait-s", "5", "--janitor-interval-s", "1", "--segment-grace-s", "1"]
    logs = tmp_path_factory.mktemp("cuda-ipc")
    tok = ServiceProcess(
        "tokenizer",
        tokenizer_args(services.model, services.scheduler_address, extra=extra),
        logs / "tokenizer.log",
        env=ENV,
    )
    try:
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        yield tok
    finally:
        assert tok.stop() == 0


def info(address: str) -> tokenizer_pb2.GetServerInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetServerInfo(
            tokenizer_pb2.GetServerInfoRequest(), timeout=5
        )


def test_the_same_gpu_is_seen_and_tokens_equal_shared_memory(tokenizer: ServiceProcess, services: Services) -> None:
    got = info(tokenizer.address)
    assert got.transport == common_pb2.TRANSPORT_CUDA_IPC
    assert list(got.info.cuda_device_uuids) == [fake_device.uuid()]
    assert list(got.scheduler.cuda_device_uuids) == [fake_device.uuid()]
    assert got.info.cuda_ipc_pool_bytes == 1 << 20
    assert info(services.tokenizer_address).transport == common_pb2.TRANSPORT_SHM, "no pool: shared memory"
    images = [samples.good_png(seed=777), samples.good_jpeg(seed=778)]

    def ask(address: str, image: bytes) -> list[int]:
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            out = run_request(stub, make_request("Describe it.", [image], max_tokens=6), timeout=60)
        assert out.ok, out
        return out.token_ids

    for image in images:
        assert ask(tokenizer.address, image) == ask(services.tokenizer_address, image)
    assert wait_until(lambda: info(tokenizer.address).info.cuda_ipc_pool_used_bytes == 0, timeout=10)


def test_a_read_failure_on_rank_1_fails_only_its_request(tokenizer: ServiceProcess) -> None:
    results = {}
    barrier = threading.Barrier(2)

    def send(rid: str, seed: int) -> None:
        with grpc.insecure_channel(tokenizer.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            barrier.wait()
            request = make_request("Look.", [samples.good_png(seed=seed)], max_tokens=3, request_id=rid)
            results[rid] = run_request(stub, request, timeout=60)

    bad, good = failing_request_id(1, "ipc"), "ipc-good"
    threads = [threading.Thread(target=send, args=(bad, 801)), threading.Thread(target=send, args=(good, 802))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results[bad].reason == "FEATURE_TRANSPORT_FAILED"
    assert results[bad].metadata.get("failed_ranks") == "1"
    assert results[good].ok, results[good]
    assert wait_until(lambda: info(tokenizer.address).info.cuda_ipc_pool_used_bytes == 0, timeout=10)


def test_a_cancelled_request_leaves_the_pool_empty(tokenizer: ServiceProcess, services: Services) -> None:
    with grpc.insecure_channel(tokenizer.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        call = stub.Generate(make_request("Tell a long story.", [samples.good_png(seed=803)], max_tokens=500))
        events = iter(call)
        assert next(events).HasField("delta")
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(events)
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert wait_until(lambda: info(tokenizer.address).info.cuda_ipc_pool_used_bytes == 0, timeout=10)


def test_a_killed_tokenizer_leaves_nothing_after_one_janitor_pass(
    tokenizer: ServiceProcess, services: Services, tmp_path: Path
) -> None:
    """Another tokenizer with a pool, SIGKILLed with a request in flight:
    the ranges of its pool go with the locks of whoever held them; its fake
    device memory and lease map, owned by nobody now, are removed by the
    janitor of this module's tokenizer. The group serves on."""
    args = tokenizer_args(services.model, services.scheduler_address, extra=FAKE)
    doomed = ServiceProcess("tokenizer", args, tmp_path / "doomed.log", env=ENV)
    try:
        doomed.wait_serving(TOKENIZER_SERVICE, 180)
        assert info(doomed.address).transport == common_pb2.TRANSPORT_CUDA_IPC
        started = threading.Event()

        def long_request() -> None:
            with grpc.insecure_channel(doomed.address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
                call = stub.Generate(make_request("Go on.", [samples.good_png(seed=804)], max_tokens=800))
                try:
                    for _ in call:
                        started.set()
                except grpc.RpcError:
                    pass  # it is killed: the call fails

        thread = threading.Thread(target=long_request)
        thread.start()
        assert started.wait(60)

        def left() -> list[str]:
            return [n for n in os.listdir("/dev/shm") if n.startswith(f"{PROJECT_PREFIX}-{doomed.pid}-")]

        assert len(left()) == 3, left()  # its fake device memory, its pool's lease map and its grant table
        pools = lambda: scheduler_info(services.scheduler_address).cuda_ipc_open_pools  # noqa: E731
        opened = pools()  # its pool among them: its request was read
        assert opened >= 1
        os.kill(doomed.pid, signal.SIGKILL)
        thread.join(60)
        assert wait_until(lambda: not left(), timeout=15), left()
        # Its lease map gone, every rank closes its pool (rank 0's count is published).
        assert wait_until(lambda: pools() == opened - 1, timeout=15), (opened, pools())
    finally:
        doomed.stop()
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    with grpc.insecure_channel(tokenizer.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        assert run_request(stub, make_request("Again.", [samples.good_png(seed=805)], max_tokens=2)).ok
