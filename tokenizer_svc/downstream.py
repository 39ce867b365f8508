"""The connections to the schedulers, and each one's transport for tensors.

`--scheduler` names one scheduler group or several (data-parallel
replicas): a comma-separated list of HOST:PORT, or ``dns:///NAME:PORT`` for a
headless Service (every address NAME resolves to is a backend; resolved
again on every watch pass). Each backend gets its own channel, with gRPC's
client-side health checking on the scheduler's ready service name (its
service config's ``healthCheckConfig``): a backend that turns NOT_SERVING
(draining, a group going down) stops getting new calls at once, from gRPC
itself. Why one channel per backend rather than one ``round_robin`` channel
over all: the transport is chosen per backend (shared memory only with a
scheduler that shares our /dev/shm, inline bytes with the others) before a
request's media are prepared, so the tokenizer must know which backend a
call goes to; and it prefers the one with the fewest of its own requests
in flight (`Schedulers.pick`), which gRPC Python's policies cannot do.

Shared memory is used with a backend only when its shared-memory namespace
id equals ours (same kernel boot, same /dev/shm) and it accepts our segment
prefix; otherwise tensors travel inline. A transport failure of the call is
SCHEDULER_UNAVAILABLE (retriable); the scheduler's own errors are relayed
with their codes unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Collection

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmsplit import localauth
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError, RemoteError, error_info_of
from mmsplit.keepalive import keepalive_options
from mmsplit.pairing import UNKNOWN, Pairing
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server.families import Family
from mmsplit_server.handoff import files
from mmsplit_server.handoff.reference import DTYPE_BY_NAME
from mmsplit_server.serving import ClientSecurity, Handed
from tokenizer_svc.errors import SchedulerUnavailable
from tokenizer_svc.multiplex import CallEnded, StreamedCalls
from tokenizer_svc.preprocess import PLAIN_ROWS, RowForm
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)
# While the tokenizer waits for its scheduler, a log line this often.
WAIT_LOG_S = 15.0
RECONNECT_INITIAL_MS = 250
RECONNECT_MAX_MS = 2000
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
SCHEDULER_GENERATE = f"/{SCHEDULER_SERVICE}/Generate"
# One address per channel: round_robin over it is pick_first that also runs
# gRPC's client-side health checking (pick_first does not).
SERVICE_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SCHEDULER_SERVICE}}
)
DNS_SCHEME = "dns:///"
# What a GenerateStreamRequest adds around its GenerateRequest, with room.
STREAM_ENVELOPE_BYTES = 64


# A scheduler's ServerInfo.encoder_input_dtype -> the dtype media rows are made in for it (a float one).
PIXEL_DTYPE_NAMES = {code: name for name, code in DTYPE_BY_NAME.items() if name in ("float32", "float16", "bfloat16")}


def backend_targets(setting: str) -> tuple[list[str], str]:
    """The static backends of `--scheduler` (HOST:PORT each), or none and
    the NAME:PORT to resolve when it is a ``dns:///`` target."""
    if setting.startswith(DNS_SCHEME):
        return [], setting.removeprefix(DNS_SCHEME)
    targets = [t.strip() for t in setting.split(",") if t.strip()]
    return list(dict.fromkeys(targets)), ""


def choose_transport(info: common_pb2.ServerInfo, namespace: str, prefix: str, gpu_uuid: str) -> common_pb2.Transport:
    """The transport of tensors towards a scheduler that describes itself as
    `info`: CUDA IPC when it can open handles of our staging pool's GPU and
    shares our /dev/shm (where the pool's lease map is); else shared memory
    when it shares our /dev/shm and prefix; else inline bytes."""
    same_memory = info.shm_namespace == namespace and info.shm_prefix == prefix
    if (
        gpu_uuid
        and same_memory
        and gpu_uuid in info.cuda_device_uuids
        and common_pb2.TRANSPORT_CUDA_IPC in info.transports
    ):
        return common_pb2.TRANSPORT_CUDA_IPC
    if same_memory and common_pb2.TRANSPORT_SHM in info.transports:
        return common_pb2.TRANSPORT_SHM
    return common_pb2.TRANSPORT_INLINE


def fits_in_stream(info: common_pb2.ServerInfo, request: scheduler_pb2.GenerateRequest) -> bool:
    """Whether the scheduler described by `info` serves GenerateStream and
    a message of it carrying `request` is within what it reads: a request
    beyond that goes by a Generate call of its own, so that its refusal
    (RESOURCE_EXHAUSTED) ends that call alone, not the stream of every other."""
    return info.generate_stream and request.ByteSize() + STREAM_ENVELOPE_BYTES <= info.max_message_bytes


async def _written_once(request: Handed[scheduler_pb2.GenerateRequest]) -> AsyncIterator[scheduler_pb2.GenerateRequest]:
    """The messages of a call of one request, which it takes."""
    yield request.take()


class SchedulerLink:
    """One backend: a scheduler group at one address."""

    def __init__(
        self,
        settings: TokenizerSettings,
        security: ClientSecurity,
        target: str,
        *,
        server_name: str = "",
        gpu_uuid: str = "",
        pairing: Pairing = UNKNOWN,
    ) -> None:
        self.settings = settings
        self.target = target
        # Ours (`mmsplit.pairing`): a scheduler whose digests differ is never
        # sent a request; `refused` says what differs while it does.
        self.pairing = pairing
        self.refused = ""
        self._trusted: list[str] = []
        self.inflight = 0  # this tokenizer's requests on it now
        # Requests may carry inline tensors (the scheduler enforces its own
        # limit on them); its responses are small. A scheduler that comes back
        # (restarted, rescheduled) is found within RECONNECT_MAX_MS: gRPC's
        # default backoff grows to 120 s, which would keep this tokenizer
        # NOT_SERVING for minutes after its scheduler is back.
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
            ("grpc.service_config", SERVICE_CONFIG),
            # A scheduler that vanishes without a word is found by its
            # unanswered pings: the requests on it fail SCHEDULER_UNAVAILABLE
            # then, not at their deadlines.
            *keepalive_options(settings.keepalive_s, settings.keepalive_timeout_s),
        ]
        if server_name and not security.server_name:
            # A backend found through DNS is dialled by address; its
            # certificate names the Service.
            options.append(("grpc.ssl_target_name_override", server_name))
        self.channel = security.channel(target, options)
        self._probe_options = [o for o in options if o[0] != "grpc.service_config"]  # no health checks
        self._security = security  # its token read as its file changes (rotation)
        self._pairing = pairing.metadata()
        # With no token of ours, a scheduler of this host on loopback is
        # called with its local token (mmsplit.localauth), read as it changes.
        directory = localauth.runtime_dir(settings.runtime_dir)
        self._local = None if security.token else localauth.LocalToken(target, directory)
        self._denied = False  # the last look was refused UNAUTHENTICATED (said once)
        self._probed = False  # what fails its health checks was asked what it is (once until it answers)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self._streamed = StreamedCalls(self.stub, self._metadata)
        # Generate called as a stream of one request (on the wire the same
        # call): grpc.aio's unary call keeps its request, inline tensors'
        # bytes and all, until the call ends; a stream's writer only until
        # the request is written.
        self._generate_once = self.channel.stream_stream(
            SCHEDULER_GENERATE,
            request_serializer=scheduler_pb2.GenerateRequest.SerializeToString,
            response_deserializer=scheduler_pb2.GenerateResponse.FromString,
        )
        self.info: common_pb2.ServerInfo | None = None
        self.transport = common_pb2.TRANSPORT_UNSPECIFIED
        self._namespace = files.namespace_id()
        # The GPU of this tokenizer's CUDA-IPC staging pool ("" without one).
        self.gpu_uuid = gpu_uuid

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        local = () if self._local is None else self._local.metadata()
        return (*self._security.metadata(), *self._pairing, *local)

    @property
    def connected(self) -> bool:
        return self.info is not None

    def row_form(self, family: Family) -> RowForm:
        """How media rows are made for it: an image's frame once where the
        family repeats it and it takes that (ServerInfo.one_frame_image_rows),
        in its model's dtype where that is float16 or bfloat16
        (ServerInfo.encoder_input_dtype), else float32."""
        info = self.info
        if info is None:
            return PLAIN_ROWS
        return RowForm(one_frame=info.one_frame_image_rows and family.image_frames > 1, dtype=self._pixel_dtype)

    def takes(self, form: RowForm) -> bool:
        """Whether rows made in `form` (for another backend) give its model
        what its own rows would: one frame's only where it takes them, and
        float32 anywhere (each rank casts them to its model's dtype, as the
        workers would), a narrower dtype only where the model runs in it."""
        if self.info is None:
            return False
        return (not form.one_frame or self.info.one_frame_image_rows) and form.dtype in ("float32", self._pixel_dtype)

    @property
    def _pixel_dtype(self) -> str:
        """The dtype of the pixels it is sent (float32 when it does not say)."""
        return "float32" if self.info is None else PIXEL_DTYPE_NAMES.get(self.info.encoder_input_dtype, "float32")

    @property
    def ready(self) -> bool:
        """Connected, and gRPC's health checking has not taken it out."""
        return self.info is not None and self.channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def refresh(self, timeout_s: float = 2.0) -> bool:
        """Ask the scheduler to describe itself; choose the transport. False
        (and disconnected) when it does not answer."""
        try:
            reply = await self.stub.GetServerInfo(
                scheduler_pb2.GetServerInfoRequest(), timeout=timeout_s, metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            if self.info is not None:
                log.warning("scheduler %s stopped answering: %s", self.target, exc.code())
            denied = exc.code() == grpc.StatusCode.UNAUTHENTICATED
            if denied and not self._denied:
                log.error(
                    "scheduler %s refuses this tokenizer's credentials (%s): it gets no requests; on one host run "
                    "both services as the same user with the same --runtime-dir (the scheduler's local token), "
                    "else give --scheduler-auth-token-file or mutual TLS",
                    self.target,
                    exc.details(),
                )
            self._denied = denied
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "unhealthy" in (exc.details() or ""):
                # Something answers gRPC's health checks there, and not as a serving scheduler.
                await self._say_what_answers()
            self.info, self.refused = None, ""
            return False
        self._denied = self._probed = False
        info = reply.info
        if not self._pairs_with(info):
            self.info = None
            return False
        transport = choose_transport(info, self._namespace, self.settings.shm_prefix, self.gpu_uuid)
        if self.info is None or transport != self.transport:
            log.info(
                "scheduler %s: model %s, tp %d; tensors go by %s",
                self.target,
                info.model,
                info.tp_size,
                common_pb2.Transport.Name(transport),
            )
        self.info, self.transport = info, transport
        return True

    async def _say_what_answers(self) -> None:
        """Log once what a server that fails the channel's health checks is:
        one whose health service does not know the scheduler's (a tokenizer,
        another gRPC server: --scheduler names the wrong port), or a
        scheduler that says NOT_SERVING (starting, draining, its group
        restarting). Asked once until it answers, over a channel of its own:
        the link's channel sends nothing to a backend its health checks took
        out."""
        if self._probed:
            return
        self._probed = True
        probe = self._security.channel(self.target, self._probe_options)
        try:
            await health_pb2_grpc.HealthStub(probe).Check(
                health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0, metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                log.error(
                    "%s answers, but is not a scheduler (its health service knows no %s): it gets no requests; "
                    "--scheduler names another server (a tokenizer's port?): give a scheduler's --port",
                    self.target,
                    SCHEDULER_SERVICE,
                )
        finally:
            await probe.close()

    def _pairs_with(self, info: common_pb2.ServerInfo) -> bool:
        """Whether the scheduler that described itself as `info` serves our
        model as far as what we send it goes (`mmsplit.pairing`); said in
        the log when that changes. A digest it does not publish is trusted."""
        theirs = Pairing.of(info)
        differ = " and ".join(self.pairing.differences(theirs))
        if differ:
            if self.refused != differ:
                log.error(
                    "scheduler %s serves model %s with another %s than ours: it gets no requests while it does;"
                    " check --scheduler and both services' --model",
                    self.target,
                    info.model,
                    differ,
                )
            self.refused = differ
            return False
        if self.refused:
            log.info("scheduler %s now serves our model", self.target)
        self.refused = ""
        trusted = self.pairing.unpublished(theirs)
        if trusted and trusted != self._trusted:
            log.warning("scheduler %s publishes no digest of its %s: taken on trust", self.target, " or ".join(trusted))
        self._trusted = trusted
        return True

    async def generate(
        self,
        request: Handed[scheduler_pb2.GenerateRequest] | scheduler_pb2.GenerateRequest,
        *,
        timeout_s: float | None,
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        """The request's events from this scheduler: over the shared
        GenerateStream call when it serves one and the request fits in a
        message of it (so that one too large fails alone), else over a
        Generate call of its own. A request handed over is let go once it
        is on its way."""
        message: scheduler_pb2.GenerateRequest = Handed.of(request).take()
        del request
        if self._streams(message):
            events = self._streamed.generate(Handed(message), timeout_s)
        else:
            events = self._call(Handed(message), timeout_s)
        del message
        try:
            async for response in events:
                yield response
        except (grpc.aio.AioRpcError, CallEnded) as exc:
            raise self._failure(exc) from exc
        except RemoteError as exc:  # a request's failure on the stream
            if exc.error_code == E.ERROR_CODE_SCHEDULER_UNAVAILABLE:
                raise self._unavailable(exc.message) from exc
            raise
        finally:
            await events.aclose()  # cancels the request downstream when it has not ended

    def _streams(self, request: scheduler_pb2.GenerateRequest) -> bool:
        return self.settings.scheduler_stream and self.info is not None and fits_in_stream(self.info, request)

    async def _call(
        self, request: Handed[scheduler_pb2.GenerateRequest], timeout_s: float | None
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        call = self._generate_once(_written_once(request), timeout=timeout_s, metadata=self._metadata())
        del request
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op when the call already ended; aborts it downstream otherwise

    def _failure(self, exc: grpc.aio.AioRpcError | CallEnded) -> MmsplitError:
        """What a failed call (or the stream's end) means for its requests."""
        if isinstance(exc, CallEnded):
            return self._unavailable(str(exc))
        error = RemoteError.from_rpc_error(exc, unavailable_code=E.ERROR_CODE_SCHEDULER_UNAVAILABLE)
        # Every error our scheduler raises carries its ErrorInfo; an INTERNAL
        # without one is gRPC's own ("Internal error from Core": the
        # connection broke mid-call, as when a group is killed), so the
        # scheduler is unavailable, which a retry may get past.
        transport = exc.code() == grpc.StatusCode.INTERNAL and error_info_of(exc) is None
        if error.error_code == E.ERROR_CODE_SCHEDULER_UNAVAILABLE or transport:
            return self._unavailable(f"{exc.code()} {exc.details()}")
        return error

    def _unavailable(self, why: str) -> SchedulerUnavailable:
        self.info = None
        log.warning("scheduler %s: %s", self.target, why)
        return SchedulerUnavailable("the scheduler is unavailable; retry shortly")

    async def close(self) -> None:
        self._streamed.close()
        await self.channel.close()


class Schedulers:
    """Every backend `--scheduler` names; `pick` chooses one per request."""

    def __init__(self, settings: TokenizerSettings, security: ClientSecurity, *, pairing: Pairing = UNKNOWN) -> None:
        """`pairing`: our digests (`mmsplit.pairing`); empty ones trust every scheduler."""
        self.settings, self.security = settings, security
        # Our staging pool's GPU: known once the pool is made (`set_gpu`).
        self.gpu_uuid = ""
        self.pairing = pairing
        targets, self._dns = backend_targets(settings.scheduler)
        self.links = {t: SchedulerLink(settings, security, t, pairing=pairing) for t in targets}
        self._turn = itertools.count()

    def set_gpu(self, gpu_uuid: str) -> None:
        """The GPU of our staging pool (at start, before any backend is asked)."""
        self.gpu_uuid = gpu_uuid
        for link in self.links.values():
            link.gpu_uuid = gpu_uuid

    @property
    def connected(self) -> bool:
        return any(link.connected for link in self.links.values())

    @property
    def primary(self) -> SchedulerLink | None:
        """A connected backend (the first), for what asks about "the" scheduler."""
        return next((link for link in self.links.values() if link.connected), None)

    @property
    def max_context(self) -> int:
        """The longest request the connected backends all take (prompt and
        output, tokens); 0 when none says."""
        known = [
            link.info.max_context_tokens for link in self.links.values() if link.info and link.info.max_context_tokens
        ]
        return min(known, default=0)

    @property
    def serving_another_model(self) -> str:
        """What differs ("vocabulary", ...) when no backend is connected and
        some answer as another model; else ""."""
        if self.connected:
            return ""
        return next((link.refused for link in self.links.values() if link.refused), "")

    def pick(
        self, exclude: Collection[SchedulerLink] = (), transport: int = 0, *, form: RowForm | None = None
    ) -> SchedulerLink | None:
        """The ready backend with the fewest of this tokenizer's requests in
        flight (ties in turn), not in `exclude`, with `transport` when given,
        and taking rows made in `form` when given. None when there is none."""
        ready = [
            link
            for link in self.links.values()
            if link.ready
            and link not in exclude
            and (not transport or link.transport == transport)
            and (form is None or link.takes(form))
        ]
        if not ready:
            return None
        turn = next(self._turn)
        order = {id(link): (i - turn) % len(ready) for i, link in enumerate(ready)}
        return min(ready, key=lambda link: (link.inflight, order[id(link)]))

    async def refresh(self) -> bool:
        """Resolve a dns:/// target again, and ask every backend to describe
        itself. True when at least one answers."""
        if self._dns:
            await self._resolve()
        await asyncio.gather(*(link.refresh() for link in list(self.links.values())))
        return self.connected

    async def _resolve(self) -> None:
        host, _, port = self._dns.rpartition(":")
        try:
            found = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning("resolving %s failed: %s", self._dns, exc)
            return
        targets = {_target(str(addr[4][0]), int(port)) for addr in found}
        for target in targets - set(self.links):
            log.info("scheduler backend %s (from %s) added", target, self._dns)
            self.links[target] = SchedulerLink(
                self.settings,
                self.security,
                target,
                server_name=host,
                gpu_uuid=self.gpu_uuid,
                pairing=self.pairing,
            )
        for target in set(self.links) - targets:
            link = self.links[target]
            if link.inflight == 0:  # else kept until its requests end (a later pass)
                log.info("scheduler backend %s (from %s) removed", target, self._dns)
                del self.links[target]
                await link.close()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Until a backend answers (True) or `timeout_s` passes (False);
        says at once that it waits, and every WAIT_LOG_S after, naming where."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        said = started
        first = True
        while not await self.refresh():
            now = loop.time()
            if first or now - said >= WAIT_LOG_S:
                waited = f" (waited {now - started:.0f}s)" if not first else ""
                log.info(
                    "waiting for a scheduler at %s%s; serving NOT_SERVING until one answers",
                    self.settings.scheduler,
                    waited,
                )
                first, said = False, now
            if now - started >= timeout_s:
                return False
            await asyncio.sleep(0.5)
        if not first:
            log.info("a scheduler at %s answers", self.settings.scheduler)
        return True

    def backends(self) -> list[tokenizer_pb2.SchedulerBackend]:
        return [
            tokenizer_pb2.SchedulerBackend(
                address=link.target,
                ready=link.ready,
                transport=link.transport if link.connected else common_pb2.TRANSPORT_UNSPECIFIED,
                requests_in_flight=link.inflight,
                serves_another_model=link.refused,
            )
            for link in self.links.values()
        ]

    async def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await link.close()


def _target(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
