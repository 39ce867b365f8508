"""Where image bytes come from: inline bytes, data: URLs, http(s) URLs fetched
on the IO thread pool, and files under an allowed directory.

Fetching never spends the preprocessing budget: it has its own per-attempt
timeout and retries (timeouts, connection errors, 5xx; exponential backoff with
jitter); 4xx is the client's and never retried. The byte cap is enforced
while reading. Redirects are bounded and each hop is checked again.
Loopback, private and link-local destinations are refused unless
`allow_private_fetch` is set or the HOST:PORT is exempt (this server fetches
URLs strangers send it); `allowed_domains` narrows destinations further.
Known gap: the address is checked at resolution, and urllib resolves again
to connect, so a DNS-rebinding origin could slip through between the two.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.errors import (
    InvalidRequest,
    MediaFetchFailed,
    MediaNotFound,
    MediaSourceForbidden,
    MediaTooLarge,
    MmsplitError,
)
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3
CHUNK = 64 * 1024


class _Retriable(Exception):
    """An attempt failed in a way another attempt may not."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # redirects are followed by hand, so every hop is checked


class MediaLoader:
    def __init__(self, settings: TokenizerSettings) -> None:
        self.settings = settings
        self.io_pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="fetch")
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._allowed_dir = Path(settings.allowed_media_dir).resolve() if settings.allowed_media_dir else None
        self._domains = [d.strip().lower().lstrip(".") for d in settings.allowed_domains.split(",") if d.strip()]
        self._exempt = {e.strip().lower() for e in settings.private_fetch_exempt.split(",") if e.strip()}

    async def load(self, image: tokenizer_pb2.Image) -> bytes:
        source = image.WhichOneof("source")
        if source == "data":
            return self._check_size(image.data)
        if source != "url" or not image.url:
            raise InvalidRequest("image has neither data nor url")
        url = image.url
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(url)
        if scheme in ("http", "https"):
            return await self._fetch(url)
        if scheme in ("", "file"):
            path = urllib.parse.urlsplit(url).path if scheme == "file" else url
            return await asyncio.get_running_loop().run_in_executor(self.io_pool, self._read_file, path)
        raise MediaSourceForbidden(f"URL scheme {scheme!r} is not accepted")

    def shutdown(self) -> None:
        self.io_pool.shutdown(wait=False, cancel_futures=True)

    def _check_size(self, data: bytes) -> bytes:
        if len(data) > self.settings.max_image_bytes:
            raise MediaTooLarge(f"image is {len(data)} bytes, over the limit of {self.settings.max_image_bytes}")
        return data

    def _data_url(self, url: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise InvalidRequest("data: URL has no ',' separating the header from the data")
        # base64 grows data by 4/3: refuse before decoding what could not fit.
        if len(payload) * 3 // 4 > self.settings.max_image_bytes:
            raise MediaTooLarge(f"data: URL holds over {self.settings.max_image_bytes} bytes")
        if header.endswith(";base64"):
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest(f"data: URL is not valid base64: {exc}") from exc
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        return self._check_size(data)

    def _read_file(self, raw: str) -> bytes:
        if self._allowed_dir is None:
            raise MediaSourceForbidden("this server accepts no file paths (no allowed media directory is set)")
        path = Path(raw)
        if not path.is_absolute():
            path = self._allowed_dir / path
        resolved = path.resolve()
        if not resolved.is_relative_to(self._allowed_dir):
            raise MediaSourceForbidden(f"{raw} is outside the allowed media directory")
        try:
            size = resolved.stat().st_size
            if size > self.settings.max_image_bytes:
                raise MediaTooLarge(f"{raw} is {size} bytes, over the limit of {self.settings.max_image_bytes}")
            return resolved.read_bytes()
        except FileNotFoundError as exc:
            raise MediaNotFound(f"{raw} does not exist") from exc
        except IsADirectoryError as exc:
            raise MediaNotFound(f"{raw} is a directory") from exc
        except PermissionError as exc:
            raise MediaSourceForbidden(f"{raw} is not readable") from exc

    async def _fetch(self, url: str) -> bytes:
        loop = asyncio.get_running_loop()
        attempts = 1 + max(0, self.settings.fetch_retries)
        for attempt in range(1, attempts + 1):
            try:
                return await loop.run_in_executor(self.io_pool, self._fetch_once, url)
            except _Retriable as exc:
                if attempt == attempts:
                    raise MediaFetchFailed(f"fetching {url} failed after {attempts} attempt(s): {exc}") from exc
                delay = self.settings.fetch_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                log.info("fetch attempt %d of %s failed (%s); retrying in %.2fs", attempt, url, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _fetch_once(self, url: str) -> bytes:
        """One attempt, redirects included, within `fetch_timeout_s` overall."""
        deadline = time.monotonic() + self.settings.fetch_timeout_s
        for _ in range(MAX_REDIRECTS + 1):
            self._check_destination(url)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Retriable("timed out")
            try:
                with self._opener.open(urllib.request.Request(url, method="GET"), timeout=remaining) as resp:
                    return self._read_body(resp, deadline)
            except urllib.error.HTTPError as exc:
                if exc.code in (301, 302, 303, 307, 308) and exc.headers.get("Location"):
                    url = urllib.parse.urljoin(url, exc.headers["Location"])
                    continue
                if 400 <= exc.code < 500:
                    raise MediaNotFound(f"origin answered {exc.code} for {url}") from exc
                raise _Retriable(f"origin answered {exc.code}") from exc
            except MmsplitError:
                raise
            except TimeoutError as exc:
                raise _Retriable("timed out") from exc
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                raise _Retriable(f"connection failed: {exc}") from exc
        raise MediaFetchFailed(f"more than {MAX_REDIRECTS} redirects starting at {url}")

    def _read_body(self, resp: object, deadline: float) -> bytes:
        cap = self.settings.max_image_bytes
        length = getattr(resp, "headers", {}).get("Content-Length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise MediaTooLarge(f"origin announces {length} bytes, over the limit of {cap}")
        chunks: list[bytes] = []
        total = 0
        while True:
            if time.monotonic() > deadline:
                raise _Retriable("timed out while reading the body")
            chunk = resp.read(CHUNK)  # type: ignore[attr-defined]
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > cap:
                raise MediaTooLarge(f"origin sent over {cap} bytes")
            chunks.append(chunk)

    def _check_destination(self, url: str) -> None:
        """Every hop: scheme, allowed domains, then the private-address guard."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaSourceForbidden(f"{url} is not an http(s) URL")
        host = parts.hostname.lower()
        if self._domains and not any(host == d or host.endswith("." + d) for d in self._domains):
            raise MediaSourceForbidden(f"{host} is not among the allowed domains")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if self.settings.allow_private_fetch or f"{host}:{port}" in self._exempt:
            return
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port or 443, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise _Retriable(f"cannot resolve {parts.hostname}: {exc}") from exc
        for info in infos:
            addr = ipaddress.ip_address(info[4][0])
            if not addr.is_global:
                raise MediaSourceForbidden(f"{parts.hostname} resolves to a non-public address ({addr})")
