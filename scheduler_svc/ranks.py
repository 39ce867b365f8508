"""Starting, bootstrapping and watching the ranks of a local group.

`LocalRanks` spawns ranks 1..N-1 as child processes of rank 0 (spawn, never
fork: the parent already has torch threads). `bootstrap` is what every rank
runs before its first step: join the group, load the model, and exchange the
shared-memory namespace ids — that exchange is also the all-ranks-started
barrier.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mmsplit import devices, shm
from mmsplit.serving import setup_logging
from scheduler_svc.collective import Rendezvous, TorchCollective, init_group, pick_device
from scheduler_svc.engine import Engine
from scheduler_svc.loop import run_follower
from scheduler_svc.model import load_model, model_dtype, model_info
from scheduler_svc.reader import build_reader
from scheduler_svc.settings import SchedulerSettings

log = logging.getLogger(__name__)


@dataclass
class Bootstrapped:
    engine: Engine
    coll: TorchCollective
    # The namespace shared by every rank, or "" when the ranks see different /dev/shm.
    shm_namespace: str


def bootstrap(settings: SchedulerSettings, rendezvous: Rendezvous | None) -> Bootstrapped:
    """Join the group (`rendezvous` None: torch's env://), load the model,
    exchange namespace ids. Returns when every rank has done the same."""
    init_group(
        rendezvous=rendezvous,
        device=settings.device,
        timeout_s=settings.collective_timeout_s,
        startup_timeout_s=settings.startup_timeout_s,
    )
    torch.set_num_threads(max(1, torch.get_num_threads() // dist.get_world_size()))
    devices.configure(settings.cuda_ipc_backend)
    device = pick_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    model = load_model(settings.model_dir, world_size=dist.get_world_size(), device=device, dtype=dtype)
    coll = TorchCollective(device)
    info = model_info(settings.model_dir)
    engine = Engine(
        model,
        coll,
        build_reader(settings, coll.rank),
        device,
        eos_token_ids=info.eos_token_ids,
        family=info.family,
        encoder_cache_bytes=settings.encoder_cache_bytes,
    )
    # Last, so it doubles as the barrier "every rank has everything it needs":
    # a rank that failed above never joins it, and rank 0 never serves.
    namespaces: list[str] = [""] * coll.world_size
    dist.all_gather_object(namespaces, shm.namespace_id())
    shared = namespaces[0] if len(set(namespaces)) == 1 else ""
    if not shared and coll.rank == 0:
        log.warning("ranks see different /dev/shm (%s); only inline tensors are accepted", namespaces)
    return Bootstrapped(engine, coll, shared)


def follower_main(settings: SchedulerSettings, rendezvous: Rendezvous | None) -> None:
    """Entry point of a rank other than 0 (spawned locally, or started with
    --launch env)."""
    setup_logging(settings.log_level)
    boot = bootstrap(settings, rendezvous)
    run_follower_until_stopped(boot)


def run_follower_until_stopped(boot: Bootstrapped) -> None:
    log.info("rank %d ready", boot.coll.rank)
    run_follower(boot.engine, boot.coll)
    dist.destroy_process_group()
    log.info("rank %d stopped", boot.coll.rank)


class LocalRanks:
    """Ranks 1..N-1 as children of this process (rank 0)."""

    def __init__(self, settings: SchedulerSettings, addr: str, port: int) -> None:
        self.settings = settings
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=follower_main,
                args=(settings, Rendezvous(addr, port, rank, settings.tp)),
                name=f"mmsplit-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, settings.tp)
        ]
        # Set before an orderly stop, so the monitor does not report it as a failure.
        self.stopping = False

    def start(self) -> None:
        for p in self.procs:
            p.start()
        log.info("started ranks 1..%d as pids %s", self.settings.tp - 1, [p.pid for p in self.procs])

    def first_dead(self) -> tuple[int, int | None] | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return rank, p.exitcode
        return None

    def watch(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Call `on_exit(rank, exitcode)` from a thread when any rank exits."""

        def wait() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
            ready = multiprocessing.connection.wait(list(sentinels))
            rank = sentinels[ready[0]]  # type: ignore[index]
            proc = self.procs[rank - 1]
            proc.join(1.0)  # the sentinel fires just before exitcode is known
            if not self.stopping:
                on_exit(rank, proc.exitcode)

        if self.procs:
            threading.Thread(target=wait, name="rank-monitor", daemon=True).start()

    def join(self, timeout: float) -> bool:
        for p in self.procs:
            p.join(timeout)
        return all(not p.is_alive() for p in self.procs)

    def terminate(self, grace_s: float = 3.0) -> None:
        """TERM, then KILL what is still alive after `grace_s`."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(grace_s)
            if p.is_alive():
                log.warning("rank process %s ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.join(grace_s)
