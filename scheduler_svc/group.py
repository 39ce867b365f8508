"""Ranks 1..N-1 of a local group, as child processes of rank 0.

`LocalRanks` starts them and watches them. On CPU they are forks of rank 0,
made once rank 0 has imported torch and transformers and before it starts a
thread (`start_late`): a rank then costs no imports at all (5-10 s of CPU
each here). Where CUDA may be used they are spawned instead, as new
interpreters (a process that has touched CUDA cannot be forked), and
started before rank 0 imports anything (`start_early`), so that each rank's
imports run beside rank 0's instead of after them (a TP=2 group served in
~7.5 s, and ~4 s with its ranks started first). This module imports nothing
heavy; a spawned rank imports what it runs (`scheduler_svc.ranks`) once it
has started.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mmsplit_server import gcheap
from mmsplit_server.serving import exit_now, name_process
from scheduler_svc import shm_allreduce
from scheduler_svc.rendezvous import Rendezvous, close_listeners, local_rendezvous
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.shm_allreduce import Arena

log = logging.getLogger(__name__)

# What rank 0 sends a local rank it wants gone (its default action ends the
# process); SIGINT and SIGTERM are ignored there.
LEAVE_SIGNAL = signal.SIGUSR1


def _follower(settings: SchedulerSettings, rendezvous: Rendezvous, arena: Arena | None) -> None:
    """What a spawned rank runs: here, so that spawning it imports only this
    module. The rank leaves with rank 0: once rank 0 is gone (killed while
    the group was forming, say) nothing else would end it before its
    rendezvous timed out."""
    name_process(f"mmsplit-rank{rendezvous.rank}".encode())
    close_listeners()  # rank 0's, when this rank is a fork of it
    # A terminal's Ctrl-C and a stop of the whole process group reach every
    # rank; the stop is rank 0's to run (it drains, then tells the ranks in
    # the plan). A rank that died of the signal instead would take the group
    # down with an error. Rank 0 asks a laggard to go with LEAVE_SIGNAL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(LEAVE_SIGNAL, signal.SIG_DFL)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), name="rank-0-watch", daemon=True).start()
    from scheduler_svc.ranks import follower_main

    follower_main(settings, rendezvous, arena)
    # Stopped in order: the group is destroyed and the rank holds nothing;
    # rank 0's stop waits for this process to end, teardown and all.
    exit_now(0)


def _exit_when_gone(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


class LocalRanks:
    """Ranks 1..N-1 as children of this process (rank 0), joining the group
    at `rendezvous` (rank 0's: a port on 127.0.0.1 it listens on already)."""

    def __init__(self, settings: SchedulerSettings, method: str = "spawn") -> None:
        self.settings = settings
        self.method = method  # "fork" or "spawn"
        self.rendezvous = local_rendezvous(settings.tp)
        # Shared by forks only: made here, before them (`scheduler_svc.shm_allreduce`).
        self.arena = Arena(settings.tp) if method == "fork" and shares_arena(settings) else None
        ctx: Any = mp.get_context(method)
        self.procs = [
            ctx.Process(
                target=_follower,
                args=(settings, replace(self.rendezvous, rank=rank), self.arena),
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
        log.info("started ranks 1..%d as pids %s (%s)", self.settings.tp - 1, [p.pid for p in self.procs], self.method)

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
        """LEAVE_SIGNAL (ranks ignore SIGTERM: see `_follower`), then KILL
        what is still alive after `grace_s`."""
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, LEAVE_SIGNAL)
        for p in self.procs:
            p.join(grace_s)
            if p.is_alive():
                log.warning("rank process %s did not leave when asked; killing it", p.pid)
                p.kill()
                p.join(grace_s)


def forkable(settings: SchedulerSettings) -> bool:
    """Whether the ranks may be forks of rank 0: the group runs on CPU
    (`--device cpu`, or `auto` on a machine with no NVIDIA device)."""
    return settings.device == "cpu" or (settings.device == "auto" and not glob.glob("/dev/nvidia[0-9]*"))


def shares_arena(settings: SchedulerSettings) -> bool:
    """Whether forked ranks sum the model's TP partials over shared memory."""
    return settings.tp_all_reduce == "shm" and settings.tp > 1 and shm_allreduce.supported()


def start_early(settings: SchedulerSettings) -> LocalRanks | None:
    """The local ranks 1..N-1, spawned now, before rank 0's imports, where
    they cannot be forks of rank 0 later (`forkable`); else None (and None
    for TP=1 or `--launch env`, where each rank is a process of its own)."""
    if settings.launch == "env" or settings.tp <= 1 or forkable(settings):
        return None
    ranks = LocalRanks(settings, "spawn")
    ranks.start()
    return ranks


def start_late(settings: SchedulerSettings) -> LocalRanks | None:
    """The local ranks 1..N-1, started now that rank 0 has imported what
    they run: forks of it where `forkable` and it runs no other thread yet,
    else spawned. None for TP=1 or `--launch env`."""
    if settings.launch == "env" or settings.tp <= 1:
        return None
    method = "fork" if forkable(settings) and threading.active_count() == 1 else "spawn"
    if method == "fork":
        # The imports every fork shares, out of the collector's reach once,
        # here: each rank's own freeze at the end of its start-up then walks
        # only what it made (and no collection in a rank touches, so copies,
        # the pages it shares with rank 0).
        gcheap.freeze()
    ranks = LocalRanks(settings, method)
    ranks.start()
    return ranks
