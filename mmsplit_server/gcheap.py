"""Python's cyclic garbage collector in a long-running service: the
start-up's objects frozen out of its reach, and its pauses counted.

A service's heap after start-up is mostly what it imported and loaded:
torch, transformers, the tokenizer, the model's modules, hundreds of
thousands of objects that live as long as the process. CPython's full
(generation 2) collection walks every tracked object, so each one paused
the service for as long as that walk took: a tokenizer streaming 32
requests at a time ran one every 300-600 requests, 0.22-0.30 s each with
the GIL held, in which no stream got a token (bench/gc_pause.py: 180-206 ms
for a full collection of the start-up heap alone, 0.00 ms once frozen). `freeze` moves
what exists once the service is up into the collector's permanent
generation (`gc.freeze`), which no collection walks again: a full
collection then walks only what serving made. Reference counting still
frees frozen objects as ever; only a reference cycle among them would
stay, which is why garbage is collected first and why this is called at
the end of a process's start-up (and, in a CPU group's rank 0, also just
before it forks the other ranks, so each of them walks only its own).

`Pauses` counts the collections and the time they held the process, per
generation, for the metrics (`mmsplit_<service>_gc_*`). The frozen objects'
number (`frozen_objects`) is counted once: `gc.get_freeze_count()` walks
every frozen object with the GIL held, ~40 ms for a service's ~390,000 on
this project's host. As the metrics' gauge it did so at every scrape of
/metrics, ~40 ms of CPU and a stall of every stream of that process each
time (a scrape cost ~40 ms of CPU; ~1.5 ms since).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

GENERATIONS = ("0", "1", "2")


# What `frozen_objects` counted since the last `freeze` (None: not yet).
_frozen: int | None = None


def freeze(*, count: bool = False) -> None:
    """Collect the garbage there is, then freeze every object left.
    `count`: count them now, before serving, for `frozen_objects` (a
    service whose metrics are on); else they are counted when first asked
    for, if ever (the count walks every frozen object, ~40 ms for a
    service's ~390,000, where the collection and the freeze of a process
    whose imports are frozen already take ~3 ms)."""
    global _frozen
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count() if count else None
    counted = f"{_frozen:,} " if count else ""
    log.info(
        "the start-up's %sobjects moved out of the garbage collector's reach (%.3f s)",
        counted,
        time.perf_counter() - started,
    )


def frozen_objects() -> int:
    """The objects in the collector's permanent generation, counted once
    per `freeze` (nothing else freezes or unfreezes in a service)."""
    global _frozen
    if _frozen is None:
        _frozen = gc.get_freeze_count()
    return _frozen


class Pauses:
    """Collections and the seconds they took, per generation, from
    `install` on (a `gc.callbacks` hook: it runs with the GIL held, in
    whichever thread the collection happens)."""

    def __init__(self) -> None:
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self._started = 0.0

    def install(self) -> Pauses:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        generation = str(info["generation"])
        self.collections[generation] += 1
        self.seconds[generation] += now - self._started
