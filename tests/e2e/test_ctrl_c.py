"""Ctrl-C as a terminal sends it: SIGINT to the whole process group of a
TP=2 scheduler (rank 1 gets it too). Idle, and while a request streams: exit
0, no ERROR line, no traceback (rank 1 leaves the stop to rank 0). A second
Ctrl-C during the drain ends it at once and says so."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import SCHEDULER_SERVICE, TOKENIZER_SERVICE, ServiceProcess, scheduler_args, tokenizer_args
from tests.e2e.helpers import rank_processes
from tests.support.leaks import wait_until
from tests.support.services import ENV

pytestmark = pytest.mark.e2e


def _group(tiny_model: Path, tmp_path: Path, *extra: str) -> ServiceProcess:
    args = scheduler_args(tiny_model, tp=2, extra=list(extra))  # --port 0: the port it binds, logged
    proc = ServiceProcess("scheduler", args, tmp_path / "scheduler.log", env=ENV, new_group=True)
    proc.wait_serving(SCHEDULER_SERVICE, 180)
    assert len(rank_processes(proc.pid)) == 1
    return proc


def _clean(log: str) -> None:
    assert " ERROR " not in log, log[-3000:]
    assert "ERROR:" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "KeyboardInterrupt" not in log, log[-3000:]


def test_ctrl_c_on_an_idle_tp2_group_stops_it_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    proc = _group(tiny_model, tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    _clean(proc.log_path.read_text())


def _stream(address: str, max_tokens: int, events: list[str], timeout: float = 300) -> None:
    """One request's events as they come: "delta" per delta, then "finished" or the error's reason."""
    request = make_request("Go on.", max_tokens=max_tokens, min_tokens=max_tokens)
    with grpc.insecure_channel(address) as channel:
        try:
            for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=timeout):
                events.append(event.WhichOneof("event") or "")
        except grpc.RpcError as exc:
            events.append(exc.code().name)


def _pair(tiny_model: Path, logs: Path, grace_s: int) -> tuple[ServiceProcess, ServiceProcess]:
    logs.mkdir()
    sched = _group(tiny_model, logs, "--shutdown-grace-s", str(grace_s))
    tok = ServiceProcess("tokenizer", tokenizer_args(tiny_model, sched.address), logs / "tokenizer.log", env=ENV)
    tok.wait_serving(TOKENIZER_SERVICE, 180)
    return sched, tok


def test_ctrl_c_while_streaming_drains_then_a_second_one_stops_at_once(tiny_model: Path, tmp_path: Path) -> None:
    sched, tok = _pair(tiny_model, tmp_path / "drain", 60)
    try:
        events: list[str] = []
        client = threading.Thread(target=_stream, args=(tok.address, 60, events))
        client.start()
        assert wait_until(lambda: "delta" in events, timeout=60), events
        os.killpg(sched.pid, signal.SIGINT)  # the first: running requests finish
        client.join(120)
        assert events[-1] == "finished", events[-5:]
        assert events.count("delta") >= 2
        assert sched.proc.wait(60) == 0
        _clean(sched.log_path.read_text())
    finally:
        tok.stop()
        sched.stop()

    sched, tok = _pair(tiny_model, tmp_path / "force", 120)
    try:
        events = []
        client = threading.Thread(target=_stream, args=(tok.address, 4000, events))
        client.start()
        assert wait_until(lambda: "delta" in events, timeout=60), events
        os.killpg(sched.pid, signal.SIGINT)
        assert wait_until(lambda: "Ctrl-C again to stop at once" in sched.log_path.read_text(), timeout=30)
        os.killpg(sched.pid, signal.SIGINT)  # the second: at once, though a request still runs
        assert sched.proc.wait(30) == 1
        client.join(60)
        assert "finished" not in events
        assert "SIGINT again: stopping at once" in sched.log_path.read_text()
    finally:
        tok.stop()
        sched.stop()
