"""Bootstrapping a rank, and a follower rank's life.

`bootstrap` is what every rank runs before its first step: join the group,
load the model, and exchange the shared-memory namespace ids — that
exchange is also the all-ranks-started barrier. (`scheduler_svc.group`
starts a local group's ranks 1..N-1.)
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mmsplit_server import gcheap, mallocheap
from mmsplit_server.handoff import cuda_ipc, files
from mmsplit_server.serving import setup_logging
from mmsplit_server.structured import Grammars
from scheduler_svc import counted_sums, experts, shm_allreduce
from scheduler_svc.collective import TorchCollective, init_group, pick_device
from scheduler_svc.engine import Engine
from scheduler_svc.loop import IdleHeap, run_follower
from scheduler_svc.model import ModelInfo, load_model, model_dtype, model_info
from scheduler_svc.reader import build_reader
from scheduler_svc.rendezvous import Rendezvous
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.shm_allreduce import Arena
from scheduler_svc.threads import StepThreads

log = logging.getLogger(__name__)


@dataclass
class Bootstrapped:
    engine: Engine
    coll: TorchCollective
    # The namespace shared by every rank, or "" when the ranks see different /dev/shm.
    shm_namespace: str
    # Where the model's TP sums go, when not through the group's backend.
    arena: Arena | None = None
    # This rank's heaps' free memory, given back when it has nothing to run.
    heap: IdleHeap | None = None


def bootstrap(settings: SchedulerSettings, rendezvous: Rendezvous | None, arena: Arena | None = None) -> Bootstrapped:
    """Join the group (`rendezvous` None: torch's env://), load the model,
    route its TP sums through `arena` (a local CPU group's, made before its
    ranks were forked), exchange namespace ids. Returns when every rank has
    done the same."""
    mallocheap.keep()  # each item's model input and the step's large buffers: from a heap kept warm
    init_group(
        rendezvous=rendezvous,
        device=settings.device,
        timeout_s=settings.collective_timeout_s,
        startup_timeout_s=settings.startup_timeout_s,
    )
    torch.set_num_threads(max(1, torch.get_num_threads() // dist.get_world_size()))
    cuda_ipc.configure(settings.cuda_ipc_backend)
    cuda_ipc.imported.max_pools = settings.cuda_ipc_max_pools
    device = pick_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    info = model_info(settings.model_dir)
    model = load_model(
        settings.model_dir,
        world_size=dist.get_world_size(),
        device=device,
        dtype=dtype,
        tp_plan_overrides=info.family.tp_plan_overrides(),
    )
    if info.family.splits_experts_after_load and settings.moe_experts == "split":
        experts.split(model)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        short = memory_shortfall(settings, info, dtype.itemsize, free)
        if short:
            log.warning("rank %d: %s", dist.get_rank(), short)
    coll = TorchCollective(device)
    shared_sums = arena is not None and shm_allreduce.install(arena, settings.collective_timeout_s)
    coll.arena = arena if shared_sums else None
    coll.sums = counted_sums.install() if coll.world_size > 1 and not shared_sums else None
    engine = Engine(
        model,
        coll,
        build_reader(settings, coll.rank),
        device,
        eos_token_ids=info.eos_token_ids,
        family=info.family,
        encoder_cache_bytes=settings.encoder_cache_bytes,
        prefill_chunk=settings.max_prefill_tokens,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        cudnn_attention=settings.cudnn_attention,
        decode_kv_multiple=settings.decode_kv_multiple,
        head_layout=settings.lm_head_layout,
        lean_decode=settings.lean_decode,
        threads=StepThreads(torch.get_num_threads()) if device.type == "cpu" and settings.tune_threads else None,
        hook=importlib.import_module(settings.engine_hook) if settings.engine_hook else None,
        grammars=Grammars(settings.model_dir, info.eos_token_ids) if coll.rank == 0 else None,
    )
    # Last, so it doubles as the barrier "every rank has everything it needs":
    # a rank that failed above never joins it, and rank 0 never serves.
    gathered: list[tuple[str, bool]] = [("", False)] * coll.world_size
    dist.all_gather_object(gathered, (files.namespace_id(), shared_sums))
    namespaces = [namespace for namespace, _ in gathered]
    if len({sums for _, sums in gathered}) > 1:
        raise RuntimeError(f"ranks disagree on summing over shared memory: {[sums for _, sums in gathered]}")
    if shared_sums and coll.rank == 0:
        log.info("the model's tensor-parallel sums go over shared memory (--tp-all-reduce shm)")
    shared = namespaces[0] if len(set(namespaces)) == 1 else ""
    if not shared and coll.rank == 0:
        log.warning("ranks see different /dev/shm (%s); only inline tensors are accepted", namespaces)
    return Bootstrapped(engine, coll, shared, arena if shared_sums else None, IdleHeap(settings.heap_free_limit_bytes))


def memory_shortfall(settings: SchedulerSettings, info: ModelInfo, itemsize: int, free_bytes: int) -> str:
    """What the settings may hold on a rank's device beyond what it has free
    once the model is loaded, said with the flags to lower; "" when it
    fits. A warning, not a refusal: the KV cache and both caches grow as
    they are used, and running out fails the requests that needed the
    memory (OVERLOADED), not the group."""
    if settings.kv_budget_tokens:
        kv = (
            "--kv-budget-tokens",
            settings.kv_budget_tokens * info.kv_bytes_per_token(tp=settings.tp, itemsize=itemsize),
        )
    else:
        kv = ("--kv-cache-bytes", settings.kv_cache_bytes)
    parts = [
        kv,
        ("--prefix-cache-bytes", settings.prefix_cache_bytes),
        ("--encoder-cache-bytes", settings.encoder_cache_bytes),
    ]
    wanted = sum(size for _, size in parts)
    if wanted <= free_bytes:
        return ""
    said = " + ".join(f"{flag} {size / 2**30:.2f} GiB" for flag, size in parts if size)
    return (
        f"{said} = {wanted / 2**30:.2f} GiB may be held on this device, which has {free_bytes / 2**30:.2f} GiB free "
        "with the model loaded (and each step's activations need room too): requests will fail OVERLOADED once "
        "it runs out; lower these"
    )


def follower_main(settings: SchedulerSettings, rendezvous: Rendezvous | None, arena: Arena | None = None) -> None:
    """Entry point of a rank other than 0 (local, or started with --launch env)."""
    setup_logging(settings.log_level)
    boot = bootstrap(settings, rendezvous, arena)
    run_follower_until_stopped(boot)


def run_follower_until_stopped(boot: Bootstrapped) -> None:
    # A collection's pause on any rank holds every rank at its next
    # collective: no rank walks the start-up's objects again (rank 0 freezes
    # its own once its server is made).
    gcheap.freeze()
    log.info("rank %d ready", boot.coll.rank)
    run_follower(boot.engine, boot.coll, boot.heap)
    dist.destroy_process_group()
    sums = f" after {boot.arena.sums} sums over shared memory" if boot.arena else ""
    log.info("rank %d stopped%s", boot.coll.rank, sums)
