"""Errors of the tokenizer service, one class per ErrorCode it raises.

Hierarchy (the shared base lives in `mmsplit.errors`)::

    MmsplitError
    ├── InvalidRequest            client  no retry  bad prompt, too many images, bad source
    ├── InvalidSampling           client  no retry  sampling parameter out of limits (mmsplit_server.sampling)
    ├── MediaDecodeFailed         client  no retry  truncated/corrupt bytes, lazy-decode failure
    ├── MediaUnsupported          client  no retry  not an image we accept (format, mode)
    ├── MediaTooLarge             client  no retry  bytes, pixels, decompression bomb
    ├── MediaNotFound             client  no retry  origin 4xx, missing file
    ├── MediaSourceForbidden      client  no retry  not allowed: scheme, path, private address
    ├── MediaFetchFailed          origin  retry     timeouts, connection errors, 5xx after retries
    ├── PreprocessTimeout         server  retry     decode + preprocessing over budget
    ├── PreprocessWorkerCrashed   server  retry     a worker died under this request twice
    ├── Overloaded                server  retry     too many requests in flight, /dev/shm full
    ├── SchedulerUnavailable      server  retry     the scheduler is unreachable or down
    ├── ShuttingDown              server  retry     this server is draining (mmsplit.errors)
    └── RemoteError               (as sent)         the scheduler's own error, relayed unchanged

PreprocessWorkerCrashed after two crashes: a pool break has innocent victims
(every request that shared the pool), so the first crash is retried on the
new pool. An input that kills a worker again is most likely the cause, but we
cannot prove it was not the machine (OOM killer, a bad node), so the code stays
the retriable server-side PREPROCESS_WORKER_CRASHED rather than a client error.
"""

from __future__ import annotations

from mmsplit.errors import E, InternalError, MmsplitError, RemoteError, ShuttingDown

__all__ = [
    "InternalError",
    "InvalidRequest",
    "MediaDecodeFailed",
    "MediaFetchFailed",
    "MediaNotFound",
    "MediaSourceForbidden",
    "MediaTooLarge",
    "MediaUnsupported",
    "MmsplitError",
    "Overloaded",
    "PreprocessTimeout",
    "PreprocessWorkerCrashed",
    "RemoteError",
    "SchedulerUnavailable",
    "ShuttingDown",
]


class InvalidRequest(MmsplitError):
    code = E.ERROR_CODE_INVALID_REQUEST


class MediaDecodeFailed(MmsplitError):
    code = E.ERROR_CODE_MEDIA_DECODE_FAILED


class MediaUnsupported(MmsplitError):
    code = E.ERROR_CODE_MEDIA_UNSUPPORTED


class MediaTooLarge(MmsplitError):
    code = E.ERROR_CODE_MEDIA_TOO_LARGE


class MediaNotFound(MmsplitError):
    code = E.ERROR_CODE_MEDIA_NOT_FOUND


class MediaSourceForbidden(MmsplitError):
    code = E.ERROR_CODE_MEDIA_SOURCE_FORBIDDEN


class MediaFetchFailed(MmsplitError):
    code = E.ERROR_CODE_MEDIA_FETCH_FAILED


class PreprocessTimeout(MmsplitError):
    code = E.ERROR_CODE_PREPROCESS_TIMEOUT


class PreprocessWorkerCrashed(MmsplitError):
    code = E.ERROR_CODE_PREPROCESS_WORKER_CRASHED


class Overloaded(MmsplitError):
    code = E.ERROR_CODE_OVERLOADED


class SchedulerUnavailable(MmsplitError):
    code = E.ERROR_CODE_SCHEDULER_UNAVAILABLE
