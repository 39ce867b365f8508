"""`mmsplit_server.gcheap`: the start-up frozen out of the garbage
collector's reach, garbage collected first; collections counted."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from mmsplit_server import gcheap
from mmsplit_server.metrics import ServiceMetrics


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """This test process's heap with nothing frozen (the suite freezes its
    own: tests/conftest.py), then frozen again."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    yield
    gc.collect()
    gc.freeze()


def test_freeze_collects_the_garbage_first_and_freezes_what_lives(unfrozen: None) -> None:
    cycle = Node()
    cycle.other = Node()
    cycle.other.other = cycle  # garbage only the collector can free
    garbage = weakref.ref(cycle)
    del cycle
    alive = Node()
    gcheap.freeze()
    frozen = gc.get_freeze_count()
    assert garbage() is None, "a reference cycle that was garbage got frozen instead of collected"
    assert frozen > 1000, "the test process's imports, frozen"
    # Out of every collection's reach: no generation lists it any more.
    assert not any(o is alive for o in gc.get_objects())
    young = Node()
    assert any(o is young for o in gc.get_objects())


@pytest.mark.parametrize("at_freeze", [True, False])
def test_the_frozen_objects_are_counted_once_not_at_every_scrape(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch, at_freeze: bool
) -> None:
    """`gc.get_freeze_count()` walks every frozen object (~40 ms for a
    service's heap): the metrics' gauge reads the number counted once, at
    the freeze (or at the first scrape), not at every scrape. (The walk's
    number goes down as frozen objects die: the gauge keeps the start-up's.)"""
    walks: list[int] = []
    real = gc.get_freeze_count

    def walk() -> int:
        walks.append(real())
        return walks[-1]

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    gcheap.freeze(count=at_freeze)
    assert len(walks) == (1 if at_freeze else 0)
    metrics = ServiceMetrics("tokenizer")
    scrapes = [generate_latest(metrics.registry).decode() for _ in range(5)]
    assert len(walks) == 1, "walked the frozen objects again"
    assert walks[0] > 1000
    line = f"mmsplit_tokenizer_gc_frozen_objects {float(walks[0])}"
    assert all(line in text.splitlines() for text in scrapes), line
    gc.unfreeze()
    gcheap.freeze()  # a new freeze: counted afresh when asked
    assert gcheap.frozen_objects() == walks[-1]
    assert len(walks) == 2


def test_pauses_count_collections_by_generation() -> None:
    pauses = gcheap.Pauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.collections["0"] >= 1
    assert pauses.collections["2"] >= 2
    assert pauses.seconds["2"] > 0
    counted = dict(pauses.collections)
    gc.collect(2)
    assert pauses.collections == counted, "still counting after uninstall"
