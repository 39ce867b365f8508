"""DNS resolvers substituted through configuration (the tokenizer's
`--fetch-resolver module:factory`): hostile answers without a DNS server."""

from __future__ import annotations

import socket

from aiohttp.abc import AbstractResolver, ResolveResult


class _Scripted(AbstractResolver):
    """Answers every name with the next list of addresses in `script`."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.calls = 0

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        addresses = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return [
            ResolveResult(hostname=host, host=a, port=port, family=socket.AF_INET, proto=0, flags=0) for a in addresses
        ]

    async def close(self) -> None:
        pass


def public_then_loopback() -> AbstractResolver:
    """One answer holding a public address first and loopback second."""
    return _Scripted([["93.184.216.34", "127.0.0.1"]])


def rebinding() -> AbstractResolver:
    """A rebinding name: public on the first query, loopback on every later one."""
    return _Scripted([["93.184.216.34"], ["127.0.0.1"]])
