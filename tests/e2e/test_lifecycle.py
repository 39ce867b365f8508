"""Lifecycle of the group and of the tokenizer, each on a fresh pair of
services: a rank dying, the tokenizer dying, SIGTERM under load, a rank that
cannot start, a collective that would hang."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from mmsplit.client import Client
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, make_request, run_request
from mmsplit_cli.launch import ServiceProcess, scheduler_args
from tests.e2e.helpers import health_status, rank_processes
from tests.support import limits
from tests.support.leaks import project_segments, wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import (
    ENV,
    SCHEDULER_SERVICE,
    TOKENIZER_SERVICE,
    new_interpreters,
    running_pair,
    start_scheduler,
)

pytestmark = pytest.mark.e2e


def in_flight(address: str, n: int, *, max_tokens: int, tag: str = "load") -> list:  # type: ignore[type-arg]
    """Start `n` long requests; return their futures once each has streamed a token."""
    first_tokens = threading.Semaphore(0)

    def one(i: int) -> Outcome:
        out = Outcome(request_id=f"{tag}-{i}")
        t0 = time.monotonic()
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            request = make_request(
                "Go on.", [samples.good_png(seed=i)], max_tokens=max_tokens, request_id=out.request_id
            )
            try:
                for event in stub.Generate(request, timeout=120):
                    if event.HasField("delta"):
                        if not out.token_ids:
                            first_tokens.release()
                        out.token_ids.extend(event.delta.token_ids)
                    elif event.HasField("finished"):
                        out.finish_reason = "done"
            except grpc.RpcError as exc:
                from mmsplit.errors import RemoteError

                error = RemoteError.from_rpc_error(exc)
                out.grpc_code, out.reason, out.message = exc.code().name, error.reason, error.message  # type: ignore[attr-defined]
                if not out.token_ids:
                    first_tokens.release()
        out.latency_s = time.monotonic() - t0
        return out

    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(one, i) for i in range(n)]
    pool.shutdown(wait=False)
    for _ in range(n):
        assert first_tokens.acquire(timeout=60), "requests did not start streaming"
    return futures


def rank_pids(scheduler: ServiceProcess) -> list[int]:
    return [p.pid for p in rank_processes(scheduler.pid)]


def ended(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_rank_killed_mid_generation_then_restarted(tiny_model: Path, tmp_path: Path) -> None:
    """In flight: typed SCHEDULER_UNAVAILABLE. Then a client call made while
    the group is down, with the client library's retry policy, is retried by
    gRPC itself (each attempt waiting the tokenizer's pushback) until the
    restarted group answers it."""
    pushback_s = 6.0  # four retries cover 24 s: a restart takes about 7 here, up to 20 on a busy machine
    tokenizer_extra = ["--unavailable-retry-after-ms", str(int(pushback_s * 1000))]
    with running_pair(tiny_model, tmp_path, tokenizer_extra=tokenizer_extra) as pair:
        futures = in_flight(pair.tokenizer_address, 3, max_tokens=2000)
        os.kill(rank_pids(pair.scheduler)[0], signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=30) for f in futures]
        for out in results:
            assert out.reason == "SCHEDULER_UNAVAILABLE", out
            assert out.grpc_code == "UNAVAILABLE"
            assert out.latency_s < 120
        assert time.monotonic() - killed_at < 30
        assert pair.scheduler.proc.wait(30) != 0
        assert wait_until(lambda: not project_segments(), timeout=10)
        assert wait_until(lambda: health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "NOT_SERVING", 10)
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            down = run_request(stub, make_request("Hi", [samples.good_png()], max_tokens=3))
        assert down.reason == "SCHEDULER_UNAVAILABLE"
        assert down.latency_s < 5

        # A client call while the group is down, then a new group on the same
        # port; the tokenizer finds it by itself and a retry gets through.
        with Client(pair.tokenizer_address, retries=4) as client, ThreadPoolExecutor(1) as pool:
            retried = pool.submit(
                client.complete, "Hi", images=[samples.good_png()], max_tokens=3, request_id="retried", timeout=60
            )
            port = pair.scheduler.port
            restarted = start_scheduler(tiny_model, tmp_path / "scheduler2.log", extra=["--port", str(port)])
            pair.scheduler = restarted
            restarted.wait_serving(SCHEDULER_SERVICE, 180)
            assert wait_until(lambda: health_status(pair.tokenizer_address, TOKENIZER_SERVICE) == "SERVING", 30)
            assert retried.result(timeout=60).completion_tokens == 3
        refusals = pair.tokenizer.log_path.read_text().count("request retried failed: SCHEDULER_UNAVAILABLE")
        assert 1 <= refusals <= 4, refusals
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            out = run_request(
                tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("Hi", [samples.good_png()], max_tokens=3)
            )
        assert out.ok, out


def test_tokenizer_killed_with_8_requests_in_flight(tiny_model: Path, tmp_path: Path) -> None:
    extra = ["--janitor-interval-s", "0.5", "--segment-grace-s", "2"]
    with running_pair(tiny_model, tmp_path, scheduler_extra=extra, tokenizer_extra=["--cpu-workers", "2"]) as pair:
        tokenizer_tree = [
            pair.tokenizer.pid,
            *(p.pid for p in psutil.Process(pair.tokenizer.pid).children(recursive=True)),
        ]
        futures = in_flight(pair.tokenizer_address, 8, max_tokens=2000)
        os.kill(pair.tokenizer.pid, signal.SIGKILL)
        for f in futures:
            assert not f.result(timeout=30).ok
        log = pair.scheduler.log_path
        aborted = lambda: sum(f".load-{i} aborted" in log.read_text() for i in range(8))  # noqa: E731
        assert wait_until(lambda: aborted() == 8, timeout=20), log.read_text()[-3000:]
        assert wait_until(lambda: not project_segments(), timeout=15)
        assert wait_until(
            lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in tokenizer_tree), 20
        )
        assert health_status(pair.scheduler_address, SCHEDULER_SERVICE) == "SERVING"


def test_sigterm_under_load_drains_with_typed_errors(tiny_model: Path, tmp_path: Path) -> None:
    grace = ["--shutdown-grace-s", "1"]
    with running_pair(tiny_model, tmp_path, scheduler_extra=grace, tokenizer_extra=grace) as pair:
        # A second tokenizer for the second half, started now to overlap its start.
        from tests.support.services import start_tokenizer

        tok = start_tokenizer(tiny_model, pair.scheduler_address, tmp_path / "tokenizer2.log")
        try:
            # Tokenizer first: its running requests finish or end SHUTTING_DOWN.
            futures = in_flight(pair.tokenizer_address, 4, max_tokens=3000)
            short = in_flight(pair.tokenizer_address, 1, max_tokens=3, tag="short")
            assert pair.tokenizer.stop() == 0
            # It exits without the interpreter's teardown (`mmsplit_cli.main`): its last words still reach the log.
            assert "tokenizer stopped" in pair.tokenizer.log_path.read_text()
            for out in [f.result(timeout=30) for f in futures + short]:
                assert out.ok or out.reason == "SHUTTING_DOWN", out
            assert short[0].result().ok
            assert any(f.result().reason == "SHUTTING_DOWN" for f in futures)

            # Then the scheduler, with requests of the second tokenizer running on it.
            pair.tokenizer = tok
            tok.wait_serving(TOKENIZER_SERVICE, 180)
            futures = in_flight(tok.address, 4, max_tokens=3000, tag="second")
            assert pair.scheduler.stop() == 0
            log_text = pair.scheduler.log_path.read_text()
            assert "rank 1 stopped" in log_text
            assert "scheduler stopped" in log_text
            for out in [f.result(timeout=30) for f in futures]:
                assert out.reason == "SHUTTING_DOWN", out
            assert wait_until(lambda: not project_segments(), timeout=10)
        finally:
            tok.stop()


def stop_under_signal_flood(service: ServiceProcess) -> int:
    """SIGTERM, then another every 10 ms until the process is gone; its exit status."""
    proc = service.proc
    service.terminate()
    while proc.poll() is None:
        time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    return service.stop()


def test_more_sigterms_while_stopping_still_exit_0(tiny_model: Path, tmp_path: Path) -> None:
    # Closing the event loop puts back SIGTERM's default action; the second
    # or so of interpreter teardown after it (torch loaded) was a window in
    # which another SIGTERM killed either service with -15.
    with running_pair(tiny_model, tmp_path, scheduler_extra=["--tp", "1"]) as pair:
        assert stop_under_signal_flood(pair.tokenizer) == 0
        assert stop_under_signal_flood(pair.scheduler) == 0


def test_a_rank_that_cannot_start_takes_the_group_down(tiny_model: Path, tmp_path: Path) -> None:
    extra = ["--tensor-reader", "tests.support.startup_faults:make_reader"]
    proc = start_scheduler(tiny_model, tmp_path / "scheduler.log", extra=extra)
    try:
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    assert code != 0
    assert "tearing the group down" in proc.log_path.read_text()


def test_ranks_leave_with_rank_0_killed_as_the_group_forms(tiny_model: Path, tmp_path: Path) -> None:
    """Ranks 1..N-1 start before rank 0 has imported torch (to overlap the
    imports), yet after it raised its open-file limit, which they inherit.
    A rank 0 SIGKILLed meanwhile takes them with it at once, not after their
    rendezvous times out."""
    args = scheduler_args(tiny_model, tp=2, extra=["--startup-timeout-s", "300"])
    with new_interpreters():  # a zygote fork has imported torch already
        proc = ServiceProcess("scheduler", args, tmp_path / "scheduler.log", env=ENV, wrapper=limits.started_low())
    try:
        assert wait_until(lambda: "started ranks 1..1" in proc.log_path.read_text(), timeout=60)
        # The rank names itself a moment after its fork, which rank 0 logs.
        assert wait_until(lambda: len(rank_pids(proc)) == 1, timeout=30)
        (rank1,) = rank_pids(proc)
        assert psutil.Process(rank1).rlimit(psutil.RLIMIT_NOFILE)[0] == limits.RAISED
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.proc.wait(10) == -signal.SIGKILL
        assert wait_until(lambda: ended(rank1), 10), "a rank outlived rank 0"
    finally:
        proc.stop()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_refused_start_leaves_no_rank(tiny_model: Path, tmp_path: Path, device: str) -> None:
    """An unreadable certificate file ends the start with a clear message.
    Spawned ranks (where CUDA may be used: `--device cuda`, which this check
    comes before) start before rank 0 checks its files, and it takes them
    down; on CPU the ranks are forks made after the check, so none starts."""
    extra = [
        "--device",
        device,
        "--tls-cert",
        str(tmp_path / "missing.pem"),
        "--tls-key",
        str(tmp_path / "missing.key"),
    ]
    proc = start_scheduler(tiny_model, tmp_path / "scheduler.log", extra=extra)
    try:
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    log_text = proc.log_path.read_text()
    assert code != 0
    assert "No such file or directory" in log_text
    started = re.search(r"started ranks 1\.\.1 as pids \[(\d+)\] \((\w+)\)", log_text)
    if device == "cpu":
        assert started is None, log_text[-2000:]
        return
    assert started is not None, log_text[-2000:]
    assert started[2] == "spawn"
    assert wait_until(lambda: ended(int(started[1])), 10), "rank 1 outlived the refused start"


def test_missing_model_fails_fast(tmp_path: Path) -> None:
    proc = ServiceProcess("scheduler", scheduler_args(tmp_path / "nope", tp=2), tmp_path / "scheduler.log")
    try:
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    assert code != 0


def test_stuck_rank_turns_into_a_clean_failure(tiny_model: Path, tmp_path: Path) -> None:
    extra = ["--collective-timeout-s", "4"]
    with running_pair(tiny_model, tmp_path, scheduler_extra=extra) as pair:
        futures = in_flight(pair.tokenizer_address, 2, max_tokens=3000)
        rank1 = rank_pids(pair.scheduler)[0]
        os.kill(rank1, signal.SIGSTOP)
        try:
            results = [f.result(timeout=60) for f in futures]
            assert pair.scheduler.proc.wait(60) != 0
        finally:
            if psutil.pid_exists(rank1):
                os.kill(rank1, signal.SIGCONT)
        for out in results:
            assert out.reason == "SCHEDULER_UNAVAILABLE", out
        assert wait_until(lambda: ended(rank1), 20)


def test_a_wedged_step_at_tp1_fails_the_group_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    """At TP=1 no collective can time out: a step whose read never returns
    (a test hook) is noticed by the step watchdog, every request in flight
    gets a typed SCHEDULER_UNAVAILABLE, and the process exits non-zero."""
    import numpy as np

    from mmsplit.common.v1 import common_pb2
    from mmsplit.errors import error_info_of
    from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from scheduler_svc.model import model_info
    from tests.support.faults import WEDGE

    timeout_s = 3.0
    extra = ["--tp", "1", "--step-timeout-s", str(timeout_s), "--tensor-reader", "tests.support.faults:make_reader"]
    sched = start_scheduler(tiny_model, tmp_path / "scheduler.log", extra=extra)
    try:
        sched.wait_serving(SCHEDULER_SERVICE, 180)
        info = model_info(tiny_model)
        image = np.zeros(info.image_shape, dtype=np.float32).tobytes()
        errors: dict[str, grpc.RpcError | None] = {}
        streaming = threading.Semaphore(0)

        def call(rid: str, with_image: bool) -> None:
            ids = [1, *([info.image_token_id] * info.tokens_per_image if with_image else []), 22557]
            pixels = [common_pb2.TensorRef(dtype=1, shape=info.image_shape, inline=image)] if with_image else []
            request = scheduler_pb2.GenerateRequest(
                request_id=rid,
                input_ids=ids,
                pixel_values=pixels,
                sampling=common_pb2.SamplingParams(max_tokens=900, min_tokens=900),
            )
            with scheduler_channel(sched.address) as channel:
                try:
                    for event in scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(request, timeout=120):
                        if event.HasField("tokens"):
                            streaming.release()
                    errors[rid] = None
                except grpc.RpcError as exc:
                    errors[rid] = exc

        threads = [threading.Thread(target=call, args=(f"long-{i}", False)) for i in range(2)]
        for t in threads:
            t.start()
        for _ in range(2):
            assert streaming.acquire(timeout=60)
        wedged_at = time.monotonic()
        threads.append(threading.Thread(target=call, args=(f"{WEDGE}-1", True)))
        threads[-1].start()
        for t in threads:
            t.join(timeout_s + 30)
        assert time.monotonic() - wedged_at < timeout_s + 20
        assert sched.proc.wait(30) != 0
        assert set(errors) == {"long-0", "long-1", f"{WEDGE}-1"}
        for rid, exc in errors.items():
            assert exc is not None, f"{rid} finished although the group was wedged"
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            detail = error_info_of(exc)
            assert detail is not None, f"{rid}: untyped {exc.details()}"
            assert detail.reason == "SCHEDULER_UNAVAILABLE"
        assert "made no progress" in sched.log_path.read_text()
    finally:
        sched.stop()
