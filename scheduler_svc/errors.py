"""Errors of the scheduler service.

Hierarchy (the shared base lives in `mmsplit.errors`)::

    MmsplitError
    ├── InvalidRequest             client: malformed request (INVALID_REQUEST)
    ├── InvalidSampling            client: sampling parameter out of limits (mmsplit_server.sampling)
    ├── InvalidTensorRef           client: malformed reference (mmsplit_server.handoff.reference)
    ├── NonFinitePixels            client: NaN/Inf in a pixel tensor, found on every rank
    ├── TensorTransportFailed      server, retriable: a rank could not read (mmsplit_server.handoff.reference)
    ├── Overloaded                 server, retriable: admission queue full
    ├── SchedulerUnavailable       server, retriable: a rank died, a collective failed
    ├── ShuttingDown               server, retriable: draining on SIGTERM (mmsplit.errors)
    └── InternalError              server: a bug; also one request's non-finite
                                   logits or failed sampling (that request alone)
"""

from __future__ import annotations

from mmsplit.errors import E, InternalError, MmsplitError, ShuttingDown
from mmsplit_server.handoff.reference import InvalidTensorRef, TensorTransportFailed
from mmsplit_server.sampling import InvalidSampling

__all__ = [
    "InternalError",
    "InvalidRequest",
    "InvalidSampling",
    "InvalidTensorRef",
    "MmsplitError",
    "NonFinitePixels",
    "Overloaded",
    "SchedulerUnavailable",
    "ShuttingDown",
    "TensorTransportFailed",
    "error_for_code",
]


class InvalidRequest(MmsplitError):
    """The request is malformed (client; a retry cannot help)."""

    code = E.ERROR_CODE_INVALID_REQUEST


class NonFinitePixels(MmsplitError):
    """A pixel tensor holds NaN or infinite values (client; a retry cannot help).
    Checked on every rank from the same bytes, before any model collective."""

    code = E.ERROR_CODE_INVALID_REQUEST


class Overloaded(MmsplitError):
    """Admission queue full (server; retry later)."""

    code = E.ERROR_CODE_OVERLOADED


class SchedulerUnavailable(MmsplitError):
    """A rank died, a collective timed out, or the group is shutting down
    (server; a retry after the group restarts can help)."""

    code = E.ERROR_CODE_SCHEDULER_UNAVAILABLE


_BY_CODE: dict[int, type[MmsplitError]] = {
    cls.code: cls
    for cls in (InvalidRequest, InvalidTensorRef, TensorTransportFailed, Overloaded, SchedulerUnavailable, ShuttingDown)
}


def error_for_code(code: int, message: str, metadata: dict[str, str] | None = None) -> MmsplitError:
    """The error class that carries `code`, for verdicts that cross ranks as integers."""
    return _BY_CODE.get(code, InternalError)(message, metadata=metadata)
