"""References are capabilities (`mmsplit_server.handoff.grants`): a slab slice, a
one-off segment or a lease range is read only through a live grant for
exactly that location, checked before any lock, refused all alike."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import files, grants, ranges, segment, slab
from mmsplit_server.handoff.reference import InvalidTensorRef, TensorSpec
from tests.support.granting import grant_table, granted
from tests.support.leaks import PROJECT_PREFIX, own_slab, slab_locks

PREFIX = PROJECT_PREFIX + "grants"
CAP = 1 << 24


def slice_spec(piece: files.Slice) -> TensorSpec:
    return TensorSpec(common_pb2.DTYPE_UINT8, (piece.nbytes,), shm=piece)


def refused(spec: TensorSpec) -> str:
    """The message every way of using `spec` is refused with (one, or the test fails)."""
    said = set()
    uses = [
        lambda: spec.take(PREFIX),
        lambda: spec.read_into(memoryview(bytearray(spec.nbytes)), prefix=PREFIX, max_bytes=CAP),
    ]
    if spec.shm is not None and files.is_slab(spec.shm.segment):
        uses.append(lambda: spec.lend(PREFIX, max_bytes=CAP))  # a slab's slice in place (a one-off segment is read)
    for use in uses:
        with pytest.raises(InvalidTensorRef) as err:
            use()
        said.add(err.value.message)
    assert len(said) == 1, said
    return said.pop()


def test_a_granted_slice_reads_and_every_other_reference_is_refused_alike() -> None:
    data = np.random.default_rng(3).integers(0, 255, 3 * ranges.PAGE, dtype=np.uint8)
    with own_slab(PREFIX, 16 * ranges.PAGE) as s, grant_table(PREFIX) as table:
        writer = slab.place(s.name, PREFIX, memoryview(data), wait_s=0)
        good = granted(slice_spec(writer.slice), table)
        locks = slab_locks(s.name)["OFDLCK"]  # the writer's: its slice and its marker
        view, held = good.lend(PREFIX, max_bytes=CAP)
        assert isinstance(view, memoryview)
        assert bytes(view) == data.tobytes()
        assert isinstance(held, ranges.Held)
        view.release()
        held.close()
        assert slab_locks(s.name)["OFDLCK"] == locks

        forged = dataclasses.replace(good, grant=grants.Grant(table.name, good.grant.index, os.urandom(16)))  # type: ignore[union-attr]
        elsewhere = granted(slice_spec(files.Slice(s.name, ranges.PAGE, ranges.PAGE)), table)
        moved = dataclasses.replace(elsewhere, grant=good.grant)  # a real tag, carried to another page
        missing = dataclasses.replace(good, grant=None)
        no_table = dataclasses.replace(
            good,
            grant=grants.Grant(f"{PREFIX}-{os.getpid()}-grant0123456789a", 0, good.grant.tag),  # type: ignore[union-attr]
        )
        out_of_range = dataclasses.replace(good, grant=grants.Grant(table.name, 10**6, good.grant.tag))  # type: ignore[union-attr]
        messages = {refused(spec) for spec in (forged, moved, missing, no_table, out_of_range)}
        # The same words for a busy page (held by the writer now) as for anything else.
        assert messages == {"the reference is not granted by its sender (forged, or its request has ended)"}

        # A refused reference took no lock: the writer's are the only ones.
        assert slab_locks(s.name)["OFDLCK"] == locks

        table.revoke(good.grant)  # type: ignore[arg-type]
        assert refused(good)  # a replay of a request that has ended
        writer.release()


def test_a_one_off_segment_is_granted_too_and_a_refusal_never_removes_it() -> None:
    piece = segment.place(PREFIX, os.getpid(), memoryview(b"\x07" * 4096))
    try:
        with grant_table(PREFIX) as table:
            good = granted(slice_spec(piece), table)
            forged = dataclasses.replace(good, grant=grants.Grant(table.name, 0, bytes(16)))
            refused(forged)
            out = bytearray(4096)
            good.read_into(memoryview(out), prefix=PREFIX, max_bytes=CAP)
            assert out == b"\x07" * 4096
            table.close()  # its tokenizer stopped: every grant ends
            refused(good)
        assert piece.segment in files.list_segments(PREFIX)
    finally:
        files.unlink(piece.segment)


def test_entries_are_per_grant_and_a_full_table_says_so() -> None:
    with grant_table(PREFIX, entries=2) as table:
        first = table.issue("a", 0, 1)
        second = table.issue("a", 0, 1)  # the same location, granted twice (two requests of a cached item)
        assert first.tag != second.tag
        with pytest.raises(grants.TableFull):
            table.issue("a", 0, 1)
        table.revoke(first)
        table.revoke(first)  # twice is harmless
        assert table.in_use == 1
        grants.verify(second, "a", 0, 1, PREFIX)  # ending one leaves the other
        with pytest.raises(grants.GrantRefused):
            grants.verify(first, "a", 0, 1, PREFIX)
        table.revoke(second)
    assert not files.list_segments(PREFIX)
