"""HTTP/2 keepalive, as both services and the client library set it up
(`mmsplit_server.serving`, `mmsplit.client`)."""

from __future__ import annotations

# Pings a peer may send without data between them: our servers accept one a
# second (gRPC's default, one per 5 minutes, answers a client that pings more
# often with GOAWAY "too_many_pings"), so `--keepalive-s` is at least 1.
MIN_PING_INTERVAL_MS = 1000


def keepalive_options(keepalive_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """HTTP/2 keepalive of our end of a connection (a server's connections,
    or a channel): a ping every `keepalive_s`, the connection closed when
    one goes unanswered for `timeout_s`, also while no call or no data
    moves (a request queued or in a long prefill: gRPC stops pinging such a
    connection after two pings by default). 0: we send no pings.

    Without it a peer that vanishes without a word (its node lost, a
    partition: no FIN, no RST) is found only by TCP, after ~15 minutes of
    retransmissions: its streams hang until their deadlines, and a
    scheduler generates for a tokenizer that is gone."""
    if keepalive_s <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # What gRPC core waits for a ping's answer (60 s by default): the
        # keepalive timeout alone becomes TCP_USER_TIMEOUT, which finds a
        # peer whose packets are lost, but not one whose kernel still
        # acknowledges them while the process does not run (SIGSTOP, a
        # frozen cgroup): that one took 60 s (tests/e2e/test_keepalive.py).
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
