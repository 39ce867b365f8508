"""Ranks 1..N-1 of a local group, as child processes of rank 0.

`LocalRanks` spawns them (spawn, never fork: rank 0 will have torch threads)
and watches them. This module imports nothing heavy: `mmsplit scheduler`
starts the ranks before it imports torch and transformers itself, so that
each rank's ~3 s of imports runs beside rank 0's instead of after it (a
TP=2 group served in ~7.5 s here, and ~4 s with its ranks started first).
A rank imports what it runs (`scheduler_svc.ranks`) once it has started.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from mmsplit.serving import exit_now, free_port
from scheduler_svc.settings import SchedulerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a locally launched rank joins its group."""

    addr: str
    port: int
    rank: int
    world_size: int


def _follower(settings: SchedulerSettings, rendezvous: Rendezvous) -> None:
    """What a spawned rank runs: here, so that spawning it imports only this
    module. The rank leaves with rank 0: once rank 0 is gone (killed while
    the group was forming, say) nothing else would end it before its
    rendezvous timed out."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), name="rank-0-watch", daemon=True).start()
    from scheduler_svc.ranks import follower_main

    follower_main(settings, rendezvous)
    # Stopped in order: the group is destroyed and the rank holds nothing;
    # rank 0's stop waits for this process to end, teardown and all.
    exit_now(0)


def _exit_when_gone(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


class LocalRanks:
    """Ranks 1..N-1 as children of this process (rank 0), joining the group
    at `rendezvous` (rank 0's: a free port on 127.0.0.1)."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.rendezvous = Rendezvous("127.0.0.1", free_port(), 0, settings.tp)
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_follower,
                args=(settings, replace(self.rendezvous, rank=rank)),
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


def start_early(settings: SchedulerSettings) -> LocalRanks | None:
    """The local ranks 1..N-1, started now (None when there are none: TP=1,
    or `--launch env`, where each rank is a process of its own)."""
    if settings.launch == "env" or settings.tp <= 1:
        return None
    ranks = LocalRanks(settings)
    ranks.start()
    return ranks
