"""Where image bytes come from, against a local origin on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.errors import (
    InvalidRequest,
    MediaFetchFailed,
    MediaNotFound,
    MediaSourceForbidden,
    MediaTooLarge,
)
from tokenizer_svc.media import MediaLoader
from tokenizer_svc.settings import TokenizerSettings


class Origin(http.server.BaseHTTPRequestHandler):
    hits: dict[str, int] = {}
    release = threading.Event()  # ends hanging and endless responses at teardown

    def do_GET(self) -> None:
        Origin.hits[self.path] = Origin.hits.get(self.path, 0) + 1
        if self.path == "/ok":
            self._send(200, b"IMAGEBYTES")
        elif self.path == "/missing":
            self._send(404, b"no")
        elif self.path == "/flaky" and Origin.hits[self.path] == 1:
            self._send(503, b"busy")
        elif self.path == "/flaky":
            self._send(200, b"SECOND")
        elif self.path == "/down":
            self._send(500, b"down")
        elif self.path == "/big":
            self._send(200, b"x" * 5000)
        elif self.path == "/hang":
            Origin.release.wait(30)
        elif self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                while not Origin.release.is_set():
                    self.wfile.write(b"x" * 4096)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/to-private":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/ok")
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        else:
            self._send(404, b"")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Origin.release.set()
    server.shutdown()
    server.server_close()
    thread.join(5)


def loader(tmp_path: Path, **overrides: object) -> MediaLoader:
    values: dict[str, object] = {
        "allowed_media_dir": str(tmp_path),
        "allow_private_fetch": True,
        "fetch_backoff_s": 0.01,
        "max_image_bytes": 1000,
        **overrides,
    }
    settings = TokenizerSettings(model_dir=tmp_path, **values)  # type: ignore[arg-type]
    return MediaLoader(settings)


def load(media: MediaLoader, **source: object) -> bytes:
    try:
        return asyncio.run(media.load(tokenizer_pb2.Image(**source)))  # type: ignore[arg-type]
    finally:
        media.shutdown()


def test_inline_and_data_urls(tmp_path: Path) -> None:
    assert load(loader(tmp_path), data=b"abc") == b"abc"
    url = "data:image/png;base64," + base64.b64encode(b"hello").decode()
    assert load(loader(tmp_path), url=url) == b"hello"
    with pytest.raises(InvalidRequest):
        load(loader(tmp_path), url="data:image/png;base64,@@@")
    with pytest.raises(MediaTooLarge):
        load(loader(tmp_path), data=b"x" * 1001)


def test_files_only_under_the_allowed_dir(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"filebytes")
    assert load(loader(tmp_path), url=str(tmp_path / "a.png")) == b"filebytes"
    assert load(loader(tmp_path), url="a.png") == b"filebytes"
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path), url="/etc/hostname")
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path), url="../../etc/hostname")
    with pytest.raises(MediaNotFound):
        load(loader(tmp_path), url="nope.png")
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path), url="ftp://example.invalid/x.png")


def test_origin_behaviours(tmp_path: Path, origin: str) -> None:
    assert load(loader(tmp_path), url=f"{origin}/ok") == b"IMAGEBYTES"
    with pytest.raises(MediaNotFound):
        load(loader(tmp_path), url=f"{origin}/missing")
    assert Origin.hits["/missing"] == 1  # 4xx is never retried
    assert load(loader(tmp_path), url=f"{origin}/flaky") == b"SECOND"
    with pytest.raises(MediaFetchFailed):
        load(loader(tmp_path, fetch_retries=2), url=f"{origin}/down")
    assert Origin.hits["/down"] == 3
    with pytest.raises(MediaTooLarge):
        load(loader(tmp_path), url=f"{origin}/big")
    with pytest.raises(MediaFetchFailed):
        load(loader(tmp_path), url=f"{origin}/loop")


def test_private_addresses_are_refused_by_default(tmp_path: Path, origin: str) -> None:
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path, allow_private_fetch=False), url=f"{origin}/ok")


def test_hanging_origin_fails_within_its_time_bound(tmp_path: Path, origin: str) -> None:
    media = loader(tmp_path, fetch_timeout_s=0.5, fetch_retries=1)
    start = time.monotonic()
    with pytest.raises(MediaFetchFailed):
        load(media, url=f"{origin}/hang")
    # Two attempts of 0.5 s and one short backoff; never the preprocessing budget.
    assert time.monotonic() - start < 3


def test_endless_body_stops_at_the_byte_cap(tmp_path: Path, origin: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaTooLarge):
        load(loader(tmp_path), url=f"{origin}/endless")
    assert time.monotonic() - start < 3


def test_redirect_to_a_private_address_is_refused(tmp_path: Path, origin: str) -> None:
    exempt = origin.removeprefix("http://")
    media = loader(tmp_path, allow_private_fetch=False, private_fetch_exempt=exempt)
    assert load(media, url=f"{origin}/ok") == b"IMAGEBYTES"
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path, allow_private_fetch=False, private_fetch_exempt=exempt), url=f"{origin}/to-private")


def test_allowed_domains(tmp_path: Path, origin: str) -> None:
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path, allowed_domains="images.example.com"), url=f"{origin}/ok")
    assert load(loader(tmp_path, allowed_domains="127.0.0.1"), url=f"{origin}/ok") == b"IMAGEBYTES"
