"""A tokenizer whose /dev/shm is its own (a separate 64 MiB tmpfs in a mount
namespace, as in a pod that does not share the host's) and a scheduler in
the host's: the tensors go inline, and the workers hand them back in their
results without ever writing to /dev/shm, which stays empty from start to end (the
CPU pool talks to its workers over sockets: no POSIX semaphores there
either, as `ProcessPoolExecutor`'s queues kept)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request, run_request
from mmsplit_cli.launch import ServiceProcess, tokenizer_args
from tests.conftest import TOKENIZER_SERVICE, Services
from tests.support.leaks import project_segments
from tests.support.services import ENV

pytestmark = pytest.mark.e2e
REQUESTS = 500


def test_500_requests_go_inline_and_the_tokenizer_s_dev_shm_stays_empty(services: Services, tmp_path: Path) -> None:
    # The session's scheduler (in the host's /dev/shm); a tokenizer of its own.
    tok: ServiceProcess | None = None
    try:
        wrapper = [sys.executable, "-m", "tests.support.mountns", "64m"]
        args = tokenizer_args(services.model, services.scheduler_address)
        tok = ServiceProcess("tokenizer", args, tmp_path / "tokenizer.log", env=ENV, wrapper=wrapper)
        tok.wait_serving(TOKENIZER_SERVICE, 180)
        assert "tensors go by TRANSPORT_INLINE" in tok.log_path.read_text()
        its_shm = Path(f"/proc/{tok.pid}/root/dev/shm")
        assert its_shm.stat().st_dev != Path("/dev/shm").stat().st_dev, "not a /dev/shm of its own"

        # Watch its /dev/shm all through the load.
        at_start = set(os.listdir(its_shm))
        assert not at_start, at_start
        seen: list[set[str]] = []
        most_bytes = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal most_bytes
            while not done.is_set():
                names = set(os.listdir(its_shm))
                seen.append(names)
                with contextlib.suppress(FileNotFoundError):
                    most_bytes = max(most_bytes, sum((its_shm / n).stat().st_size for n in names))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        # 50 distinct images: 50 go through the workers, the other 450 requests
        # are served from the preprocessing cache (inline as well).
        # Small JPEGs: the tensors are the model's size whatever the file's.
        images = [samples.encode(samples.gradient(320, 240, seed=i), "JPEG") for i in range(50)]
        try:
            with grpc.insecure_channel(tok.address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

                def one(i: int):  # type: ignore[no-untyped-def]
                    return run_request(stub, make_request("Hi", [images[i % 50]], max_tokens=1), timeout=120)

                started = time.monotonic()
                with ThreadPoolExecutor(16) as pool:
                    outcomes = list(pool.map(one, range(REQUESTS)))
                load_s = time.monotonic() - started
        finally:
            done.set()
            watcher.join()
        failed = [o for o in outcomes if not o.ok]
        assert not failed, failed[:3]
        # A look every 10 ms: at least a quarter of those the load had time
        # for (a fixed count would fail on a machine fast enough to finish early).
        looks = len(seen)
        assert looks > 10, "the watcher did not run during the load"
        assert looks >= load_s / 0.01 / 4, ("the watcher was starved during the load", looks, load_s)
        assert set().union(*seen) == set(), "something appeared in the tokenizer's /dev/shm"
        assert most_bytes == 0, most_bytes
        # Nor did anything of it land in the host's /dev/shm.
        assert not [name for name in project_segments() if name.split("-")[1:2] == [str(tok.pid)]]
    finally:
        if tok is not None:
            assert tok.stop() == 0
