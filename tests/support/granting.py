"""Grants for the references tests make by hand: what a tokenizer does
(`mmsplit_server.handoff.grants`) for specs a test builds itself."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager

from mmsplit.common.v1 import common_pb2
from mmsplit_server.handoff import grants
from mmsplit_server.handoff.reference import TensorSpec


@contextmanager
def grant_table(prefix: str, entries: int = 256) -> Iterator[grants.GrantTable]:
    """A grant table of this test process's, removed after."""
    table = grants.GrantTable(prefix, os.getpid(), entries)
    try:
        yield table
    finally:
        table.close()


def granted(spec: TensorSpec, table: grants.GrantTable) -> TensorSpec:
    """`spec` with a grant of `table` for the location it names."""
    piece = spec.shm if spec.shm is not None else spec.cuda.lease if spec.cuda is not None else None
    assert piece is not None, "only references to shared or GPU memory are granted"
    return dataclasses.replace(spec, grant=table.issue(piece.segment, piece.offset, piece.nbytes))


def grant_ref(ref: common_pb2.TensorRef, table: grants.GrantTable) -> common_pb2.TensorRef:
    """`ref` (a message naming a shared-memory slice) granted by `table` for
    exactly what it names: for tests that send references of their own
    making to a scheduler, so that what they probe lies past the grant."""
    grant = table.issue(ref.shm.segment, ref.shm.offset, ref.shm.nbytes)
    ref.grant.CopyFrom(common_pb2.Grant(table=grant.table, index=grant.index, tag=grant.tag))
    return ref
