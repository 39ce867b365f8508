"""A media origin on loopback for the tests: it answers every GET with one
PNG, counts the requests, and can hold each answer until the test releases
it (a fetch then runs for as long as the test wants, on any host's speed,
at no CPU). The tokenizer reaches it with `--private-fetch-exempt`
`origin.address`."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Origin:
    address: str  # 127.0.0.1:PORT
    hits: int = 0
    paths: list[str] = field(default_factory=list)  # of every request, in order
    asked: threading.Event = field(default_factory=threading.Event)  # set at the first request
    release: threading.Event = field(default_factory=threading.Event)  # set: answers go out

    def url(self, name: str) -> str:
        return f"http://{self.address}/{name}"


@contextlib.contextmanager
def local_origin(body: bytes, *, held: bool = False) -> Iterator[Origin]:
    """Serving `body` (a PNG) until the block ends; with `held`, each answer
    waits for `origin.release` (set at the end in any case)."""
    origin = Origin("")
    if not held:
        origin.release.set()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            origin.hits += 1
            origin.paths.append(self.path)
            origin.asked.set()
            origin.release.wait(60)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    origin.address = f"127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        origin.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
