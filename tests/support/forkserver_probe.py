"""Run in a worker forked from the CPU pool's forkserver (`tests/tokenizer/test_forkserver.py`)."""

from __future__ import annotations

from multiprocessing.connection import Connection


def report(conn: Connection) -> None:
    """Send whether the forkserver this process was forked from leaves without teardown."""
    from tokenizer_svc import forkserver

    conn.send(forkserver.LEAVES_AT_ONCE)
    conn.close()
