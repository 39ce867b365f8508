"""The /metrics server (`ServiceMetrics.serve`): a client that sends half a
request is cut off, and scrapes are served meanwhile."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from mmsplit_server.metrics import ServiceMetrics


def test_a_half_sent_request_is_cut_off_and_scrapes_go_on() -> None:
    metrics = ServiceMetrics("test", read_timeout_s=0.5)
    port = metrics.serve("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port)) as half:
            half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no end of the headers
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                assert reply.status == 200
                assert b"mmsplit_test_requests" in reply.read()
            half.settimeout(30)  # waits for the server's close, well past its 0.5 s
            assert half.recv(100) == b""
    finally:
        metrics.close()
    with pytest.raises(ConnectionRefusedError):  # closed: nothing listens there now
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
