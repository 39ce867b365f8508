"""DNS rebinding cannot reach an internal service: the fetcher connects to
exactly the addresses it vetted, so a name that answers a public address
first and loopback on the next query is refused when it turns private —
never connected to loopback. Runs in a network namespace with no route out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import netns as netns_support

ROOT = Path(__file__).resolve().parents[2]
NO_NETNS = netns_support.available()


@pytest.mark.skipif(bool(NO_NETNS), reason=NO_NETNS or "namespaces available")
def test_a_rebinding_name_never_yields_a_loopback_connection() -> None:
    with netns_support.netns() as ns:
        done = subprocess.run(
            [*ns.wrapper, sys.executable, "-m", "tests.support.rebind_probe"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["origin_hits"] == 0, "the loopback origin was fetched"
    # The first (public) answer was connected to and unreachable; the retry's
    # answer was loopback and refused before any connection.
    assert result["reason"] == "MEDIA_SOURCE_FORBIDDEN"
