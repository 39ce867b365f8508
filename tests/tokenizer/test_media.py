"""Where image bytes come from, against a local origin on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import http.server
import os
import threading
import time
import urllib.parse
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
        elif self.path == "/drip":
            # A valid response that never finishes in time: one byte every 0.2 s.
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.end_headers()
            try:
                for _ in range(200):
                    if Origin.release.wait(0.2):
                        break
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/short":
            # Announces 500 bytes, sends 100, closes.
            self.send_response(200)
            self.send_header("Content-Length", "500")
            self.end_headers()
            self.wfile.write(b"x" * 100)
            self.close_connection = True
        elif self.path == "/chunked-cut":
            # A chunked body whose connection closes in the middle of a chunk.
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"64\r\n" + b"y" * 40)
            self.close_connection = True
        elif self.path == "/to-private":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/ok")
            self.end_headers()
        elif self.path == "/to-nowhere":
            self.send_response(302)
            self.send_header("Location", "http://[::1/x.png")
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
    async def once() -> bytes:
        try:
            return await media.load(tokenizer_pb2.Image(**source))  # type: ignore[arg-type]
        finally:
            await media.aclose()

    return asyncio.run(once())


def test_inline_and_data_urls(tmp_path: Path) -> None:
    assert load(loader(tmp_path), data=b"abc") == b"abc"
    url = "data:image/png;base64," + base64.b64encode(b"hello").decode()
    assert load(loader(tmp_path), url=url) == b"hello"
    with pytest.raises(InvalidRequest):
        load(loader(tmp_path), url="data:image/png;base64,@@@")
    with pytest.raises(MediaTooLarge):
        load(loader(tmp_path), data=b"x" * 1001)


def test_a_data_url_never_goes_through_urlsplit_and_its_cache(tmp_path: Path) -> None:
    """urlsplit keeps its last 128 URLs and their parts: a data: URL read
    through it stayed alive (megabytes of base64, twice) long after its
    request. It is read as it is, its leading whitespace stripped as
    urlsplit would; "data:" spelled with a tab inside (which urlsplit reads
    as the scheme) is refused."""
    urllib.parse.urlsplit.cache_clear()
    payload = base64.b64encode(b"hello" * 10_000).decode()
    for url in (f"data:image/png;base64,{payload}", f" \tDATA:image/png;base64,{payload}"):
        assert load(loader(tmp_path, max_image_bytes=1 << 20), url=url) == b"hello" * 10_000
    assert urllib.parse.urlsplit.cache_info().currsize == 0, "a data: URL went through urlsplit"
    with pytest.raises(InvalidRequest, match="must start with 'data:'"):
        load(loader(tmp_path), url="da\tta:image/png;base64,aGk=")


def test_a_url_longer_than_64_kib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    urllib.parse.urlsplit.cache_clear()
    long = "https://example.com/x.png?" + "a" * (64 * 1024)
    with pytest.raises(InvalidRequest, match="characters long, over 65,536"):
        load(loader(tmp_path), url=long)
    assert urllib.parse.urlsplit.cache_info().currsize == 0


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


def test_a_directory_is_not_a_file_and_costs_no_descriptor(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for url in ("sub", "file://", str(tmp_path)):
        with pytest.raises(MediaNotFound, match="not a regular file"):
            load(loader(tmp_path), url=url)
    assert len(os.listdir("/proc/self/fd")) == before


def test_each_other_source_a_loader_refuses_has_its_typed_error(tmp_path: Path) -> None:
    """The rest of what a client can send as a source: each refused with
    the error that says what is wrong with it, before anything is read
    that need not be (a data: URL too large for the cap is refused before
    it is decoded)."""
    with pytest.raises(InvalidRequest, match="neither data nor url"):
        load(loader(tmp_path))
    with pytest.raises(InvalidRequest, match="no ','"):
        load(loader(tmp_path), url="data:image/png;base64")
    with pytest.raises(MediaTooLarge, match="over 1000 bytes"):
        load(loader(tmp_path), url="data:image/png;base64," + "A" * 1400)
    # A data: URL that is not base64 is percent-decoded.
    assert load(loader(tmp_path), url="data:image/png,%89PNG%00x") == b"\x89PNG\x00x"
    (tmp_path / "a.png").write_bytes(b"filebytes")
    with pytest.raises(MediaSourceForbidden, match="accepts no file paths"):
        load(loader(tmp_path, allowed_media_dir=""), url=str(tmp_path / "a.png"))
    with pytest.raises(InvalidRequest, match="NUL"):
        load(loader(tmp_path), url="a.png\x00.jpg")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(MediaNotFound, match="cannot be resolved"):
        load(loader(tmp_path), url="loop")
    with pytest.raises(MediaNotFound, match="cannot be opened"):
        load(loader(tmp_path), url="x" * 300)  # a name longer than the file system takes
    (tmp_path / "big.png").write_bytes(b"x" * 1001)
    with pytest.raises(MediaTooLarge, match="1001 bytes, over the image limit of 1000"):
        load(loader(tmp_path), url="big.png")


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


def test_a_url_that_does_not_parse_is_the_client_s_error_and_a_redirect_to_one_the_origin_s(
    tmp_path: Path, origin: str
) -> None:
    with pytest.raises(InvalidRequest, match="cannot be parsed"):
        load(loader(tmp_path), url="http://[::1/x.png")
    with pytest.raises(MediaFetchFailed, match="not a valid URL"):
        load(loader(tmp_path), url=f"{origin}/to-nowhere")
    assert Origin.hits["/to-nowhere"] == 1  # the same answer again would not help


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


def guarded(tmp_path: Path, origin: str, **overrides: object) -> MediaLoader:
    """The default guard, with only the test origin's HOST:PORT exempt."""
    exempt = origin.removeprefix("http://")
    return loader(tmp_path, allow_private_fetch=False, private_fetch_exempt=exempt, **overrides)


def test_a_dripping_origin_is_stopped_at_the_attempts_deadline(tmp_path: Path, origin: str) -> None:
    media = guarded(tmp_path, origin, fetch_timeout_s=1.0, fetch_retries=0)
    start = time.monotonic()
    with pytest.raises(MediaFetchFailed):
        load(media, url=f"{origin}/drip")
    # Before: the deadline was checked between 64 KiB reads, so a dripping
    # origin held a fetch for as long as it liked (this one drips for 40 s).
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("path", ["/short", "/chunked-cut"])
def test_a_body_cut_short_is_a_failed_fetch(tmp_path: Path, origin: str, path: str) -> None:
    with pytest.raises(MediaFetchFailed, match="cut short"):
        load(guarded(tmp_path, origin, fetch_retries=0), url=f"{origin}{path}")


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("169.254.169.254", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("2002:0a00:0001::1", False),  # 6to4 of 10.0.0.1
        ("64:ff9b::5db8:d822", True),  # NAT64 of 93.184.216.34
        ("224.0.0.1", False),
        ("64:ff9b:1::5db8:d822", False),  # local-use NAT64: translates to whatever its operator chose
        ("::127.0.0.1", False),  # IPv4-compatible form of 127.0.0.1
        ("::10.0.0.1", False),
        ("::93.184.216.34", True),
    ],
)
def test_addresses_are_classified_by_what_they_reach(address: str, public: bool) -> None:
    from tokenizer_svc.fetch import is_public

    assert is_public(address) is public


@pytest.mark.parametrize("literal", ["[64:ff9b::7f00:1]", "[2002:7f00:1::]", "[::ffff:127.0.0.1]", "127.0.0.1"])
def test_private_literals_in_disguise_are_refused(tmp_path: Path, literal: str) -> None:
    with pytest.raises(MediaSourceForbidden):
        load(loader(tmp_path, allow_private_fetch=False), url=f"http://{literal}:9/x.png")


@pytest.mark.parametrize(
    "host", ["127.1", "2130706433", "0177.0.0.1", "0x7f.0.0.1", "0x7f000001", "127.0.1", "1.2.3.4."]
)
def test_numeric_hosts_that_are_not_canonical_addresses_are_refused(tmp_path: Path, host: str) -> None:
    """Refused by the URL check itself, not by whatever an HTTP client's or
    resolver's parser makes of them (aiohttp 3.14 refuses some on its own)."""
    from tokenizer_svc.fetch import Fetcher

    media = loader(tmp_path, allow_private_fetch=True)  # even where private addresses are allowed
    with pytest.raises(MediaSourceForbidden, match="numeric host"):
        Fetcher(media.settings)._check_url(f"http://{host}:9/x.png")


def test_a_name_with_any_private_answer_is_refused_before_connecting(tmp_path: Path, origin: str) -> None:
    """The substituted resolver answers a public address and the loopback
    origin's at once: the name is refused whole, and nothing is connected to."""
    port = origin.rsplit(":", 1)[1]
    before = Origin.hits.get("/ok", 0)
    media = loader(tmp_path, allow_private_fetch=False, fetch_resolver="tests.support.resolvers:public_then_loopback")
    with pytest.raises(MediaSourceForbidden, match="non-public"):
        load(media, url=f"http://images.example.test:{port}/ok")
    assert Origin.hits.get("/ok", 0) == before
