"""gRPC server plumbing both services share: health, reflection, binding,
transport security (TLS, mutual TLS, a shared token), logging."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import functools
import hmac
import inspect
import ipaddress
import json
import logging
import multiprocessing.util
import os
import random
import resource
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from mmsplit.client import secrets_in
from mmsplit.errors import MalformedMessage, Unauthenticated
from mmsplit.keepalive import MIN_PING_INTERVAL_MS, keepalive_options
from mmsplit_server import reflection

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_stop_signals(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, grace_s: float, before_exit: Callable[[], None] = lambda: None
) -> None:
    """SIGTERM or SIGINT sets `stop` (the service drains, its requests get
    `grace_s`); a second SIGINT (Ctrl-C again) ends the process at once,
    exit 1, after `before_exit`, and says so; a second SIGTERM, as
    orchestrators resend it, lets the drain go on."""

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: stopping; running requests get up to %.1fs (Ctrl-C again to stop at once)", sig.name, grace_s)
            stop.set()
        elif sig != signal.SIGINT:
            log.info("%s again: still stopping", sig.name)
        else:
            log.warning("%s again: stopping at once", sig.name)
            before_exit()
            exit_now(1)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)


def run_service(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)`, with SIGTERM and SIGINT ignored from the moment
    `main` ends to the process's exit. `main` handles the first one (its
    loop's handler starts the graceful stop); once it has stopped, another
    must not kill the process with -15 instead of letting it exit with its
    own status. Closing the loop puts back the default action, so it is
    kept from doing that (`_ignore_stop_signals`): a second or so of
    interpreter teardown with torch loaded, and the loop's own close, were
    both windows in which a SIGTERM killed either service."""

    async def guarded() -> int:
        try:
            return await main
        finally:
            _ignore_stop_signals(asyncio.get_running_loop())

    try:
        return asyncio.run(guarded())
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """SIGTERM and SIGINT ignored from now on, with no moment at their
    default action between: ignored first, then taken out of the loop's
    table of handlers, so that closing the loop (which removes each handler
    it holds, putting the default action back) leaves them ignored. The
    table is the Unix loop's own (`_signal_handlers`); a loop without one
    keeps the moment at the default action that `run_service` closes after
    it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    table = getattr(loop, "_signal_handlers", None)
    if not isinstance(table, dict):
        return
    for sig in STOP_SIGNALS:
        table.pop(sig, None)
    if not table:
        # What removing the last handler does: no wake-up writes to the
        # loop's self-pipe, which its close is about to close.
        signal.set_wakeup_fd(-1)


# A service holds one descriptor per shared-memory slice or segment it holds
# (the lock lives on it): the tokenizer for each item in flight and each
# entry of its preprocessing cache, the scheduler's rank 0 for each image of
# every queued request, every rank for each image of its step. Some
# container runtimes start processes with a soft limit of 1024.
WANT_OPEN_FILES = 65536


def raise_fd_limit(want: int = WANT_OPEN_FILES) -> int:
    """Raise this process's soft limit on open files towards `want` (never
    past the hard limit, never lower); the limit now. Children started
    afterwards (ranks, the preprocessing pool's forkserver) inherit it. A
    process still out of descriptors gets OVERLOADED, retriable (`shm`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning(
            "open-file limit %d: each image in flight holds a descriptor; raise the hard limit (ulimit -Hn)", soft
        )
    return soft


def name_process(name: bytes) -> None:
    """Set this process's name as `ps` and `top` show it (prctl
    PR_SET_NAME, at most 15 bytes); nothing where that is not Linux."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)


# Set by `mmsplit serve` in its services' environment: the pid of the
# process whose death must stop them (`stop_with_parent`).
PARENT_ENV = "MMSPLIT_STOP_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """Where PARENT_ENV names this process's parent (a service that
    `mmsplit serve`, `make demo` or a benchmark started:
    `mmsplit_cli.launch.ServiceProcess`), have the kernel send this process
    SIGTERM when that parent ends, however it ends: a launcher killed
    outright (SIGKILL, the OOM killer) otherwise left its services running,
    holding their ports and memory, with nobody to stop them. SIGTERM is a
    service's usual stop (it drains). The variable is removed so that
    nothing this process starts inherits it; a parent already gone stops
    this process now."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # it ended before the request above
        os.kill(os.getpid(), signal.SIGTERM)


# (pid, cleanup): what `exit_now` runs, in the process that registered it.
_exit_cleanups: list[tuple[int, Callable[[], None]]] = []


def at_exit_now(cleanup: Callable[[], None]) -> None:
    """Have `exit_now` run `cleanup` (in this process only, not in a fork
    of it), for what must not outlive the process, such as a directory. An
    OSError from it is ignored."""
    _exit_cleanups.append((os.getpid(), cleanup))


def remove_multiprocessing_dir() -> None:
    """Remove this process's multiprocessing temporary directory (/tmp/pymp-*,
    where a forkserver started the usual way listens), as multiprocessing's
    exit hook would: `os._exit` skips that hook, and the directories added up
    (one per tokenizer run). Only in the process that made it: the hook's
    finalizer does nothing in a fork, which inherits the directory's name
    and must not remove it from under its parent."""
    util = multiprocessing.util
    remove = getattr(util, "_remove_temp_dir", None)
    for finalizer in list(getattr(util, "_finalizer_registry", {}).values()):
        if remove is not None and getattr(finalizer, "_callback", None) is remove:
            with contextlib.suppress(OSError):  # removed already: nothing left to do
                finalizer()


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its logs are out, without the
    interpreter's teardown (of torch and transformers: ~1 s here): for a
    service or rank that has stopped in order (its servers, pools, ranks and
    segments already closed), or one that must not wait for a thread stuck
    in a collective. What of the exit hooks would outlive the process is
    done here: multiprocessing's temporary directory is removed
    (`remove_multiprocessing_dir`), and what `at_exit_now` registered runs."""
    remove_multiprocessing_dir()
    for pid, cleanup in reversed(_exit_cleanups):
        if pid == os.getpid():
            with contextlib.suppress(OSError):
                cleanup()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PORTS_BELOW_EPHEMERAL = 10000  # where free_port looks: [this, the ephemeral range's start)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for rendezvous and test servers),
    chosen at random below the kernel's ephemeral range: a port from that
    range (what binding port 0 gives) can be taken by any process's next
    outgoing connection, or handed to another caller, before it is bound."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(200 if low > PORTS_BELOW_EPHEMERAL + 1000 else 0):
        port = random.randrange(PORTS_BELOW_EPHEMERAL, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, pid, logger, message, the
    record's ``fields`` (a dict given as ``extra={"fields": ...}``: the
    per-request summary puts its request id, outcome and timings there), and
    the exception's traceback text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RequestSummary:
    """One log line per finished request (its fields are JSON keys with
    `--log-format json`): request id, outcome (OK, an ErrorCode, or
    CANCELLED when the caller went away), finish reason, tokens, duration and
    time to first token, plus what the service adds (media counts)."""

    def __init__(self, rid: str, *, quiet: bool = False, **fields: object) -> None:
        self.rid = rid
        self.fields = fields
        # A scheduler's GenerateRequest.search_step: logged at debug, not
        # info, and counted apart from the request metrics.
        self.quiet = quiet
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.outcome = "CANCELLED"  # unless the stream ends or fails
        self.finish_reason = ""
        self.prompt_tokens = self.completion_tokens = 0
        # Tokens streamed so far: what a request that did not finish (cut,
        # failed) reports as its completion tokens.
        self.streamed = 0

    def token(self, n: int = 1) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.streamed += n

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.outcome = "OK"
        self.finish_reason = finish_reason.removeprefix("FINISH_REASON_")
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens

    def log(self, logger: logging.Logger, metrics: Any = None) -> None:
        """Log the line; count it in `metrics` (a `mmsplit_server.metrics.ServiceMetrics`) too."""
        if self.outcome != "OK":
            self.completion_tokens = self.streamed
        duration = time.perf_counter() - self.start
        ttft = None if self.first_token is None else self.first_token - self.start
        if metrics is not None and self.quiet and metrics.search_steps is not None:  # counted apart
            metrics.search_steps.labels(outcome=self.outcome).inc()
        elif metrics is not None:
            metrics.finished(self.outcome, duration, ttft, self.prompt_tokens, self.completion_tokens)
        fields = {
            "request_id": self.rid,
            "outcome": self.outcome,
            "finish_reason": self.finish_reason,
            **self.fields,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "duration_s": round(duration, 4),
            "ttft_s": None if ttft is None else round(ttft, 4),
        }
        logger.log(
            logging.DEBUG if self.quiet else logging.INFO,
            "request %s finished: %s, %d+%d tokens in %.3fs",
            self.rid,
            self.outcome,
            self.prompt_tokens,
            self.completion_tokens,
            duration,
            extra={"fields": fields},
        )


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # A crash in native code (gRPC, torch) writes every thread's Python
    # stack to the log before the process dies, instead of nothing.
    faulthandler.enable(sys.stderr, all_threads=True)


class _HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1's Check and Watch, whose Watch streams end with status
    OK at `end_watches` (grpc's own servicer never ends one). A gRPC
    server's stop cancels what is still open when its grace runs out and
    logs each at ERROR with a CancelledError traceback ("Exception not
    handled by _handle_exceptions in servicer method
    [/grpc.health.v1.Health/Watch]"): the tokenizer's client-side health
    checking of its scheduler, slow to drop its watch on a busy host, was
    seen so at a clean Ctrl-C. A watch asked for after the end ends at once,
    after its one status. A watch writes without holding the lock `set`
    takes, so a slow watcher never holds up a change of status."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._version = 0
        self._ended = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802
        status = self._status.get(request.service)
        if status is None:
            unknown = status_pb2.Status(
                code=grpc.StatusCode.NOT_FOUND.value[0], message=f"no service {request.service!r}"
            )
            await abort(context, rpc_status.to_status(unknown))
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802
        sent, seen = None, -1
        while True:
            async with self._changed:
                while self._version == seen and not self._ended:
                    await self._changed.wait()
                seen, ended = self._version, self._ended
                status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if ended:
                return

    async def set(self, service: str, status: int) -> None:
        async with self._changed:
            self._status[service] = status
            self._version += 1
            self._changed.notify_all()

    async def end_watches(self) -> None:
        async with self._changed:
            self._ended = True
            self._changed.notify_all()


class Health:
    """grpc.health.v1 for one service: "" reports liveness (SERVING while the
    process serves at all), the full service name reports readiness."""

    def __init__(self, service_name: str) -> None:
        self.service_name = service_name
        self.servicer = _HealthServicer()
        self._ready = False

    async def stopping(self) -> None:
        """The server stops next: its watch streams end now (OK), not cut
        off by the stop (`_HealthServicer`)."""
        await self.servicer.end_watches()

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self.servicer.set(self.service_name, NOT_SERVING)

    @property
    def ready(self) -> bool:
        return self._ready

    async def set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            log.info("%s readiness: %s", self.service_name, "SERVING" if ready else "NOT_SERVING")
        self._ready = ready
        await self.servicer.set(self.service_name, SERVING if ready else NOT_SERVING)


HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
AUTHORIZATION = "authorization"


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class SecretFile:
    """A file of secrets (tokens, API keys), one per line, blank lines and
    lines starting with # aside, read again whenever it changes, so that
    credentials rotate without a restart: a server accepts every secret of
    its file, a client presents the first of its own. (A Kubernetes Secret
    mounted as a volume is updated by swapping its files in place; a file
    edited in place is seen too.) A change that leaves the file unreadable
    or empty keeps the secrets read last, said once in the log: a
    half-written file must neither lock every caller out nor let anyone in.
    At start, an unreadable or empty file is an error (OSError, ValueError)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._secrets: tuple[str, ...] = ()
        self._failing = False
        self._refresh(strict=True)

    def secrets(self) -> tuple[str, ...]:
        """The secrets, as the file holds them now (one stat a call)."""
        self._refresh(strict=False)
        return self._secrets

    def first(self) -> str:
        return self.secrets()[0]

    def _refresh(self, *, strict: bool) -> None:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._seen:
                return
            secrets = secrets_in(self.path.read_text())
            if not secrets:
                raise ValueError(f"{self.path} holds no secret (one per line)")
        except (OSError, ValueError) as exc:
            if strict:
                raise
            if not self._failing:
                log.error("%s could not be read again (%s); the secrets read last stay in use", self.path, exc)
                self._failing = True
            return
        if self._seen is not None:
            log.info("%s changed: %d secret(s) in use", self.path, len(secrets))
        self._seen, self._secrets, self._failing = key, secrets, False


_Security = TypeVar("_Security", "ServerSecurity", "ClientSecurity")


def _with_token_file(cls: type[_Security], path: str, tls: dict[str, Any]) -> _Security:
    if not path:
        return cls(**tls)
    tokens = SecretFile(path)
    return cls(**tls, token=tokens.first(), token_file=tokens)


@dataclass(frozen=True)
class ServerSecurity:
    """How a server's port is protected. TLS with `cert` and `key`; mutual
    TLS when `client_ca` is set too (clients must present a certificate it
    signed); `token`: every call but health checks must carry
    ``authorization: Bearer <token>`` (`token_file`: any token of the file,
    as it is now)."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    token: str = ""
    token_file: SecretFile | None = None

    @classmethod
    def with_token_file(cls, path: str, **tls: Any) -> ServerSecurity:
        """Calls must bear a token of the file at `path` ("": none)."""
        return _with_token_file(cls, path, tls)

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert:
            return None
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        root = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if self.token_file is not None:
            return [TokenAuth(self.token_file.secrets)]
        token = self.token
        return [TokenAuth(lambda: (token,))] if token else []


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a protected server: TLS trusting `ca` (and
    presenting `cert`/`key` for mutual TLS); `token` sent with every call
    (`token_file`: the first token of the file, as it is now);
    `server_name` overrides the name the server's certificate must carry."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = ""
    server_name: str = ""
    token_file: SecretFile | None = None

    @classmethod
    def with_token_file(cls, path: str, **tls: Any) -> ClientSecurity:
        """Calls bear the first token of the file at `path` ("": none)."""
        return _with_token_file(cls, path, tls)

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        opts = list(options)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if not self.ca:
            return grpc.aio.insecure_channel(target, options=opts)
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )
        return grpc.aio.secure_channel(target, creds, options=opts)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.token_file.first() if self.token_file is not None else self.token
        return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def end_with(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """End the call with `status` once its handler returns: what
    `abort_with_status` sends, without its AbortError. grpc.aio keeps that
    error on the call's state (`RPCState.abort_exception`), and its
    traceback holds every frame it passed through, the call's state among
    their locals: a reference cycle that kept each failed request's frames
    and locals (its request, its images' bytes) alive until a full
    collection. For streaming handlers only (they return after this): a
    unary handler's return sends its message, even an empty one, before a
    non-OK status, where `abort` sends none."""
    context.set_trailing_metadata(status.trailing_metadata)
    context.set_code(status.code)
    context.set_details(status.details)


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> NoReturn:
    """End a unary call with `status` (a unary handler that returns sends
    its message, even an empty one, before a non-OK status: `end_with` is
    for streaming ones). grpc.aio keeps the AbortError this raises on the
    call's state, and its traceback holds every frame it leaves, the
    handler's among them, with the call's context: a reference cycle that
    kept each such call's request (its images' bytes) until a full
    collection. Once the call is done, the error lets go of its traceback
    and of any exception it was raised while handling. Call it outside an
    `except` block: an exception bound there (`except E as exc`) stays in
    its handler's frame, in a cycle of its own through its traceback."""
    try:
        await context.abort_with_status(status)
    except BaseException as exc:
        context.add_done_callback(functools.partial(_forget, exc))
        raise
    raise AssertionError("abort_with_status returned")


def _forget(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and our ErrorInfo, every call that does
    not carry a shared token (`tokens()`: those accepted now) — except
    health checks, which orchestrators' probes make without credentials and
    which tell nothing but a status. Each comparison takes the same time
    whatever the token presented."""

    def __init__(self, tokens: Callable[[], Sequence[str]]) -> None:
        self._tokens = tokens

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            # Aborted: this unary handler answers streaming methods too, and
            # ended with its status set it would send them an empty message
            # first (`end_with`).
            del request  # not kept while the call ends (`abort`)
            await abort(context, Unauthenticated("this server requires a token").to_status())

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTHORIZATION:
                presented = value.encode() if isinstance(value, str) else value
        # Every accepted token compared (no early stop: the time says nothing of which matched).
        if any([hmac.compare_digest(presented, f"Bearer {t}".encode()) for t in self._tokens()]):
            return await continuation(handler_call_details)
        return self._deny


class _Malformed:
    """What a request that does not parse becomes, for its handler to refuse."""


_Request = TypeVar("_Request")


class Handed(Generic[_Request]):
    """A request handed to whoever takes it (`take`), its giver keeping no
    reference to it: a protobuf message's strings and bytes are freed only
    with the whole message, so a streamed call's request (a data: URL's
    megabytes) would otherwise live as long as every frame that was given
    it, the answer's end. The taker keeps what it needs once it has used
    the rest. gRPC's own frames hold a unary-request call's request until
    the call ends: for the methods `new_server` is told to hand over
    (`handed`), its servicer is given this instead."""

    __slots__ = ("_request",)

    def __init__(self, request: _Request) -> None:
        self._request: _Request | None = request

    @classmethod
    def of(cls, request: Handed[_Request] | _Request) -> Handed[_Request]:
        """`request` if handed over already, else handed over now (the
        giver of a plain request keeps its own reference)."""
        return request if isinstance(request, Handed) else cls(request)

    @property
    def request(self) -> _Request:
        """The request, not taken (a look at it: keep no reference)."""
        if self._request is None:
            raise RuntimeError("the request was handed over already")
        return self._request

    def take(self) -> _Request:
        request = self.request
        self._request = None
        return request


async def _refuse_malformed(context: grpc.aio.ServicerContext) -> NoReturn:
    await abort(
        context, MalformedMessage("the request is not a valid protobuf message of this method's type").to_status()
    )


def _refusing_malformed(handler: grpc.RpcMethodHandler, handed: bool = False) -> grpc.RpcMethodHandler:
    """`handler` with a parse failure answered INVALID_ARGUMENT (our
    ErrorInfo, INVALID_REQUEST) before the servicer acts on it: a unary
    request is checked before the servicer runs; in a streamed request
    (reflection's) the first message that does not parse ends the call.
    `handed`: the servicer is given the request in a `Handed`, and no
    frame of gRPC's keeps its bytes (for a unary request and a streamed
    answer, the one kind that needs it: its call lasts as long as its
    answer)."""
    parse = handler.request_deserializer
    assert parse is not None

    def tolerant(raw: bytes) -> object:
        try:
            request = parse(raw)
        except DecodeError:
            return _Malformed()
        return Handed(request) if handed else request

    async def checked_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse_malformed(context)
            yield request

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        """What the servicer is given: the request, or its stream, checked."""
        if handler.request_streaming:
            return checked_stream(request, context)
        if isinstance(request, _Malformed):
            await _refuse_malformed(context)
        return request

    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    servicer = getattr(handler, kind)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    if not handler.response_streaming or not inspect.isasyncgenfunction(servicer):
        # One answer, or a stream the servicer writes with context.write.

        async def answer(request: Any, context: grpc.aio.ServicerContext) -> object:
            return await servicer(await checked(request, context), context)

        return make(answer, tolerant, handler.response_serializer)

    async def relay(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Closed with this generator, so the servicer's own clean-up (its
        # `finally`) runs when gRPC closes the call, not when it is collected.
        async with contextlib.aclosing(servicer(await checked(request, context), context)) as events:
            async for event in events:
                yield event

    if not (handed and kind == "unary_stream"):
        return make(relay, tolerant, handler.response_serializer)

    async def relay_handed(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        # Its one request read as a stream of them (on the wire a call is
        # the same either way): grpc.aio's handler of a unary request keeps
        # that request's bytes until the call ends, its reader of a stream
        # only until they are parsed (here, into a `Handed`).
        try:
            request = await requests.__anext__()
        except StopAsyncIteration:
            request = _Malformed()  # a call without its request
        async with contextlib.aclosing(relay(request, context)) as events:
            del request
            async for event in events:
                yield event

    return grpc.stream_stream_rpc_method_handler(relay_handed, tolerant, handler.response_serializer)


class RefuseMalformed(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse as its method's message gets
    INVALID_ARGUMENT with our ErrorInfo (INVALID_REQUEST), where gRPC itself
    answers UNKNOWN and names protobuf's exception: every method, ours,
    health's and reflection's (whose requests are a stream: the first that
    does not parse ends the call). One wrapped handler per method, made on
    its first call. The servicers of the `handed` methods (full names,
    "/package.Service/Method") are given their request in a `Handed`."""

    def __init__(self, handed: Iterable[str] = ()) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._handed = frozenset(handed)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method or ""
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, _refusing_malformed(handler, method in self._handed))
        return known[1]


async def new_server(
    *,
    host: str,
    port: int,
    health_: Health,
    service_names: list[str],
    max_message_bytes: int,
    security: ServerSecurity | None = None,
    max_concurrent_rpcs: int | None = None,
    keepalive_s: float = 0.0,
    keepalive_timeout_s: float = 10.0,
    max_connection_age_s: float = 0.0,
    max_connections: int = 0,
    handed: Iterable[str] = (),
) -> tuple[grpc.aio.Server, int]:
    """A server with health and reflection registered; returns it and its bound
    port (`port` 0 picks a free one). The servicers of the `handed` methods
    are given their request in a `Handed` (`RefuseMalformed`). The caller adds its servicers first via
    the returned server, then starts it. It pings its clients as
    `keepalive_options` says, and accepts their pings up to one a second,
    with or without calls. With `max_connection_age_s`, each connection is
    sent GOAWAY after that long (gRPC adds ±10 %): its calls run to their
    end on it, and the client opens a new one for the next, which a load
    balancer in front may send to another server. With `max_connections`,
    a connection accepted past that many open ones is closed at once (gRPC
    core's own limit: the client sees UNAVAILABLE and retries)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        *keepalive_options(keepalive_s, keepalive_timeout_s),
    ]
    if max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)))
    if max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    security = security or ServerSecurity()
    # Credentials first: a caller without them learns nothing, not even
    # whether its bytes parse.
    interceptors = [*security.interceptors(), RefuseMalformed(handed)]
    server = grpc.aio.server(options=options, interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs)
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    reflection.enable([*service_names, HEALTH_SERVICE], server)
    credentials = security.credentials()
    address = f"{host}:{port}"
    if credentials:
        return server, _bound(host, port, lambda: server.add_secure_port(address, credentials))
    return server, _bound(host, port, lambda: server.add_insecure_port(address))


async def health_server(host: str, port: int, health_: Health) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of grpc.health.v1 alone, for orchestrators' probes
    when the main port is TLS-only or bound to loopback."""
    server = grpc.aio.server(interceptors=[RefuseMalformed()])
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    bound = _bound(host, port, lambda: server.add_insecure_port(f"{host}:{port}"))
    await server.start()
    return server, bound


def _bound(host: str, port: int, add: Callable[[], int]) -> int:
    """The port a gRPC server's `add` bound; one it cannot bind is an
    OSError, as Python's own servers raise it (grpc raises RuntimeError,
    "Failed to bind to address", and only logs why; older versions
    returned 0): why, as a socket of our own finds it."""
    try:
        bound = add()
    except RuntimeError:
        bound = 0
    if bound == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            s.bind((host, port))  # raises why, as a rule
        raise OSError(f"gRPC cannot bind {host}:{port}")
    return bound


@contextlib.contextmanager
def serving_on(service: str, what: str, host: str, port: int) -> Iterator[None]:
    """Around the binding of a service's port: a port taken since the
    start-up checks passed (`mmsplit_cli.startup.port_problem`; another
    process bound it in between) ends the service with one line naming it,
    as the check would have, where it once left a traceback (and, in a
    scheduler of several ranks, a rank 0 that waited for ever on its ranks
    as it exited)."""
    try:
        yield
    except OSError as exc:
        raise SystemExit(f"mmsplit {service}: cannot serve {what} on {host}:{port}: {exc}") from exc
