"""The tokenizer's gRPC servicer and process lifecycle.

Startup: sweep orphaned segments of our prefix → load the processor → start
the CPU pool → serve (NOT_SERVING) → SERVING once the scheduler answers and a
pool exists. A watcher keeps readiness in step with the scheduler's
reachability. On SIGTERM/SIGINT: NOT_SERVING → stop with a grace period →
pools down → remove any segment this process still owns → exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from mmsplit import __version__, pairing
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import InternalError, MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_server import families, gcheap, mallocheap
from mmsplit_server.handoff import cuda_ipc, files
from mmsplit_server.metrics import ServiceMetrics
from mmsplit_server.serving import (
    ClientSecurity,
    Handed,
    Health,
    RequestSummary,
    SecretFile,
    ServerSecurity,
    abort,
    end_with,
    health_server,
    new_server,
    on_stop_signals,
    run_service,
    serving_on,
)
from tokenizer_svc.conversation import MAX_REQUEST_ID, valid_request_id
from tokenizer_svc.downstream import Schedulers
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.http_api import HttpApi
from tokenizer_svc.http_api import start as start_http
from tokenizer_svc.media import MediaLoader
from tokenizer_svc.pool import CpuPool
from tokenizer_svc.response_store import ResponseStore
from tokenizer_svc.service import TokenizerService
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
# Its streamed method, whose request the servicer is handed (`serving.Handed`).
GENERATE = f"/{SERVICE_NAME}/Generate"
WATCH_INTERVAL_S = 2.0
# A watch that keeps failing logs its traceback once, then a line every
# this many rounds (a minute at the default interval), then its recovery.
WATCH_LOG_EVERY = 30
DEADLINE_SLACK_S = 0.25


def _metrics(settings: TokenizerSettings, service: TokenizerService, pool: CpuPool) -> ServiceMetrics | None:
    if not settings.metrics_port:
        return None
    metrics = ServiceMetrics("tokenizer")
    metrics.gauge("requests_in_flight", "Requests in progress", lambda: service.inflight)
    metrics.gauge("clients_in_flight", "Clients with requests in progress", lambda: len(service.inflight_by_client))
    metrics.gauge("preprocess_cache_bytes", "Bytes the preprocessing cache holds", lambda: service.cache.bytes)
    fetcher = service.media.fetcher
    metrics.gauge_by(
        "backend_requests_in_flight",
        "This tokenizer's requests on each scheduler backend now",
        "backend",
        lambda: {link.target: link.inflight for link in service.link.links.values()},
    )
    metrics.gauge_by(
        "backend_ready",
        "1 while a scheduler backend gets new requests (answers, and health checking reports it SERVING)",
        "backend",
        lambda: {link.target: float(link.ready) for link in service.link.links.values()},
    )
    metrics.gauge_by(
        "backend_serves_another_model",
        "1 while a scheduler backend answers as a server of another model (vocabulary or item rules): no requests",
        "backend",
        lambda: {link.target: float(bool(link.refused)) for link in service.link.links.values()},
    )
    metrics.gauge(
        "shm_bytes",
        "Bytes of this process's shared-memory segments now",
        lambda: files.segment_bytes(settings.shm_prefix, creator_pid=os.getpid()),
    )
    metrics.gauge(
        "shm_slab_bytes",
        "Size of the shared-memory slab (0 until the first shared-memory request, and when it is off)",
        lambda: service.slab.size if service.slab else 0,
    )
    metrics.gauge(
        "shm_slab_used_bytes",
        "Bytes of the slab that requests hold now",
        lambda: service.slab.used_bytes() if service.slab else 0,
    )
    metrics.gauge(
        "cuda_ipc_pool_used_bytes",
        "Bytes of the GPU staging pool (CUDA IPC) that requests hold now (0 without a pool)",
        lambda: service.device_pool.used_bytes() if service.device_pool else 0,
    )
    metrics.counters(
        lambda: {
            "preprocess_cache_hits": ("Lookups that found a preprocessed item", service.cache.hits),
            "preprocess_cache_misses": ("Lookups that did not", service.cache.misses),
            "cpu_pool_replacements": ("CPU workers replaced after one died", pool.replacements),
            "preprocess_seconds": ("Time spent preprocessing media in workers, as awaited", service.preprocess_s),
            "preprocessed_items": ("Images and videos preprocessed by workers", service.preprocessed),
            "fetch_attempts": ("HTTP(S) fetch attempts", fetcher.attempts),
            "fetch_retries": ("Fetch attempts that failed and were retried", fetcher.retries),
            "fetch_failures": ("Fetches that failed after their last attempt", fetcher.failures),
            "janitor_removed_segments": ("Orphaned segments the janitor removed", service.janitor_removed),
            "heap_returned_bytes": (
                "Resident memory the heaps gave back to the kernel once they held more free than their bound",
                service.heap_returned,
            ),
            "client_limit_refusals": (
                "Requests refused OVERLOADED because their client had --max-inflight-per-client in progress",
                service.refused_per_client,
            ),
        }
    )
    metrics.counter_by(
        "preprocess_worker_seconds",
        "Time CPU workers spent on items, by stage (read: input from the slab; decode; process: the image"
        " processor; write: into shared memory). preprocess_seconds less their sum is the pool's own cost"
        " and queueing",
        "stage",
        lambda: dict(service.worker_s),
    )
    host = settings.metrics_host or settings.host
    with serving_on("tokenizer", "metrics", host, settings.metrics_port):
        port = metrics.serve(host, settings.metrics_port)
    log.info("metrics on port %d (/metrics)", port)
    return metrics


def client_address(peer: str) -> str:
    """Who a gRPC call came from, for --max-inflight-per-client: its
    address without the port (``ipv4:10.0.0.7:51234`` -> ``addr:10.0.0.7``,
    ``ipv6:[::1]:5`` -> ``addr:::1``), as the HTTP API names a client
    without an API key; a peer of another form as it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return "addr:" + rest.rpartition(":")[0]
    if kind == "ipv6":
        return "addr:" + rest.rpartition(":")[0].strip("[]")
    return "peer:" + peer


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(
        self, service: TokenizerService, settings: TokenizerSettings, metrics: ServiceMetrics | None = None
    ) -> None:
        self.service = service
        self.settings = settings
        self.metrics = metrics
        # Calls that were gRPC's retries of an earlier attempt (the client's
        # channel adds grpc-previous-rpc-attempts to each retry).
        self.retried_calls = 0

    async def Generate(  # noqa: N802 (gRPC method name)
        self,
        request: Handed[tokenizer_pb2.GenerateRequest] | tokenizer_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.GenerateResponse]:
        """The server hands the request over (`GENERATE`, `Handed`): the
        service takes it, and lets its media go once they are prepared."""
        given: Handed[tokenizer_pb2.GenerateRequest] = Handed.of(request)
        del request
        try:
            rid = _request_id(given.request)
        except InvalidRequest as invalid:
            end_with(context, invalid.to_status())
            return
        client = client_address(context.peer())
        images, videos = len(given.request.images), len(given.request.videos)
        summary = RequestSummary(rid, protocol="grpc", client=client, images=images, videos=videos)
        if any(key == "grpc-previous-rpc-attempts" for key, _ in context.invocation_metadata() or ()):
            self.retried_calls += 1
        try:
            async for response in self.service.generate(given, rid, context.time_remaining(), client):
                if response.HasField("delta") and response.delta.token_ids:
                    summary.token(len(response.delta.token_ids))
                elif response.HasField("finished"):
                    f = response.finished
                    summary.finished(
                        common_pb2.FinishReason.Name(f.finish_reason), f.prompt_tokens, f.completion_tokens
                    )
                yield response
        except MmsplitError as exc:
            summary.outcome = exc.reason
            log.info("request %s failed: %s", rid, exc)
            end_with(context, exc.to_status(rid))
        except Exception:
            # A bug: still a typed status, never UNKNOWN; the details stay in
            # the log. Cancellation is not an Exception and passes through.
            summary.outcome = "INTERNAL"
            incident = uuid.uuid4().hex[:12]
            log.exception("request %s failed on an unexpected error (incident %s)", rid, incident)
            end_with(context, InternalError(f"internal error (incident {incident})").to_status(rid))
        finally:
            remaining = context.time_remaining()
            # The client's deadline ended it. (Ours ends a little after the
            # client's, by the time its request took to arrive: hence the slack.)
            if summary.outcome == "CANCELLED" and remaining is not None and remaining <= DEADLINE_SLACK_S:
                summary.outcome = "DEADLINE_EXCEEDED"
            summary.log(log, self.metrics)

    async def Tokenize(  # noqa: N802
        self, tokenize: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        # A unary call is aborted (`serving.abort`: ended with its status
        # set, it would send an empty message before that status), outside
        # the except blocks, with this frame's request let go.
        failed: grpc.Status
        try:
            rid = _request_id(tokenize.request)
        except InvalidRequest as invalid:
            failed = invalid.to_status()
        else:
            try:
                ids = await self.service.tokenize(tokenize.request, rid, client_address(context.peer()))
                return tokenizer_pb2.TokenizeResponse(token_ids=ids, max_context_tokens=self.service.link.max_context)
            except MmsplitError as exc:
                log.info("tokenizing %s failed: %s", rid, exc)
                failed = exc.to_status(rid)
            except Exception:
                incident = uuid.uuid4().hex[:12]
                log.exception("tokenizing %s failed on an unexpected error (incident %s)", rid, incident)
                failed = InternalError(f"internal error (incident {incident})").to_status(rid)
        del tokenize
        await abort(context, failed)

    async def GetServerInfo(  # noqa: N802
        self, request: tokenizer_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.GetServerInfoResponse:
        link = self.service.link
        primary = link.primary
        own_slab, gpu = self.service.slab, self.service.device_pool
        budget = self.service.family.image_pixels
        tiles = self.service.family.image_tiles
        return tokenizer_pb2.GetServerInfoResponse(
            info=common_pb2.ServerInfo(
                model=self.settings.model_dir.name,
                tp_size=1,
                transports=[common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE],
                shm_namespace=files.namespace_id(),
                shm_prefix=self.settings.shm_prefix,
                version=__version__,
                vocabulary=self.service.link.pairing.vocabulary,
                item_rules=self.service.link.pairing.item_rules,
                preprocess_cache_hits=self.service.cache.hits,
                preprocess_cache_misses=self.service.cache.misses,
                preprocess_cache_bytes=self.service.cache.bytes,
                shm_slab_bytes=own_slab.size if own_slab else 0,
                shm_slab_used_bytes=own_slab.used_bytes() if own_slab else 0,
                cuda_device_uuids=[gpu.uuid] if gpu else [],
                cuda_ipc_pool_bytes=gpu.size if gpu else 0,
                cuda_ipc_pool_used_bytes=gpu.used_bytes() if gpu else 0,
                image_min_pixels=budget.least if budget else 0,
                image_max_pixels=budget.most if budget else 0,
                tool_call_parser=self.settings.tool_call_parser,
                reasoning_parser=self.settings.reasoning_parser,
                image_min_tiles=tiles.least if tiles else 0,
                image_max_tiles=tiles.most if tiles else 0,
            ),
            scheduler=primary.info if primary else None,
            transport=primary.transport if primary else common_pb2.TRANSPORT_UNSPECIFIED,
            backends=link.backends(),
        )


def _request_id(request: tokenizer_pb2.GenerateRequest) -> str:
    """The request's id, or a new one; InvalidRequest for an id that is not
    1 to MAX_REQUEST_ID printable characters (the id neither logged nor
    echoed: it may be anything)."""
    rid = request.request_id or uuid.uuid4().hex
    if not valid_request_id(rid):
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID} printable characters")
    return rid


def run(settings: TokenizerSettings) -> int:
    """Serve until stopped; the exit code. The caller has raised the
    open-file limit (`mmsplit_cli.main`) before it started the CPU pool's
    forkserver, whose workers inherit it."""
    # Large items (the cache's copy of each new one, on the event loop;
    # inline ones from the workers and to a scheduler) from a heap kept warm.
    mallocheap.keep()
    try:
        security = ServerSecurity(cert=settings.tls_cert, key=settings.tls_key, client_ca=settings.tls_client_ca)
        security.credentials()  # unreadable certificate files fail here
        downstream = ClientSecurity.with_token_file(
            settings.scheduler_auth_token_file,
            ca=settings.scheduler_tls_ca,
            cert=settings.scheduler_tls_cert,
            key=settings.scheduler_tls_key,
            server_name=settings.scheduler_tls_server_name,
        )
        api_keys = SecretFile(settings.api_key_file) if settings.api_key_file else None  # unreadable or empty: here
    except (ValueError, OSError) as exc:
        raise SystemExit(f"mmsplit tokenizer: {exc}") from exc
    return run_service(_serve(settings, security, downstream, api_keys))


def _load_processor(settings: TokenizerSettings) -> tuple[families.Family, Any, str | None]:
    """The model's family adapter, its tokenizer and the chat template in use.
    (The full processor object is not needed, and for Qwen families cannot be
    built without torchvision; the image processor lives in the CPU workers.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    template = chat_template(settings.chat_template, settings.model_dir, tokenizer)
    if template is not None:
        # A template that does not render fails the start, not every request.
        probe: Any = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
        try:
            tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ValueError(f"the chat template does not render: {type(exc).__name__}: {exc}") from exc
    return families.load(settings.model_dir), tokenizer, template


def chat_template(choice: str, model_dir: Path, tokenizer: Any) -> str | None:
    """`--chat-template`: none, auto (the processor's template file, else the
    tokenizer's; None when the model ships neither), or a file's text."""
    if choice == "none":
        return None
    if choice != "auto":
        return Path(choice).read_text()
    legacy = model_dir / "chat_template.json"  # how older processors saved theirs
    if legacy.is_file():
        value = json.loads(legacy.read_text()).get("chat_template")
        if isinstance(value, str):
            return value
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else None


async def _serve(
    settings: TokenizerSettings, security: ServerSecurity, downstream: ClientSecurity, api_keys: SecretFile | None
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    on_stop_signals(loop, stop, settings.shutdown_grace_s)

    await asyncio.to_thread(files.sweep, settings.shm_prefix, grace_s=settings.segment_grace_s)
    health = Health(SERVICE_NAME)
    await health.start()
    try:
        family, tokenizer, template = await asyncio.to_thread(_load_processor, settings)
    except (ValueError, OSError) as exc:  # an unsupported model, an unreadable or broken template
        raise SystemExit(f"mmsplit tokenizer: {exc}") from exc
    pool = CpuPool(
        str(settings.model_dir),
        settings.cpu_workers,
        worker_hook=settings.worker_hook,
        queue_timeout_s=settings.preprocess_queue_timeout_s,
        memory_bytes=settings.worker_memory_limit,
    )
    await pool.start()
    media = MediaLoader(settings)
    ours = await asyncio.to_thread(pairing.of_checkpoint, settings.model_dir, family)
    log.info("vocabulary %s, item rules %s", ours.vocabulary, ours.item_rules)
    link = Schedulers(settings, downstream, pairing=ours)
    service = TokenizerService(settings, family, tokenizer, media, pool, link, chat_template=template)
    try:
        backend = await asyncio.to_thread(cuda_ipc.configure, settings.cuda_ipc_backend)
        gpu_uuid = await asyncio.to_thread(service.start_device_pool, backend)
    except (OSError, RuntimeError, files.SegmentError) as exc:  # no room on the GPU, or in /dev/shm for its lease map
        raise SystemExit(f"mmsplit tokenizer: the GPU staging pool could not be made: {exc}") from exc
    link.set_gpu(gpu_uuid)

    with serving_on("tokenizer", "gRPC", settings.host, settings.port):
        server, port = await new_server(
            host=settings.host,
            port=settings.port,
            health_=health,
            service_names=[SERVICE_NAME],
            max_message_bytes=settings.message_limit,
            security=security,
            keepalive_s=settings.keepalive_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_connection_age_s=settings.max_connection_age_s,
            max_connections=settings.connection_limit,
            handed=[GENERATE],
        )
    metrics = _metrics(settings, service, pool)
    servicer = TokenizerServicer(service, settings, metrics)
    if metrics is not None:
        metrics.counters(
            lambda: {
                "grpc_retried_calls": (
                    "Generate calls that were a gRPC client's retries of an earlier attempt",
                    servicer.retried_calls,
                )
            }
        )
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server)
    # Before the first request: a full collection walks only what serving makes.
    gcheap.freeze(count=metrics is not None)
    await server.start()
    http = None
    if settings.http_port:
        api = HttpApi(
            service,
            model=settings.served_model_name or settings.model_dir.name,
            ready=lambda: health.ready,
            api_keys=api_keys,
            trusted_proxies=settings.trusted_proxies,
            cors_origins=settings.cors_origins,
            max_body_bytes=settings.http_body_limit,
            body_bytes_in_flight=settings.max_body_bytes_in_flight,
            metrics=metrics,
            tool_parser=settings.tool_call_parser,
            reasoning_parser=settings.reasoning_parser,
            keepalive_s=settings.http_keepalive_s,
            request_timeout_s=settings.http_request_timeout_s,
            store=ResponseStore(settings.responses_store_bytes),
        )
        if metrics is not None:
            metrics.gauge("stored_responses", "Responses API responses stored (store: true)", lambda: len(api.store))
            metrics.gauge("stored_responses_bytes", "Bytes the stored responses take", lambda: api.store.nbytes)
            metrics.gauge("http_body_bytes", "HTTP request body bytes held now (--max-body-bytes-in-flight)",
                          lambda: api.bodies.held)  # fmt: skip
            metrics.counters(
                lambda: {
                    "http_bodies_refused": (
                        "HTTP requests refused unread at --max-body-bytes-in-flight",
                        api.bodies.refused,
                    )
                }
            )
            metrics.counter_by(
                "http_responses",
                "HTTP API responses by route and status",
                ("route", "status"),
                lambda: dict(api.responses),
            )
        with serving_on("tokenizer", "HTTP", settings.host, settings.http_port):
            http, http_port = await start_http(
                api,
                settings.host,
                settings.http_port,
                max_connections=settings.connection_limit,
                max_per_client=settings.max_connections_per_client,
            )
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", settings.host, http_port)
        if metrics is not None:
            runner = http
            metrics.gauge(
                "http_connections",
                "HTTP connections open now",
                lambda: len(runner.server.connections) if runner.server is not None else 0,
            )
            metrics.counters(
                lambda: {
                    "http_connections_refused": (
                        "HTTP connections closed unread because --max-connections were open",
                        api.refused_connections,
                    ),
                    "http_connections_refused_per_client": (
                        "HTTP connections closed unread because their address had --max-connections-per-client open",
                        api.refused_per_client_connections,
                    ),
                }
            )
    probes = None
    if settings.health_port:
        health_host = settings.health_host or settings.host
        with serving_on("tokenizer", "health", health_host, settings.health_port):
            probes, probe_port = await health_server(health_host, settings.health_port, health)
        log.info("health alone on port %d", probe_port)
    log.info("tokenizer listening on %s:%d (scheduler %s)", settings.host, port, settings.scheduler)

    # A SIGTERM while waiting for the scheduler stops the wait (an
    # orchestrator's stop must not wait out --scheduler-wait-s).
    connecting = asyncio.create_task(link.wait_connected(settings.scheduler_wait_s))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
    elif not connecting.result():
        log.warning("scheduler %s not reachable yet; serving NOT_SERVING until it is", settings.scheduler)
    watcher = asyncio.create_task(_watch(settings, health, service))

    await stop.wait()
    log.info("shutting down: letting running requests finish for up to %.1fs", settings.shutdown_grace_s)
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await health.set_ready(False)
    service.begin_drain()
    try:
        await asyncio.wait_for(service.idle.wait(), settings.shutdown_grace_s)
    except TimeoutError:
        stragglers = service.force_stop()
        log.warning("grace period over; ending %d request(s) with SHUTTING_DOWN", len(stragglers))
        await asyncio.wait(stragglers, timeout=10)
    await health.stopping()
    await server.stop(1.0)
    if http is not None:
        await http.cleanup()
    if probes is not None:
        await probes.stop(0)
    await pool.shutdown()
    await media.aclose()
    await link.close()
    await service.close_pools()
    log.info("tokenizer stopped")
    return 0


async def _watch(settings: TokenizerSettings, health: Health, service: TokenizerService) -> None:
    """Keep readiness true to the scheduler's reachability and the pool's
    existence (recreating it after a failed creation); sweep orphans: segments
    of dead owners, and segments past their lease that no request here holds
    (the scheduler died after accepting them); give the heaps' free memory
    back past its bound (`mallocheap.Bound`)."""
    link, pool = service.link, service.pool
    last_sweep = asyncio.get_running_loop().time()
    heap = mallocheap.Bound(settings.heap_free_limit_bytes) if settings.heap_free_limit_bytes else None
    failed = 0  # rounds failed in a row
    while True:
        try:
            await link.refresh()
            await pool.ensure()
            await health.set_ready(link.connected and pool.ready)
            now = asyncio.get_running_loop().time()
            if now - last_sweep >= settings.janitor_interval_s:
                last_sweep = now
                held = set(service.held)
                removed = await asyncio.to_thread(
                    files.sweep, settings.shm_prefix, grace_s=settings.segment_grace_s, keep=held
                )
                service.janitor_removed += len(removed)
            # Memory freed inside the heaps stays with the process: given
            # back once it passes the bound (big bodies and data: URLs),
            # while no request streams unless far past it (`Bound.check`).
            if heap is not None:
                service.heap_returned += await asyncio.to_thread(heap.check, service.inflight > 0)
            if failed:
                log.warning("the tokenizer's watch recovered after %d failed round(s)", failed)
                failed = 0
        except Exception:
            # This task is what keeps readiness true and the pool whole: one
            # round that fails (no descriptor left for the sweep, say) must
            # not end it, as an exception would, silently. A cause that
            # persists is logged in full once, then counted, not repeated
            # every round.
            failed += 1
            if failed == 1:
                log.exception("a round of the tokenizer's watch failed; trying again every %gs", WATCH_INTERVAL_S)
            elif failed % WATCH_LOG_EVERY == 0:
                log.error("the tokenizer's watch has failed %d rounds in a row (the first is logged above)", failed)
        await asyncio.sleep(WATCH_INTERVAL_S)
