"""Where image and video bytes come from: inline bytes, data: URLs, http(s) URLs
(`tokenizer_svc.fetch`: vetted destinations, one deadline per attempt,
retries), and files under an allowed directory (read on a small thread pool).

Fetching never spends the preprocessing budget: it has its own deadline and
retries, and the CPU pool only sees bytes that arrived.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import stat
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.errors import InvalidRequest, MediaNotFound, MediaSourceForbidden, MediaTooLarge
from tokenizer_svc.fetch import Fetcher
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)
# A data: URL this long is decoded off the event loop.
BIG_DATA_URL = 256 * 1024
# The longest URL taken that is not a data: URL (an http(s) URL, a path).
MAX_URL_CHARS = 64 * 1024
# The characters urlsplit strips from the start of a URL (WHATWG's C0 control or space).
_C0_OR_SPACE = "".join(map(chr, range(0x21)))


class MediaLoader:
    def __init__(self, settings: TokenizerSettings) -> None:
        self.settings = settings
        self.io_pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="files")
        self.fetcher = Fetcher(settings)
        self._allowed_dir = Path(settings.allowed_media_dir).resolve() if settings.allowed_media_dir else None

    async def load(self, media: tokenizer_pb2.Image | tokenizer_pb2.Video) -> bytes:
        kind = "video" if isinstance(media, tokenizer_pb2.Video) else "image"
        cap = self.settings.max_video_bytes if kind == "video" else self.settings.max_image_bytes
        source = media.WhichOneof("source")
        if source == "data":
            return _check_size(media.data, cap, kind)
        if source != "url" or not media.url:
            raise InvalidRequest(f"{kind} has neither data nor url")
        url = media.url
        # A data: URL is read as it is, never through urlsplit: that keeps its
        # last 128 URLs and their parts (functools.lru_cache), so megabytes
        # of base64 each stayed alive long after their requests (~2.3 GB
        # for 128 images of 7 MB).
        bare = url.lstrip(_C0_OR_SPACE)  # what urlsplit strips first, too
        if bare[:5].lower() == "data:":
            if len(bare) > BIG_DATA_URL:  # decoding megabytes of base64 would stall every other request
                return await asyncio.to_thread(self._data_url, bare, cap, kind)
            return self._data_url(bare, cap, kind)
        if len(url) > MAX_URL_CHARS:
            raise InvalidRequest(
                f"the {kind} URL is {len(url):,} characters long, over {MAX_URL_CHARS:,} "
                "(media that is not fetched goes as a data: URL, or as bytes over gRPC)"
            )
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:  # a bracketed host left open, say
            raise InvalidRequest(f"the {kind} URL cannot be parsed: {exc}") from exc
        scheme = parts.scheme.lower()
        if scheme == "data":  # "data:" spelled with tabs or newlines inside, which urlsplit drops
            raise InvalidRequest(f"the {kind} data: URL must start with 'data:'")
        if scheme in ("http", "https"):
            return await self.fetcher.fetch(url, cap)
        if scheme in ("", "file"):
            path = parts.path if scheme == "file" else url
            return await asyncio.get_running_loop().run_in_executor(self.io_pool, self._read_file, path, cap, kind)
        raise MediaSourceForbidden(f"URL scheme {scheme!r} is not accepted")

    async def aclose(self) -> None:
        await self.fetcher.close()
        self.io_pool.shutdown(wait=False, cancel_futures=True)

    def _data_url(self, url: str, cap: int, kind: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise InvalidRequest("data: URL has no ',' separating the header from the data")
        # base64 grows data by 4/3: refuse before decoding what could not fit.
        if len(payload) * 3 // 4 > cap:
            raise MediaTooLarge(f"data: URL holds over {cap} bytes")
        if header.endswith(";base64"):
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest(f"data: URL is not valid base64: {exc}") from exc
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        return _check_size(data, cap, kind)

    def _read_file(self, raw: str, cap: int, kind: str) -> bytes:
        if self._allowed_dir is None:
            raise MediaSourceForbidden("this server accepts no file paths (no allowed media directory is set)")
        if "\x00" in raw:
            raise InvalidRequest("the file path holds a NUL character")
        path = Path(raw)
        if not path.is_absolute():
            path = self._allowed_dir / path
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise MediaNotFound(f"{raw} cannot be resolved") from exc
        if not resolved.is_relative_to(self._allowed_dir):
            raise MediaSourceForbidden(f"{raw} is outside the allowed media directory")
        try:
            # O_NONBLOCK: a FIFO under the directory must not hold a thread.
            fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise MediaNotFound(f"{raw} does not exist") from exc
        except PermissionError as exc:
            raise MediaSourceForbidden(f"{raw} is not readable") from exc
        except OSError as exc:
            raise MediaNotFound(f"{raw} cannot be opened") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO, a device; before fdopen, which raises on a directory
            os.close(fd)
            raise MediaNotFound(f"{raw} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            if st.st_size > cap:
                raise MediaTooLarge(f"{raw} is {st.st_size} bytes, over the {kind} limit of {cap}")
            data = f.read(cap + 1)  # it may have grown since fstat
        return _check_size(data, cap, kind)


def _check_size(data: bytes, cap: int, kind: str) -> bytes:
    if len(data) > cap:
        raise MediaTooLarge(f"{kind} is {len(data)} bytes, over the limit of {cap}")
    return data
