"""Channels to a scheduler as its own user's clients reach it: with the
scheduler's local token (`mmsplit.localauth`), which a scheduler on loopback
with no credentials configured requires on every call but health checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from mmsplit import localauth


class _WithToken(  # type: ignore[misc]
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: localauth.LocalToken) -> None:
        self._token = token

    def _details(self, details: Any) -> Any:
        metadata = (*(details.metadata or ()), *self._token.metadata())
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def scheduler_channel(address: str) -> grpc.Channel:
    """A plaintext channel to the scheduler at `address` that presents its
    local token when it has one (a loopback address of this host)."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _WithToken(localauth.LocalToken(address)))


def metadata(address: str) -> tuple[tuple[str, str], ...]:
    """The local token's metadata for calls to the scheduler at `address`."""
    return localauth.LocalToken(address).metadata()
