"""Fetch through a rebinding name (public first, loopback after) from inside
a network namespace with no route out, and print what happened as one JSON
line: {"reason": ErrorCode of the failure or "", "origin_hits": n}.

    python -m tests.support.rebind_probe

Run by tests/tokenizer/test_rebinding.py under `ip netns exec`; the
namespace has only its loopback, so the public address is unreachable and
no packet leaves it."""

from __future__ import annotations

import asyncio
import http.server
import json
import tempfile
import threading
from pathlib import Path

from mmsplit.errors import MmsplitError, reason_of
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.media import MediaLoader
from tokenizer_svc.settings import TokenizerSettings

hits = 0


class Origin(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        global hits
        hits += 1
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"ok!!")

    def log_message(self, *args: object) -> None:
        pass


async def fetch(port: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        settings = TokenizerSettings(
            model_dir=Path(tmp),
            fetch_resolver="tests.support.resolvers:rebinding",
            fetch_retries=2,
            fetch_backoff_s=0.01,
            fetch_timeout_s=2.0,
        )
        media = MediaLoader(settings)
        try:
            await media.load(tokenizer_pb2.Image(url=f"http://rebind.example.test:{port}/ok"))
            return ""
        except MmsplitError as exc:
            return reason_of(exc.error_code)
        finally:
            await media.aclose()


def main() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reason = asyncio.run(fetch(server.server_address[1]))
    finally:
        server.shutdown()
    print(json.dumps({"reason": reason, "origin_hits": hits}))


if __name__ == "__main__":
    main()
