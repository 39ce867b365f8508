"""Who owns a segment, when /dev/shm is shared with strangers and pids lie:
things planted under segment names fail their request only; two tokenizers
in separate pid namespaces sharing /dev/shm never sweep each other's live
segments; a scheduler killed with requests queued leaves nothing after one
janitor pass of its successor."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import ServiceProcess, tokenizer_args
from mmsplit_server.handoff import files
from scheduler_svc.model import model_info
from tests.conftest import HOLDING_LIMIT, HOLDING_TOKENS, SCHEDULER_SERVICE, TOKENIZER_SERVICE, Services
from tests.e2e.helpers import health_status, rank_active_requests, scheduler_info
from tests.support.granting import grant_ref, grant_table
from tests.support.leaks import PROJECT_PREFIX, project_segments, wait_until
from tests.support.local_token import scheduler_channel
from tests.support.planted import planted as plant
from tests.support.services import ENV, start_scheduler

pytestmark = pytest.mark.e2e


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[dict[str, str]]:
    with plant(PROJECT_PREFIX, tmp_path, size=3 * 224 * 224 * 4) as made:
        yield made


def test_what_is_planted_under_a_segment_name_fails_its_request_only(services: Services, planted) -> None:  # type: ignore[no-untyped-def]
    info = model_info(services.model)
    ids = [1, *([info.image_token_id] * info.tokens_per_image), 22557]
    nbytes = int(np.prod(info.image_shape)) * 4
    expected = {
        "directory": "INVALID_REQUEST",
        "fifo": "INVALID_REQUEST",
        "symlink": "INVALID_REQUEST",
        "another user's file": "FEATURE_TRANSPORT_FAILED",
    }
    pid = services.scheduler.pid
    with scheduler_channel(services.scheduler_address) as channel, grant_table(PROJECT_PREFIX) as table:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for kind, name in planted.items():
            ref = common_pb2.TensorRef(
                dtype=common_pb2.DTYPE_FLOAT32,
                shape=info.image_shape,
                shm=common_pb2.ShmSlice(segment=name, offset=0, nbytes=nbytes),
            )
            grant_ref(ref, table)  # granted: what is planted under the name is what gets checked
            request = scheduler_pb2.GenerateRequest(request_id=f"planted-{uuid.uuid4().hex[:8]}", input_ids=ids)
            request.pixel_values.append(ref)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info_:
                list(stub.Generate(request, timeout=20))
            assert time.monotonic() - started < 10, f"{kind}: the request was held"
            assert RemoteError.from_rpc_error(info_.value).reason == expected[kind], kind
    # The group keeps serving; nothing planted was removed or followed.
    assert services.scheduler.pid == pid
    assert health_status(services.scheduler_address, SCHEDULER_SERVICE) == "SERVING"
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        good = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("Hi", max_tokens=2))
    assert good.ok, good
    assert all(os.path.lexists(files.SHM_DIR / name) for name in planted.values())
    assert wait_until(lambda: rank_active_requests(services.scheduler_address) == [0, 0], timeout=10)


def load(address: str, tag: str, n: int, stop: threading.Event | None = None) -> list[Outcome]:
    """`n` one-image requests from 4 clients; with `stop`, until it is set."""

    def one(i: int) -> Outcome:
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            request = make_request(f"{tag} {i}", [samples.good_png(seed=i % 5)], max_tokens=4, request_id=f"{tag}-{i}")
            return run_request(stub, request, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        if stop is None:
            return list(pool.map(one, range(n)))
        outcomes: list[Outcome] = []
        i = 0
        while not stop.is_set():
            outcomes.extend(pool.map(one, range(i, i + 4)))
            i += 4
        return outcomes


def test_two_tokenizers_in_separate_pid_namespaces_never_sweep_each_others_segments(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Both tokenizers are PID 1 of their own namespace, share /dev/shm and
    one scheduler (shared memory transport), and sweep every 0.3 s anything
    unlocked for 0.5 s. Under load, and while one of them stops, no request
    of the other fails; when both have stopped, no segment is left."""
    sched = start_scheduler(tiny_model, tmp_path / "scheduler.log", tp=1, extra=["--janitor-interval-s", "0.3"])
    tokenizers: list[ServiceProcess] = []
    try:
        port = sched.wait_bound(180)  # the port it drew; the tokenizers wait for it to serve by themselves
        janitor = ["--janitor-interval-s", "0.3", "--segment-grace-s", "0.5"]
        wrapper = [sys.executable, "-m", "tests.support.pidns"]
        for name in ("tokenizer-a", "tokenizer-b"):
            args = tokenizer_args(tiny_model, f"127.0.0.1:{port}", extra=janitor)
            tokenizers.append(ServiceProcess(name, args, tmp_path / f"{name}.log", env=ENV, wrapper=wrapper))
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        for tok in tokenizers:
            tok.wait_serving(TOKENIZER_SERVICE, 180)
        a, b = tokenizers
        assert "tensors go by TRANSPORT_SHM" in a.log_path.read_text()
        assert "tensors go by TRANSPORT_SHM" in b.log_path.read_text()

        stop_b = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            on_b = pool.submit(load, b.address, "b", 0, stop_b)
            on_a = load(a.address, "a", 24)
            assert a.stop() == 0  # a shuts down (and cleans up) while b is busy
            more_on_b = load(b.address, "b-after", 12)
            stop_b.set()
            outcomes = [*on_a, *on_b.result(timeout=120), *more_on_b]
        failed = [o for o in outcomes if not o.ok]
        assert not failed, failed[:3]
        assert len(outcomes) >= 36
        assert b.stop() == 0
        assert wait_until(lambda: not project_segments(), timeout=10)
    finally:
        for proc in [*tokenizers, sched]:
            proc.stop()


def test_segments_of_requests_queued_at_a_killed_scheduler_go_in_one_janitor_pass(
    long_context_model: Path, tmp_path: Path
) -> None:
    """One running request and three queued ones (the batch has one row);
    the scheduler is SIGKILLed: it held the queued requests' segments by lock,
    so nobody owns them now. The tokenizer's own janitor is off (an hour); a
    restarted scheduler's first janitor pass removes them — not a lease.
    One-off segments (no slab): a slab's slices go with the scheduler's
    locks at once (tests/e2e/test_slab.py). The running request holds its
    row until the scheduler dies (`long_context_model`)."""
    model = long_context_model
    extra = ["--max-running", "1", *HOLDING_LIMIT]
    sched = start_scheduler(model, tmp_path / "scheduler.log", tp=1, extra=extra)
    tok = None
    try:
        port = sched.wait_bound(180)  # the port it drew; the tokenizer waits for it to serve by itself
        args = tokenizer_args(
            model,
            f"127.0.0.1:{port}",
            extra=["--janitor-interval-s", "3600", "--shm-slab-bytes", "0", "--log-level", "DEBUG", *HOLDING_LIMIT],
        )
        tok = ServiceProcess("tokenizer", args, tmp_path / "tokenizer.log", env=ENV)
        tok_log = tok.log_path
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        first = threading.Semaphore(0)

        def one(i: int) -> Outcome:
            out = Outcome(request_id=f"q{i}")
            with grpc.insecure_channel(tok.address) as channel:  # type: ignore[union-attr]
                # min_tokens: no end token may finish the running request early
                # (that would admit a queued one and release its segment).
                request = make_request(
                    "Go on.",
                    [samples.good_png(seed=i)],
                    max_tokens=HOLDING_TOKENS,
                    min_tokens=HOLDING_TOKENS,
                    request_id=out.request_id,
                )
                try:
                    for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=120):
                        if event.HasField("delta"):
                            first.release()
                except grpc.RpcError as exc:
                    out.reason = RemoteError.from_rpc_error(exc).reason
            return out

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, 0)]
            assert first.acquire(timeout=60)
            futures += [pool.submit(one, i) for i in range(1, 4)]
            # Queued at the scheduler (which sends Accepted as it queues them),
            # and those events at the tokenizer: a request killed before its
            # Accepted arrived is the tokenizer's to clean up.
            assert wait_until(lambda: scheduler_info(sched.address).queued_requests == 3, timeout=30)

            def accepted() -> int:
                return tok_log.read_text().count(": accepted downstream;")

            assert wait_until(lambda: accepted() == 4, timeout=30), f"{accepted()} of 4 accepted at the tokenizer"
            # Theirs, and the tokenizer's grant table, whose grants end with the calls.
            queued = [n for n in project_segments() if "-grant" not in n]
            assert len(queued) == 3, queued
            os.kill(sched.pid, signal.SIGKILL)
            outcomes = [f.result(timeout=60) for f in futures]
        assert {o.reason for o in outcomes} == {"SCHEDULER_UNAVAILABLE"}
        assert project_segments() == queued, "accepted segments are the scheduler's; the tokenizer left them"

        port = sched.port
        sched.stop()
        extra = ["--port", str(port), "--janitor-interval-s", "1", "--segment-grace-s", "1", *HOLDING_LIMIT]
        sched = start_scheduler(model, tmp_path / "scheduler2.log", tp=1, extra=extra)
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        assert wait_until(lambda: not project_segments(), timeout=5), project_segments()
        assert "janitor removed 3 unowned segment(s)" in sched.log_path.read_text()
    finally:
        if tok is not None:
            tok.stop()
        sched.stop()
