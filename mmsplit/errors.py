"""Error codes and their one mapping to gRPC status (DESIGN.md §4).

Hierarchy::

    MmsplitError                      base: an ErrorCode, a message, metadata
    ├── (tokenizer_svc.errors.*)      raised by the tokenizer service
    ├── (scheduler_svc.errors.*)      raised by the scheduler service
    ├── InternalError                 a bug on our side
    ├── ShuttingDown                  the server is draining (both services)
    ├── Unauthenticated               no valid credentials (token, client certificate)
    ├── MalformedMessage              the request's bytes are not its method's message
    └── RemoteError                   an error a peer reported over gRPC

Every foreign exception is translated once, where it enters our code, into an
`MmsplitError` (``raise ... from exc``). `to_status` then turns it into a gRPC
status carrying ``google.rpc.ErrorInfo{reason, domain="mmsplit", metadata}``
and `RemoteError.from_rpc_error` reads one back. `TABLE` is the only place that
says which gRPC code and retry advice a code gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mmsplit.common.v1 import common_pb2

DOMAIN = "mmsplit"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
E = common_pb2.ErrorCode


@dataclass(frozen=True)
class Kind:
    grpc_code: grpc.StatusCode
    caused_by: str  # "client", "server" or "origin"
    retriable: bool


TABLE: dict[int, Kind] = {
    E.ERROR_CODE_INVALID_REQUEST: Kind(grpc.StatusCode.INVALID_ARGUMENT, "client", False),
    E.ERROR_CODE_MEDIA_DECODE_FAILED: Kind(grpc.StatusCode.INVALID_ARGUMENT, "client", False),
    E.ERROR_CODE_MEDIA_UNSUPPORTED: Kind(grpc.StatusCode.INVALID_ARGUMENT, "client", False),
    E.ERROR_CODE_MEDIA_TOO_LARGE: Kind(grpc.StatusCode.INVALID_ARGUMENT, "client", False),
    E.ERROR_CODE_MEDIA_NOT_FOUND: Kind(grpc.StatusCode.INVALID_ARGUMENT, "client", False),
    E.ERROR_CODE_MEDIA_SOURCE_FORBIDDEN: Kind(grpc.StatusCode.PERMISSION_DENIED, "client", False),
    E.ERROR_CODE_MEDIA_FETCH_FAILED: Kind(grpc.StatusCode.UNAVAILABLE, "origin", True),
    E.ERROR_CODE_PREPROCESS_TIMEOUT: Kind(grpc.StatusCode.DEADLINE_EXCEEDED, "server", True),
    E.ERROR_CODE_PREPROCESS_WORKER_CRASHED: Kind(grpc.StatusCode.UNAVAILABLE, "server", True),
    E.ERROR_CODE_OVERLOADED: Kind(grpc.StatusCode.RESOURCE_EXHAUSTED, "server", True),
    E.ERROR_CODE_FEATURE_TRANSPORT_FAILED: Kind(grpc.StatusCode.INTERNAL, "server", True),
    E.ERROR_CODE_SCHEDULER_UNAVAILABLE: Kind(grpc.StatusCode.UNAVAILABLE, "server", True),
    E.ERROR_CODE_CANCELLED: Kind(grpc.StatusCode.CANCELLED, "client", False),
    E.ERROR_CODE_DEADLINE_EXCEEDED: Kind(grpc.StatusCode.DEADLINE_EXCEEDED, "client", False),
    E.ERROR_CODE_SHUTTING_DOWN: Kind(grpc.StatusCode.UNAVAILABLE, "server", True),
    E.ERROR_CODE_INTERNAL: Kind(grpc.StatusCode.INTERNAL, "server", False),
    E.ERROR_CODE_UNAUTHENTICATED: Kind(grpc.StatusCode.UNAUTHENTICATED, "client", False),
}


def reason_of(code: int) -> str:
    """The ErrorInfo reason of a code: its enum name without ERROR_CODE_."""
    return E.Name(code).removeprefix("ERROR_CODE_")


def code_of_reason(reason: str) -> int:
    """Inverse of `reason_of`; unknown reasons read as INTERNAL."""
    try:
        return E.Value("ERROR_CODE_" + reason)
    except ValueError:
        return E.ERROR_CODE_INTERNAL


class MmsplitError(Exception):
    """A failure with an ErrorCode. Subclasses fix `code`; who caused it and
    whether a retry can help follow from `TABLE`."""

    code: ClassVar[int] = E.ERROR_CODE_INTERNAL

    def __init__(self, message: str, *, metadata: dict[str, str] | None = None, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})
        # When set, the status tells clients whose retry policy retries it to
        # wait exactly this long first (gRPC's server pushback, gRFC A6).
        self.retry_after_ms = retry_after_ms

    @property
    def error_code(self) -> int:
        return self.code

    @property
    def reason(self) -> str:
        return reason_of(self.error_code)

    @property
    def kind(self) -> Kind:
        return TABLE[self.error_code]

    def to_status(self, request_id: str = "") -> grpc.Status:
        """The gRPC status to end an RPC with (`context.abort_with_status`)."""
        metadata = {"retriable": str(self.kind.retriable).lower(), **self.metadata}
        if request_id:
            metadata["request_id"] = request_id
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=metadata)
        detail = any_pb2.Any()
        detail.Pack(info)
        status = status_pb2.Status(code=self.kind.grpc_code.value[0], message=self.message, details=[detail])
        converted = rpc_status.to_status(status)
        if self.retry_after_ms > 0 and self.kind.retriable:
            pushback = (RETRY_PUSHBACK_KEY, str(self.retry_after_ms))
            converted = converted._replace(trailing_metadata=(*converted.trailing_metadata, pushback))
        return converted

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class InternalError(MmsplitError):
    """A bug on our side (server, not retriable)."""

    code = E.ERROR_CODE_INTERNAL


class ShuttingDown(MmsplitError):
    """The server is draining for shutdown (server; retry elsewhere)."""

    code = E.ERROR_CODE_SHUTTING_DOWN


class Unauthenticated(MmsplitError):
    """The caller presented no valid credentials (client, not retriable)."""

    code = E.ERROR_CODE_UNAUTHENTICATED


class MalformedMessage(MmsplitError):
    """The request's bytes do not parse as its method's protobuf message
    (client, not retriable): the one check no servicer can make, since
    gRPC parses before it calls one (`mmsplit_server.serving.RefuseMalformed`)."""

    code = E.ERROR_CODE_INVALID_REQUEST


class RemoteError(MmsplitError):
    """An error a peer reported over gRPC, with the peer's code preserved so it
    can be relayed unchanged."""

    def __init__(self, code: int, message: str, *, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message, metadata=metadata)
        self._code = code

    @property
    def error_code(self) -> int:
        return self._code

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError, *, unavailable_code: int = E.ERROR_CODE_INTERNAL) -> RemoteError:
        """Read the ErrorInfo of a failed call. A status without our ErrorInfo
        (the peer is not ours, or the transport failed) maps by gRPC code:
        UNAVAILABLE to `unavailable_code`, CANCELLED and DEADLINE_EXCEEDED to
        themselves, anything else to INTERNAL."""
        info = error_info_of(exc)
        grpc_code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else None) or str(grpc_code)
        if info is not None and info.domain == DOMAIN:
            metadata = {k: v for k, v in info.metadata.items() if k not in ("request_id", "retriable")}
            return cls(code_of_reason(info.reason), details, metadata=metadata)
        fallback = {
            grpc.StatusCode.UNAVAILABLE: unavailable_code,
            grpc.StatusCode.CANCELLED: E.ERROR_CODE_CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED: E.ERROR_CODE_DEADLINE_EXCEEDED,
        }.get(grpc_code, E.ERROR_CODE_INTERNAL)
        return cls(fallback, details)


def error_info_of(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo in a failed call's trailing metadata, if there is one."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info
    return None
