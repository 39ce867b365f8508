"""The scheduler's gRPC servicer and the rank-0 process lifecycle.

Lifecycle: start ranks → bootstrap (all ranks or none) → step thread →
gRPC server → SERVING. On SIGTERM/SIGINT: NOT_SERVING → stop the server with
a grace period → stop the step loop (broadcast a stop plan) → ranks exit →
exit 0. When a rank dies or a collective fails: every in-flight request gets
SCHEDULER_UNAVAILABLE, NOT_SERVING, the other ranks are terminated and the
process exits non-zero so an orchestrator restarts the group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from mmsplit import __version__, localauth, pairing
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import InternalError, MmsplitError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit_server import gcheap
from mmsplit_server.handoff import cuda_ipc, files
from mmsplit_server.metrics import ServiceMetrics
from mmsplit_server.serving import (
    Health,
    RequestSummary,
    ServerSecurity,
    end_with,
    exit_now,
    health_server,
    is_loopback,
    new_server,
    on_stop_signals,
    run_service,
    serving_on,
)
from scheduler_svc.collective import cuda_problem, model_device
from scheduler_svc.errors import SchedulerUnavailable
from scheduler_svc.frontend import Frontend
from scheduler_svc.group import LocalRanks, forkable, start_late
from scheduler_svc.loop import StepLoop
from scheduler_svc.model import ModelInfo, model_dtype, model_info
from scheduler_svc.multiplex import StreamCall, serve
from scheduler_svc.ranks import Bootstrapped, bootstrap, run_follower_until_stopped
from scheduler_svc.reader import DTYPES as READ_DTYPES
from scheduler_svc.rendezvous import Rendezvous, adopt_leaderworkerset_env, local_rendezvous
from scheduler_svc.settings import SchedulerSettings

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
ACCEPTED = scheduler_pb2.GenerateResponse(accepted=scheduler_pb2.Accepted())


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        frontend: Frontend,
        info: common_pb2.ServerInfo,
        step_loop: StepLoop,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.frontend = frontend
        self.info = info
        self.pairing = pairing.Pairing.of(info)
        self.step_loop = step_loop
        self.metrics = metrics
        self.draining = False
        self._calls: set[StreamCall] = set()

    def begin_drain(self) -> None:
        """GenerateStream calls end once none of their requests is left."""
        self.draining = True
        for call in self._calls:
            call.wake.set()

    async def GenerateStream(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[scheduler_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.GenerateStreamResponse]:
        try:
            self._check_pairing(context)
        except MmsplitError as exc:
            log.info("a stream of requests refused: %s", exc)
            end_with(context, exc.to_status())
            return
        # Read now: gRPC's context must not be asked anything once the call
        # has ended (a cancelled call's peer() crashes the process).
        peer = context.peer()
        call = StreamCall(self.frontend, self.metrics, lambda: self.draining)
        self._calls.add(call)
        log.info("stream of requests from %s opened", peer)
        try:
            async for message in serve(call, request_iterator):
                yield message
        finally:
            self._calls.discard(call)
            log.info("stream of requests from %s closed after %d requests", peer, call.started)

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        rid = request.request_id
        summary = RequestSummary(rid, quiet=request.search_step, items=len(request.items) + len(request.pixel_values))
        try:
            self._check_pairing(context)
            await self.frontend.ready(request)
            admission = self.frontend.admit(request)
        except MmsplitError as exc:
            log.info("request %s rejected: %s", rid, exc)
            summary.outcome = exc.reason
            summary.log(log, self.metrics)
            end_with(context, exc.to_status(rid))
            return
        try:
            yield ACCEPTED
            async for response in self.frontend.stream(admission):
                if response.HasField("tokens"):
                    summary.token(len(response.tokens.token_ids))
                elif response.HasField("finished"):
                    f = response.finished
                    summary.finished(
                        common_pb2.FinishReason.Name(f.finish_reason), f.prompt_tokens, f.completion_tokens
                    )
                yield response
        except MmsplitError as exc:
            summary.outcome = exc.reason
            end_with(context, exc.to_status(rid))
        except Exception:
            summary.outcome = "INTERNAL"
            incident = uuid.uuid4().hex[:12]
            log.exception("request %s failed on an unexpected error (incident %s)", rid, incident)
            end_with(context, InternalError(f"internal error (incident {incident})").to_status(rid))
        finally:
            # Cancel, deadline, disconnect, or normal end.
            self.frontend.end(rid)
            summary.log(log, self.metrics)

    def _check_pairing(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse a caller that says it serves another model (`mmsplit.pairing`):
        a tokenizer that has not yet seen that this scheduler was replaced."""
        differ = self.pairing.differences(pairing.Pairing.from_metadata(context.invocation_metadata()))
        if differ:
            raise SchedulerUnavailable(
                f"this scheduler serves another model (another {' and '.join(differ)} than the caller's)"
            )

    async def GetServerInfo(  # noqa: N802
        self, request: scheduler_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetServerInfoResponse:
        info = common_pb2.ServerInfo()
        info.CopyFrom(self.info)
        info.rank_active_requests.extend(self.step_loop.active_per_rank)
        snapshot = self.step_loop.snapshot
        info.running_requests = snapshot.running
        info.queued_requests = snapshot.queued
        info.kv_reserved_tokens = snapshot.kv_reserved_tokens
        cache = self.step_loop.engine.encoder_cache
        info.encoder_cache_hits, info.encoder_cache_misses = cache.hits, cache.misses
        info.encoder_cache_bytes = cache.bytes
        prefix = self.step_loop.engine.prefix_cache
        info.prefix_cache_hits, info.prefix_cache_misses = prefix.hits, prefix.lookups - prefix.hits
        info.prefix_cache_hit_tokens, info.prefix_cache_bytes = prefix.hit_tokens, prefix.nbytes
        encoder_agreed, prefix_agreed = self.step_loop.engine.caches_agreed
        info.encoder_cache_diverged, info.prefix_cache_diverged = not encoder_agreed, not prefix_agreed
        info.cuda_ipc_open_pools = cuda_ipc.imported.count()
        return scheduler_pb2.GetServerInfoResponse(info=info)


def _metrics(settings: SchedulerSettings, step_loop: StepLoop) -> ServiceMetrics | None:
    if not settings.metrics_port:
        return None
    metrics = ServiceMetrics("scheduler")
    metrics.gauge("running_requests", "Requests generating now (rows of the batch)", lambda: step_loop.snapshot.running)
    metrics.gauge("queued_requests", "Accepted requests waiting for room", lambda: step_loop.snapshot.queued)
    metrics.gauge("kv_budget_tokens", "The KV-cache budget in tokens", lambda: step_loop.kv_budget_tokens)
    metrics.gauge(
        "kv_reserved_tokens", "KV tokens the running requests reserve", lambda: step_loop.snapshot.kv_reserved_tokens
    )
    metrics.counter_by(
        "agreement_failures",
        "Requests that failed the agreement because this rank could not use their tensors",
        "rank",
        lambda: {str(rank): n for rank, n in enumerate(step_loop.failures_by_rank)},
    )
    cache = step_loop.engine.encoder_cache
    metrics.counters(
        lambda: {
            "janitor_removed_segments": ("Orphaned segments the janitor removed", step_loop.janitor_removed),
            "heap_returned_bytes": (
                "Resident memory rank 0's heaps gave back to the kernel while idle, past --heap-free-limit-bytes",
                step_loop.heap.returned,
            ),
            "encoder_cache_hits": ("Items whose encoder output came from the cache (rank 0)", cache.hits),
            "encoder_cache_misses": ("Items encoded by the vision tower (rank 0)", cache.misses),
        }
    )
    metrics.gauge("encoder_cache_bytes", "Bytes the encoder-output cache holds (rank 0)", lambda: cache.bytes)
    prefix = step_loop.engine.prefix_cache
    metrics.counters(
        lambda: {
            "prefix_cache_hits": ("Prompts that took at least one block from the prefix cache (rank 0)", prefix.hits),
            "prefix_cache_misses": (
                "Prompts that took no block from the prefix cache (rank 0)",
                prefix.lookups - prefix.hits,
            ),
            "prefix_cache_prompt_tokens": (
                "Prompt tokens looked up in the prefix cache (rank 0)",
                prefix.prompt_tokens,
            ),
            "prefix_cache_hit_tokens": ("Prompt tokens taken from the prefix cache (rank 0)", prefix.hit_tokens),
            "prefix_cache_evictions": ("Blocks the prefix cache let go for room (rank 0)", prefix.evictions),
            "prefix_cache_waits": (
                "Steps requests waited for the prefill of the text they start with, to take it from the prefix cache",
                step_loop.waited_for_prefix,
            ),
            "shared_prefills": (
                "Requests that took a copy of the prefill of an identical prompt joining in the same step (rank 0)",
                step_loop.engine.shared_prefills,
            ),
        }
    )
    metrics.gauge("prefix_cache_bytes", "Bytes the prefix cache holds (rank 0)", lambda: prefix.nbytes)
    metrics.gauge(
        "encoder_cache_agreed",
        "1 while the ranks' encoder caches agreed at the last step that took requests (0: not used that step)",
        lambda: int(step_loop.engine.caches_agreed[0]),
    )
    metrics.gauge(
        "prefix_cache_agreed",
        "1 while the ranks' prefix caches agreed at the last step that took requests (0: no cached prefix is"
        " taken; after a change that failed on one rank, until the group restarts)",
        lambda: int(step_loop.engine.caches_agreed[1]),
    )
    metrics.gauge(
        "cuda_ipc_open_pools", "CUDA IPC pools of tokenizers this rank holds open (rank 0)", cuda_ipc.imported.count
    )
    metrics.gauge(
        "shm_bytes",
        "Bytes of the prefix's segments in this host's /dev/shm: handed over by tokenizers and not yet released",
        lambda: files.segment_bytes(settings.shm_prefix),
    )
    step_seconds = metrics.histogram("step_duration_seconds", "Time of one step (plan, reads, agreement, forwards)")
    batch_rows = metrics.histogram(
        "batch_rows", "Requests running after a step (rows of the batch)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
    )

    def on_step(seconds: float, rows: int) -> None:
        step_seconds.observe(seconds)
        batch_rows.observe(rows)

    step_loop.on_step = on_step
    host = settings.metrics_host or settings.host
    with serving_on("scheduler", "metrics", host, settings.metrics_port):
        port = metrics.serve(host, settings.metrics_port)
    log.info("metrics on port %d (/metrics)", port)
    return metrics


def run(settings: SchedulerSettings, ranks: LocalRanks | None = None) -> int:
    """Run this process's part of the group; return the exit code. `ranks`:
    the local ranks 1..N-1 if already started (`group.start_early`), else
    they are started here. The caller has raised the open-file limit
    (`mmsplit_cli.main`), before any rank it started, which inherit it.
    A start-up that fails once the local ranks run takes them down: they
    would wait for rank 0's first plan until their collective timed out,
    and rank 0's exit for them (multiprocessing joins its children)."""
    try:
        security, local = _security(settings)
        local_group = settings.launch == "local"
        if not forkable(settings) and (problem := cuda_problem(settings.device, settings.tp, local=local_group)):
            raise SystemExit(f"mmsplit scheduler: {problem}")  # before the group forms and loads the model
        try:
            model_info(settings.model_dir)  # its files (the processor's too) read once here, not on every rank
        except (OSError, ValueError) as exc:
            raise SystemExit(f"mmsplit scheduler: --model {settings.model_dir}: {exc}") from exc
        if settings.launch == "env":
            adopt_leaderworkerset_env(os.environ)
            boot = bootstrap(settings, None)
            if boot.coll.rank != 0:
                run_follower_until_stopped(boot)
                return 0
            tp = boot.coll.world_size
            return run_service(_serve(dataclasses.replace(settings, tp=tp), boot, None, security, local))
        if ranks is None:
            ranks = start_late(settings)  # forks of this process, on CPU (`scheduler_svc.group`)
        rendezvous = ranks.rendezvous if ranks else local_rendezvous(1)
        boot = _bootstrap_watching(settings, ranks, rendezvous)
        return run_service(_serve(settings, boot, ranks, security, local))
    except BaseException:
        if ranks is not None:
            ranks.terminate()
        raise


def _security(settings: SchedulerSettings) -> tuple[ServerSecurity, Path | None]:
    """The checks before the group forms (--dtype, the TLS and token
    files, the runtime directory), then how the scheduler's server is
    secured and the private directory its local token is published in
    (on loopback with neither TLS nor a token given; else None)."""
    try:
        model_dtype(settings.dtype, torch.device("cpu"))
        security = ServerSecurity.with_token_file(
            settings.auth_token_file, cert=settings.tls_cert, key=settings.tls_key, client_ca=settings.tls_client_ca
        )
        security.credentials()  # unreadable certificate files fail here (`run` takes early ranks down)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"mmsplit scheduler: {exc}") from exc
    local = None
    if is_loopback(settings.host) and not (settings.tls_client_ca or security.token or settings.insecure):
        # Loopback is open to every user of the host: a token only ours can read.
        try:
            local = localauth.private_dir(localauth.runtime_dir(settings.runtime_dir), create=True)
        except (localauth.RuntimeDirError, OSError) as exc:
            raise SystemExit(f"mmsplit scheduler: --runtime-dir: {exc}") from exc
        security = dataclasses.replace(security, token=localauth.new_token())
    if settings.insecure and not (settings.tls_client_ca or security.token):
        log.warning("serving %s with neither mutual TLS nor a token (--insecure)", settings.host)
    if security.token and not security.cert and not is_loopback(settings.host):
        log.warning("the token travels unencrypted: add --tls-cert and --tls-key where the network is not trusted")
    return security, local


def _bootstrap_watching(settings: SchedulerSettings, ranks: LocalRanks | None, rendezvous: Rendezvous) -> Bootstrapped:
    """Bootstrap rank 0 while watching the children: all ranks start or none."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bootstrap") as pool:
        fut = pool.submit(bootstrap, settings, rendezvous, ranks.arena if ranks else None)
        while not fut.done():
            concurrent.futures.wait([fut], timeout=0.2)
            dead = ranks.first_dead() if ranks else None
            if dead is not None and not fut.done():
                log.error("rank %d exited with code %s during startup; tearing the group down", *dead)
                ranks.terminate()  # type: ignore[union-attr]
                exit_now(1)  # the bootstrap thread is stuck in a rendezvous
        try:
            return fut.result()
        except BaseException:
            log.exception("rank 0 failed to start; tearing the group down")
            if ranks:
                ranks.terminate()
            raise


# The model's dtype -> the wire's (ServerInfo.encoder_input_dtype): the reader's table, turned round.
ENCODER_INPUT_DTYPES = {torch_dtype: common_pb2.Dtype.ValueType(code) for code, (torch_dtype, _) in READ_DTYPES.items()}


def server_info(
    settings: SchedulerSettings, info: ModelInfo, shm_namespace: str, kv_budget_tokens: int, vocabulary: str
) -> common_pb2.ServerInfo:
    transports = [common_pb2.TRANSPORT_INLINE]
    if shm_namespace:
        transports.insert(0, common_pb2.TRANSPORT_SHM)
    uuids = cuda_uuids(settings, shm_namespace)
    if uuids:
        transports.insert(0, common_pb2.TRANSPORT_CUDA_IPC)
    return common_pb2.ServerInfo(
        model=info.name,
        tp_size=settings.tp,
        transports=transports,
        cuda_device_uuids=uuids,
        shm_namespace=shm_namespace,
        shm_prefix=settings.shm_prefix,
        version=__version__,
        kv_budget_tokens=kv_budget_tokens,
        vocabulary=vocabulary,
        item_rules=pairing.item_rules(info.family),
        generate_stream=True,
        max_message_bytes=settings.max_message_bytes,
        max_tensor_bytes=settings.max_tensor_bytes,
        max_context_tokens=info.max_context,
        one_frame_image_rows=settings.one_frame_image_rows,
        encoder_input_dtype=ENCODER_INPUT_DTYPES[model_dtype(settings.dtype, model_device(settings.device))],
        eos_token_ids=sorted(info.eos_token_ids),
        default_max_tokens=settings.default_max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
    )


def cuda_uuids(settings: SchedulerSettings, shm_namespace: str) -> list[str]:
    """GPUs whose CUDA IPC handles every rank can open: the backend's, when
    every rank is on this host (local launch) and shares its /dev/shm (where
    the pools' lease maps are); else none."""
    if settings.launch != "local" or not shm_namespace:
        return []
    return cuda_ipc.current().uuids()


def kv_budget(settings: SchedulerSettings, info: ModelInfo, itemsize: int) -> int:
    """The KV-cache budget in tokens: configured, or what --kv-cache-bytes holds."""
    if settings.kv_budget_tokens:
        return settings.kv_budget_tokens
    per_token = info.kv_bytes_per_token(tp=settings.tp, itemsize=itemsize)
    return settings.kv_cache_bytes // per_token


def budget_shortfall(settings: SchedulerSettings, budget: int, max_context: int) -> str:
    """What a KV budget below the model's context means, said with the
    setting to raise; "" when a request of the whole context fits."""
    if budget >= max_context:
        return ""
    flag = "--kv-budget-tokens" if settings.kv_budget_tokens else "--kv-cache-bytes"
    return (
        f"the KV budget ({budget} tokens) is less than the model's context ({max_context}): every request whose "
        f"prompt and max_tokens need more is refused (INVALID_REQUEST); raise {flag} to serve the whole context"
    )


async def _watch_steps(step_loop: StepLoop, timeout_s: float, fatal: asyncio.Event) -> None:
    """Fail the group when one step makes no progress for `timeout_s` — a
    wedged read, forward or collective that nothing else would notice at
    TP=1 (a dead rank or a collective timeout catch the rest). The same
    clean failure as a dead rank: typed errors, NOT_SERVING, exit 1."""
    interval = min(1.0, timeout_s / 4)
    while not fatal.is_set():
        await asyncio.sleep(interval)
        started = step_loop.step_started
        if started is not None and time.monotonic() - started > timeout_s:
            log.error("a step has made no progress for %.1fs (--step-timeout-s); the group is down", timeout_s)
            fatal.set()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the event loop closed during shutdown; nobody listens
        log.debug("dropped a callback after the event loop closed")


async def _serve(
    settings: SchedulerSettings,
    boot: Bootstrapped,
    ranks: LocalRanks | None,
    security: ServerSecurity,
    local: Path | None,
) -> int:
    """Serve until stopped; with `local` (a private directory), the
    scheduler's local token is published there for as long as it serves."""
    published: list[Path] = []

    def withdraw() -> None:
        for path in published:
            localauth.withdraw(path, security.token)

    try:
        return await _serve_published(settings, boot, ranks, security, local, published, withdraw)
    finally:
        withdraw()


async def _serve_published(
    settings: SchedulerSettings,
    boot: Bootstrapped,
    ranks: LocalRanks | None,
    security: ServerSecurity,
    local: Path | None,
    published: list[Path],
    withdraw: Callable[[], None],
) -> int:
    aio_loop = asyncio.get_running_loop()
    fatal = asyncio.Event()
    stop = asyncio.Event()

    def stop_ranks_now() -> None:
        if ranks is not None:
            ranks.stopping = True
            ranks.terminate(grace_s=1.0)

    on_stop_signals(aio_loop, stop, settings.shutdown_grace_s, stop_ranks_now)

    # Loading the tokenizer for it takes a moment: meanwhile the step loop starts.
    vocab = asyncio.ensure_future(asyncio.to_thread(pairing.vocabulary, settings.model_dir))
    info = model_info(settings.model_dir)
    budget = kv_budget(settings, info, boot.engine.dtype.itemsize)
    step_loop = StepLoop(
        boot.engine,
        boot.coll,
        settings,
        eos_token_ids=info.eos_token_ids,
        max_context=info.max_context,
        kv_budget_tokens=budget,
        post=lambda fn: _call_soon(aio_loop, fn),
        on_fatal=lambda exc: _call_soon(aio_loop, fatal.set),
        heap=boot.heap,
    )
    thread = threading.Thread(target=step_loop.run, name="step-loop", daemon=True)
    thread.start()

    health = Health(SERVICE_NAME)
    await health.start()
    with serving_on("scheduler", "gRPC", settings.host, settings.port):
        server, port = await new_server(
            host=settings.host,
            port=settings.port,
            health_=health,
            service_names=[SERVICE_NAME],
            max_message_bytes=settings.max_message_bytes,
            security=security,
            keepalive_s=settings.keepalive_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_connections=settings.connection_limit,
        )
    probes = None
    if settings.health_port:
        health_host = settings.health_host or settings.host
        with serving_on("scheduler", "health", health_host, settings.health_port):
            probes, probe_port = await health_server(health_host, settings.health_port, health)
        log.info("health alone on port %d", probe_port)
    described = server_info(settings, info, boot.shm_namespace, budget, await vocab)
    frontend = Frontend(step_loop, settings, info, cuda_uuids=frozenset(described.cuda_device_uuids))
    metrics = _metrics(settings, step_loop)
    servicer = SchedulerServicer(frontend, described, step_loop, metrics)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    # Rank 0's start-up (the model, the tokenizer loaded for the vocabulary,
    # the server) out of the collector's reach, before serving; the other
    # ranks freeze theirs as they start to follow.
    gcheap.freeze(count=metrics is not None)
    if local is not None:
        published.append(localauth.provision(local, port, security.token))
    await server.start()
    log.info(
        "scheduler listening on %s:%d (tp=%d, model=%s, vocabulary %s, item rules %s)",
        settings.host,
        port,
        settings.tp,
        info.name,
        described.vocabulary or "unknown",
        described.item_rules,
    )
    log.info(
        "batch: up to %d rows, KV budget %d tokens (%s), prefill up to %d tokens per step",
        settings.max_running,
        budget,
        "configured" if settings.kv_budget_tokens else f"{settings.kv_cache_bytes} bytes per rank",
        settings.max_prefill_tokens,
    )
    if short := budget_shortfall(settings, budget, info.max_context):
        log.warning("%s", short)
    await health.set_ready(True)

    if ranks is not None:

        def rank_exited(rank: int, code: int | None) -> None:
            log.error("rank %d exited with code %s; the group is down", rank, code)
            _call_soon(aio_loop, fatal.set)

        ranks.watch(rank_exited)

    watchdog = asyncio.create_task(_watch_steps(step_loop, settings.step_timeout_s, fatal))
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in [*waiters, watchdog]:
        w.cancel()
    await health.set_ready(False)

    if fatal.is_set():
        # Every open stream ends with a typed SCHEDULER_UNAVAILABLE (the step
        # thread may be stuck in a collective and cannot say it), then the
        # server stops; nothing waits for the step thread.
        frontend.fail_all(SchedulerUnavailable("the scheduler group failed; retry after it restarts"))
        for _ in range(40):
            if not frontend.open_streams:
                break
            await asyncio.sleep(0.05)
        await health.stopping()
        await server.stop(1.0)
        if ranks is not None:
            ranks.terminate()
        log.error("scheduler exiting with status 1 so the group is restarted")
        withdraw()
        exit_now(1)

    # Drain: refuse new requests, let running ones finish within the grace
    # period, then fail the rest with SHUTTING_DOWN (a typed, retriable error).
    log.info("shutting down: letting running requests finish for up to %.1fs", settings.shutdown_grace_s)
    step_loop.begin_drain()
    servicer.begin_drain()
    if not await asyncio.to_thread(step_loop.idle.wait, settings.shutdown_grace_s):
        log.warning("grace period over; failing the requests still running")
    if ranks is not None:
        ranks.stopping = True
    step_loop.request_stop()
    await health.stopping()
    await server.stop(2.0)
    if probes is not None:
        await probes.stop(0)
    await asyncio.to_thread(thread.join, settings.collective_timeout_s)
    if ranks is not None and not await asyncio.to_thread(ranks.join, 10.0):
        ranks.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()
    log.info("scheduler stopped")
    return 0
