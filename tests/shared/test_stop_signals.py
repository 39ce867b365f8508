"""A service that has stopped ignores further SIGTERMs to its exit
(`mmsplit_server.serving.run_service`). Here without a model, so the stop takes
microseconds and a flood of SIGTERMs (one every 0.1 ms) lands in every
part of it, the event loop's own close included: closing a loop puts back
SIGTERM's default action, which killed every such process before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support.services import ROOT

SERVICE = """
import asyncio, signal, sys
from mmsplit_server.serving import run_service

async def main() -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # as both services do
    print("serving", flush=True)
    await stop.wait()
    return 0

sys.exit(run_service(main()))
"""


def test_a_flood_of_sigterms_never_kills_a_stopping_service() -> None:
    statuses = []
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "serving"
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    break
                time.sleep(0.0001)
            statuses.append(proc.wait(timeout=30))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert statuses == [0] * 10
