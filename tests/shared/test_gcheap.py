"""`mmsplit_server.gcheap`: the start-up frozen out of the garbage
collector's reach, garbage collected first; collections counted."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from mmsplit_server import gcheap


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
