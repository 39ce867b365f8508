"""A least-recently-used map bounded by bytes, the core of both services'
caches (the tokenizer's preprocessed items, the scheduler's encoder outputs).

Entries are checked on use: `get` takes a predicate, and an entry that fails
it is dropped and counted, never returned. Hits and misses are counted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        # key -> (value, its size when it was put)
        self._entries: OrderedDict[bytes, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.dropped = 0  # entries found wrong on use

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: bytes) -> V | None:
        """The entry, without counting or reordering anything."""
        found = self._entries.get(key)
        return found[0] if found is not None else None

    def keys(self) -> list[bytes]:
        """Every key, least recently used first."""
        return list(self._entries)

    def touch(self, key: bytes) -> None:
        """Make `key` (which must be held) the most recent, counting nothing."""
        self._entries.move_to_end(key)

    def get(self, key: bytes, valid: Callable[[V], bool] = lambda _: True) -> V | None:
        """The entry, made most recent, when it passes `valid` (else it is
        dropped); counts a hit or a miss."""
        entry = self.peek(key)
        if entry is not None and not valid(entry):
            self._remove(key)
            self.dropped += 1
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, value: V, size: int) -> None:
        """Keep `value` (of `size` bytes), evicting the least recent; a value
        over the whole budget is not kept."""
        if size > self.capacity:
            return
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.capacity:
            self._remove(next(iter(self._entries)))
            self.evictions += 1

    def _remove(self, key: bytes) -> None:
        _, size = self._entries.pop(key)
        self.bytes -= size
