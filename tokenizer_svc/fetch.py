"""Fetching images over HTTP(S) for strangers (DESIGN.md §5, §7).

This server fetches URLs anyone sends it, so every destination is hostile
until vetted:

- **Vet what you connect to.** The connector's resolver vets every address a
  name resolves to, and aiohttp connects to exactly those addresses: there
  is no second resolution a rebinding DNS answer could slip into. An IP
  literal in a URL is vetted directly (it is never resolved). A name any of
  whose addresses is not public is refused as a whole.
- **Public means public.** Addresses are classified by what they reach:
  IPv4-mapped, IPv4-compatible (::a.b.c.d), NAT64 (64:ff9b::/96) and 6to4
  (2002::/16) IPv6 forms by the IPv4 address they embed (`ipaddress.is_global`
  calls some of those global); the local-use NAT64 prefix (64:ff9b:1::/48,
  RFC 8215) translates to whatever its operator chose, so it is never public.
- **Numbers are written one way.** A host that is all numbers but not a
  canonical address (`127.1`, `2130706433`, `0177.0.0.1`, `0x7f.0.0.1`) is
  refused here, whatever a resolver or HTTP client would make of it.
- **Every hop is a new destination.** Redirects are followed by hand, at most
  MAX_REDIRECTS, each vetted again (domain allow-list included).
- **One deadline per attempt** covers resolving, connecting, redirects and
  the whole body (an origin that drips one byte at a time is cut off at it),
  and the byte cap is enforced while reading.
- **A body cut short is a failed fetch** (retriable), whether chunked or
  shorter than its Content-Length — never an image, never INTERNAL.
- **Failures say little**: a timeout and a refused connection read the same,
  so error messages are no port scanner.

Retries (timeouts, connection errors, 5xx, short bodies) back off
exponentially with jitter; 4xx is the client's and never retried.
"""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import logging
import random
import re
import socket
import urllib.parse

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from tokenizer_svc.errors import MediaFetchFailed, MediaNotFound, MediaSourceForbidden, MediaTooLarge, MmsplitError
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3
CHUNK = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)
NAT64 = ipaddress.ip_network("64:ff9b::/96")
LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
# Numbers and dots only (decimal, octal or hex parts): an IPv4 address in a
# form only some parsers read, unless it is the canonical dotted quad.
_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?")


def is_public(address: str) -> bool:
    """Whether `address` reaches the public internet (and nothing of ours)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in LOCAL_NAT64:
            return False
        if ip in IPV4_COMPATIBLE and int(ip) > 1:  # ::a.b.c.d (:: and ::1 are not global as they are)
            return is_public(str(ipaddress.IPv4Address(int(ip))))
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public(str(embedded))
        if ip.teredo is not None:
            return all(is_public(str(part)) for part in ip.teredo)
    return ip.is_global and not ip.is_multicast


class _Retriable(Exception):
    """An attempt failed in a way another attempt may not."""


class VettingResolver(AbstractResolver):
    """Resolves with `inner` and lets through only public addresses, unless
    private fetching is allowed or HOST:PORT is exempt."""

    def __init__(self, inner: AbstractResolver, *, allow_private: bool, exempt: set[str]) -> None:
        self.inner = inner
        self.allow_private = allow_private
        self.exempt = exempt

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        if self.allow_private or f"{host.lower()}:{port}" in self.exempt:
            return results
        if not results or not all(is_public(r["host"]) for r in results):
            raise MediaSourceForbidden(f"{host} resolves to a non-public address")
        return results

    async def close(self) -> None:
        await self.inner.close()


def _build_resolver(spec: str) -> AbstractResolver:
    """The configured resolver (`fetch_resolver`, ``module:factory``; tests
    substitute one) or the system's."""
    if not spec:
        return aiohttp.ThreadedResolver()
    module_name, _, attr = spec.partition(":")
    resolver: AbstractResolver = getattr(importlib.import_module(module_name), attr)()
    return resolver


class Fetcher:
    def __init__(self, settings: TokenizerSettings) -> None:
        self.settings = settings
        self._domains = [d.strip().lower().lstrip(".") for d in settings.allowed_domains.split(",") if d.strip()]
        self._exempt = {e.strip().lower() for e in settings.private_fetch_exempt.split(",") if e.strip()}
        self._session: aiohttp.ClientSession | None = None
        # Counted for the metrics: every attempt, the ones retried, the
        # fetches that failed after their last attempt.
        self.attempts = self.retries = self.failures = 0

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running event loop.
        if self._session is None:
            resolver = VettingResolver(
                _build_resolver(self.settings.fetch_resolver),
                allow_private=self.settings.allow_private_fetch,
                exempt=self._exempt,
            )
            # No DNS cache: every new connection's destination is resolved and
            # vetted at that moment (kept-alive connections are reused as is).
            connector = aiohttp.TCPConnector(
                resolver=resolver, limit=self.settings.fetch_connections, use_dns_cache=False
            )
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, max_bytes: int | None = None) -> bytes:
        """The body at `url` (at most `max_bytes`, default the image limit)."""
        cap = self.settings.max_image_bytes if max_bytes is None else max_bytes
        attempts = 1 + max(0, self.settings.fetch_retries)
        for attempt in range(1, attempts + 1):
            self.attempts += 1
            try:
                return await self._attempt(url, cap)
            except _Retriable as exc:
                if attempt == attempts:
                    self.failures += 1
                    raise MediaFetchFailed(f"fetching {url} failed after {attempts} attempt(s): {exc}") from exc
                self.retries += 1
                delay = self.settings.fetch_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                log.info("fetch attempt %d of %s failed (%s); retrying in %.2fs", attempt, url, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, url: str, cap: int) -> bytes:
        """One attempt, redirects included, within `fetch_timeout_s` overall."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.fetch_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                for _ in range(MAX_REDIRECTS + 1):
                    self._check_url(url)
                    async with self._client().get(url, allow_redirects=False) as resp:
                        location = resp.headers.get("Location")
                        if resp.status in REDIRECTS and location:
                            url = _redirected(url, location)
                            continue
                        if 400 <= resp.status < 500:
                            raise MediaNotFound(f"the origin answered {resp.status} for {url}")
                        if resp.status != 200:
                            raise _Retriable(f"the origin answered {resp.status}")
                        return await self._read_body(resp, cap)
        except MmsplitError:
            raise
        except TimeoutError as exc:
            raise _Retriable("no answer in time, or the connection failed") from exc
        except aiohttp.ClientPayloadError as exc:
            raise _Retriable("the body was cut short") from exc
        except (aiohttp.ClientError, OSError) as exc:
            # Read the same as a timeout: which one it was would tell a
            # stranger whether a port is open.
            raise _Retriable("no answer in time, or the connection failed") from exc
        raise MediaFetchFailed(f"more than {MAX_REDIRECTS} redirects starting at {url}")

    async def _read_body(self, resp: aiohttp.ClientResponse, cap: int) -> bytes:
        if resp.content_length is not None and resp.content_length > cap:
            raise MediaTooLarge(f"the origin announces {resp.content_length} bytes, over the limit of {cap}")
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_chunked(CHUNK):
            total += len(chunk)
            if total > cap:
                raise MediaTooLarge(f"the origin sent over {cap} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_url(self, url: str) -> None:
        """Every hop: scheme, allowed domains, and an IP literal's address
        (names are vetted by the resolver, as they are resolved). The
        client's URL was parsed already (`MediaLoader.load`), a redirect's by
        `_redirected`."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaSourceForbidden(f"{url} is not an http(s) URL")
        host = parts.hostname.lower()
        if self._domains and not any(host == d or host.endswith("." + d) for d in self._domains):
            raise MediaSourceForbidden(f"{host} is not among the allowed domains")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise MediaSourceForbidden(f"{url} has an invalid port") from exc
        try:
            literal = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if _NUMERIC_HOST.fullmatch(host):
                raise MediaSourceForbidden(f"{host} is a numeric host that is not a canonical address") from None
            return
        if self.settings.allow_private_fetch or f"{host}:{port}" in self._exempt:
            return
        if not is_public(str(literal)):
            raise MediaSourceForbidden(f"{host} is not a public address")


def _redirected(url: str, location: str) -> str:
    """Where a redirect from `url` to `location` goes. A Location that is
    not a URL is the origin's fault (MediaFetchFailed), not ours: it would
    otherwise raise ValueError, an internal error, from deep in urllib."""
    try:
        target = urllib.parse.urljoin(url, location)
        urllib.parse.urlsplit(target)  # what `_check_url` will parse next
    except ValueError as exc:
        raise MediaFetchFailed(f"the origin redirected {url} to {location!r}, which is not a valid URL") from exc
    return target
