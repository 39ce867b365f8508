"""Run in a worker forked from the CPU pool's forkserver (`tests/tokenizer/test_forkserver.py`)."""

from __future__ import annotations

from multiprocessing.connection import Connection


def report(conn: Connection) -> None:
    """Send whether the forkserver this process was forked from leaves without teardown."""
    from tokenizer_svc import forkserver

    conn.send(forkserver.LEAVES_AT_ONCE)
    conn.close()


def ask_a_worker() -> bool:
    """(In the tokenizer's stead.) Fork a worker from the running forkserver
    and return what it says (`report`)."""
    from tokenizer_svc import forkserver

    ctx = forkserver.context()
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=report, args=(theirs,))
    worker.start()
    said: bool = ours.recv()
    worker.join()
    return said
