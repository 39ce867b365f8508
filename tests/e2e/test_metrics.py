"""Prometheus /metrics of both shared services after a scripted mix: the
counts by outcome are the ones the mix caused, and promtool (Prometheus' own
checker) finds no format or naming problem in either exposition."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from tests.conftest import Services
from tests.e2e.helpers import exposition, scrape
from tests.support.faults import failing_request_id
from tests.support.leaks import wait_until

pytestmark = pytest.mark.e2e


def port_of(log: Path) -> int:
    found = re.search(r"metrics on port (\d+)", log.read_text())
    assert found, f"no metrics port in {log}"
    return int(found.group(1))


PROMTOOL = Path(sys.executable).parent / "promtool"  # the Makefile puts it in the venv


def test_counts_by_outcome_after_a_scripted_mix(services: Services) -> None:
    tok_port = port_of(services.tokenizer.log_path)
    sched_port = port_of(services.scheduler.log_path)

    def quiet() -> bool:
        tok, sched = scrape(tok_port), scrape(sched_port)
        return (
            tok[("mmsplit_tokenizer_requests_in_flight", ())] == 0
            and sched[("mmsplit_scheduler_running_requests", ())] == 0
            and sched[("mmsplit_scheduler_queued_requests", ())] == 0
        )

    # Nothing of an earlier test may still be finishing while this one counts.
    assert wait_until(quiet, timeout=30)
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        # How long a request of a tenth of the context takes here now: the one
        # ended by its deadline below asks for the whole context and gets
        # twice that, so it is running when the deadline passes on a fast
        # host and a slow one.
        began = time.monotonic()
        tenth = run_request(
            tokenizer_pb2_grpc.TokenizerServiceStub(channel), make_request("Go on.", max_tokens=200, min_tokens=200)
        )
        tenth_s = time.monotonic() - began
    assert tenth.ok, tenth
    assert wait_until(quiet, timeout=30)
    before_tok, before_sched = scrape(tok_port), scrape(sched_port)
    with grpc.insecure_channel(services.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        good = [run_request(stub, make_request("Hi", [samples.good_png()], max_tokens=3)) for _ in range(2)]
        corrupt = run_request(stub, make_request("Hi", [samples.corrupt_png()]))
        # A tensor rank 1 cannot read: agreed on, counted against rank 1.
        unread = run_request(
            stub, make_request("Hi", [samples.good_png()], max_tokens=3, request_id=failing_request_id(1, "metrics"))
        )
        # Cancelled by the client once it streams; ended by its deadline.
        started = threading.Event()
        call = stub.Generate(make_request("Go on.", max_tokens=2000, min_tokens=2000), timeout=60)

        def consume() -> None:
            try:
                for _ in call:
                    started.set()
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30)
        call.cancel()
        reader.join(10)
        late = run_request(stub, make_request("Go on.", max_tokens=2000, min_tokens=2000), timeout=2 * tenth_s)
    assert [g.ok for g in good] == [True, True]
    assert corrupt.reason == "MEDIA_DECODE_FAILED"
    assert unread.reason == "FEATURE_TRANSPORT_FAILED"
    assert late.grpc_code == "DEADLINE_EXCEEDED"

    def caused(service: str, port: int, before: dict) -> dict[str, float]:  # type: ignore[type-arg]
        """The outcome counts that changed since `before`."""
        after = {labels[0][1]: v for (name, labels), v in scrape(port).items() if name.endswith("_requests_total")}
        was = {labels[0][1]: v for (name, labels), v in before.items() if name.endswith("_requests_total")}
        return {k: v - was.get(k, 0.0) for k, v in after.items() if v != was.get(k, 0.0)}

    want_tok = {
        "OK": 2,
        "MEDIA_DECODE_FAILED": 1,
        "FEATURE_TRANSPORT_FAILED": 1,
        "CANCELLED": 1,
        "DEADLINE_EXCEEDED": 1,
    }
    assert wait_until(lambda: caused("tokenizer", tok_port, before_tok) == want_tok, timeout=10), caused(
        "tokenizer", tok_port, before_tok
    )
    # The scheduler saw the two good ones and the two it was cancelled for (the corrupt image never reached it).
    want_sched = {"OK": 2, "FEATURE_TRANSPORT_FAILED": 1, "CANCELLED": 2}
    assert wait_until(lambda: caused("scheduler", sched_port, before_sched) == want_sched, timeout=10), caused(
        "scheduler", sched_port, before_sched
    )
    after = scrape(tok_port)
    assert (
        after[("mmsplit_tokenizer_completion_tokens_total", ())]
        - before_tok.get(("mmsplit_tokenizer_completion_tokens_total", ()), 0)
        >= 6
    )
    for name in (
        "preprocess_cache_hits_total",
        "preprocessed_items_total",
        "preprocess_seconds_total",
        "fetch_attempts_total",
        "fetch_retries_total",
        "fetch_failures_total",
        "janitor_removed_segments_total",
        "shm_bytes",
    ):
        assert (f"mmsplit_tokenizer_{name}", ()) in after, name
    assert ("mmsplit_tokenizer_requests_in_flight", ()) in after
    for stage in ("read", "decode", "process", "write"):
        assert ("mmsplit_tokenizer_preprocess_worker_seconds_total", (("stage", stage),)) in after, stage
    backend = (("backend", services.scheduler_address),)
    assert after[("mmsplit_tokenizer_backend_requests_in_flight", backend)] == 0
    assert after[("mmsplit_tokenizer_backend_ready", backend)] == 1
    assert after[("mmsplit_tokenizer_backend_serves_another_model", backend)] == 0
    scheduler = scrape(sched_port)
    assert ("mmsplit_scheduler_kv_budget_tokens", ()) in scheduler
    steps = ("mmsplit_scheduler_step_duration_seconds_count", ())
    assert scheduler[steps] > before_sched.get(steps, 0)
    for name in ("janitor_removed_segments_total", "shm_bytes", "heap_returned_bytes_total"):
        assert (f"mmsplit_scheduler_{name}", ()) in scheduler, name

    def by_rank(sample: dict, rank: int) -> float:  # type: ignore[type-arg]
        return sample.get(("mmsplit_scheduler_agreement_failures_total", (("rank", str(rank)),)), 0.0)

    assert by_rank(scheduler, 1) - by_rank(before_sched, 1) == 1
    assert by_rank(scheduler, 0) - by_rank(before_sched, 0) == 0
    assert ("mmsplit_scheduler_agreement_failures_total", (("rank", "0"),)) in scheduler
    # Both froze their start-up (torch, transformers, the model: hundreds of
    # thousands of objects) out of the garbage collector's reach.
    for service, sample in (("tokenizer", after), ("scheduler", scheduler)):
        assert sample[(f"mmsplit_{service}_gc_frozen_objects", ())] > 100_000, service
        for generation in ("0", "1", "2"):
            assert (f"mmsplit_{service}_gc_collections_total", (("generation", generation),)) in sample
            assert (f"mmsplit_{service}_gc_pause_seconds_total", (("generation", generation),)) in sample


def test_promtool_finds_no_problem(services: Services) -> None:
    """`promtool check metrics`: the format, and Prometheus' naming rules
    (units, _total counters, help text)."""
    assert PROMTOOL.exists(), "promtool is missing: the Makefile installs it into the venv"
    for log in (services.tokenizer.log_path, services.scheduler.log_path):
        text = exposition(port_of(log))
        check = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.strip() == check.stderr.strip() == "", check.stdout + check.stderr
    # And it does find problems: a counter without _total and without help.
    bad = "# TYPE mmsplit_bad counter\nmmsplit_bad 1\n"
    check = subprocess.run([str(PROMTOOL), "check", "metrics"], input=bad, capture_output=True, text=True)
    assert check.returncode != 0
