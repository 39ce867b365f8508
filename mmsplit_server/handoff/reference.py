"""The hand-off's one interface: a tensor reference (`TensorRef` on the
wire, `TensorSpec` here) and what each side does with one, whichever of the
four transports carries it.

- The tokenizer places a tensor (`place`: into a slice of its slab, a
  one-off segment, or the message itself; the CUDA-IPC staging pool places
  through `cuda_ipc.DevicePool.put`) and holds what it placed until the
  scheduler takes it over.
- The scheduler's rank 0 takes a reference over before it says Accepted
  (`TensorSpec.take` → a `Claim`), and every rank lends the bytes to the
  step that reads them (`TensorSpec.lend` → `Lent`: in place where the
  transport allows, else a copy).
- One release: whoever holds a `Claim` ends it with `release` (done with
  the bytes: freed once no holder is left) or, when the bytes' ownership has
  passed to another holder, `disown`.

Each transport is a module of its own that imports none of the others:
`inline`, `segment` (a one-off shared-memory segment), `slab` (a slice of
the tokenizer's slab) and `cuda_ipc` (a range of a tokenizer's GPU pool).
Under them are `files` (the /dev/shm files, their names and errors),
`ranges` (leases by byte-range locks, for the slab and the GPU pool's lease
map) and `grants` (a reference is a capability). Only this module knows
them all.

Everything that can be checked from the message alone is checked in
`TensorSpec.from_pb` (dtype allow-list, shape, size cap, name pattern, byte
counts); what needs the segment itself (existence, bounds) is checked when
it is taken or lent, on every rank. A reference to shared or GPU memory is a
capability: taking or lending one first verifies its grant, so naming a
location is not enough to read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError
from mmsplit_server.handoff import cuda_ipc, files, grants, inline, ranges, segment, slab

D = common_pb2.Dtype

# dtype -> (itemsize, numpy name or None when numpy has no such dtype)
DTYPES: dict[int, tuple[int, str | None]] = {
    D.DTYPE_FLOAT32: (4, "float32"),
    D.DTYPE_FLOAT16: (2, "float16"),
    D.DTYPE_BFLOAT16: (2, None),
    D.DTYPE_UINT8: (1, "uint8"),
    D.DTYPE_INT64: (8, "int64"),
}
NUMPY_TO_DTYPE = {name: code for code, (_, name) in DTYPES.items() if name}
# The names tensors are given by in this project (numpy's, and bfloat16) -> dtype.
DTYPE_BY_NAME = {**NUMPY_TO_DTYPE, "bfloat16": D.DTYPE_BFLOAT16}


def itemsize(name: str) -> int:
    """The bytes of one element of a dtype named as in `DTYPE_BY_NAME`."""
    return DTYPES[DTYPE_BY_NAME[name]][0]


MAX_DIMS = 8
_CPU = torch.device("cpu")


class InvalidTensorRef(MmsplitError):
    """The reference itself is malformed or not acceptable (sender, not retriable)."""

    code = E.ERROR_CODE_INVALID_REQUEST


class TensorTransportFailed(MmsplitError):
    """A well-formed reference could not be read (server side, retriable)."""

    code = E.ERROR_CODE_FEATURE_TRANSPORT_FAILED


class TensorResourcesExhausted(MmsplitError):
    """The reference could not be opened for want of a resource of this
    server's (file descriptors): the server's condition, retriable."""

    code = E.ERROR_CODE_OVERLOADED


class Claim(Protocol):
    """A hold of this process's on the bytes a reference names."""

    def release(self) -> None:
        """Done with the bytes: let them go (a one-off segment's owner
        removes it; a slice is free once its last holder lets go).
        Idempotent; never raises for what it finds."""
        ...

    def disown(self) -> None:
        """The bytes are another holder's to release now (the scheduler said
        Accepted), or always were: drop this hold only. Idempotent."""
        ...


class Lent(NamedTuple):
    """A tensor's bytes lent to a step: a read-only view in place (inline
    bytes, a slab slice), a fresh CPU copy (a one-off segment), or a uint8
    tensor on the reader's device (a CUDA-IPC range); and the claim that
    keeps them valid, to release when the step ends (None: nothing held)."""

    data: memoryview | torch.Tensor
    claim: Claim | None


@dataclass(frozen=True)
class CudaRef:
    """A range of an exporter's GPU pool (`cuda_ipc`): its handle and
    device, and the range of the pool's lease map standing for it."""

    handle: bytes
    uuid: str
    lease: files.Slice  # lease map name, offset, nbytes: the same range of the pool


@dataclass(frozen=True)
class TensorSpec:
    dtype: int
    shape: tuple[int, ...]
    shm: files.Slice | None = None  # a slab slice or a one-off segment
    inline: bytes | None = None
    cuda: CudaRef | None = None
    grant: grants.Grant | None = None  # with shm and cuda: the sender's proof (`grants`)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_pb(self) -> common_pb2.TensorRef:
        ref = common_pb2.TensorRef(dtype=self.dtype, shape=self.shape)  # type: ignore[arg-type]
        if self.shm is not None:
            ref.shm.CopyFrom(
                common_pb2.ShmSlice(segment=self.shm.segment, offset=self.shm.offset, nbytes=self.shm.nbytes)
            )
        elif self.inline is not None:
            ref.inline = self.inline
        elif self.cuda is not None:
            lease = self.cuda.lease
            ref.cuda_ipc.CopyFrom(
                common_pb2.CudaIpcHandle(
                    handle=self.cuda.handle,
                    device_uuid=self.cuda.uuid,
                    offset=lease.offset,
                    nbytes=lease.nbytes,
                    lease=lease.segment,
                )
            )
        if self.grant is not None:
            ref.grant.CopyFrom(common_pb2.Grant(table=self.grant.table, index=self.grant.index, tag=self.grant.tag))
        return ref

    @classmethod
    def from_pb(
        cls, ref: common_pb2.TensorRef, *, prefix: str, max_bytes: int, cuda_uuids: Collection[str] = ()
    ) -> TensorSpec:
        """Decode and validate a reference; raise InvalidTensorRef. A CUDA-IPC
        reference is accepted only for a device in `cuda_uuids` (what this
        server can open)."""
        if ref.dtype not in DTYPES:
            raise InvalidTensorRef(f"dtype {ref.dtype} is not one of {sorted(D.Name(d) for d in DTYPES)}")
        shape = tuple(int(d) for d in ref.shape)
        if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 for d in shape):
            raise InvalidTensorRef(f"shape {list(shape)} must have 1..{MAX_DIMS} positive dimensions")
        itemsize = DTYPES[ref.dtype][0]
        nbytes = math.prod(shape) * itemsize
        if nbytes > max_bytes:
            raise InvalidTensorRef(f"tensor of shape {list(shape)} is {nbytes} bytes, over the cap {max_bytes}")
        location = ref.WhichOneof("location")
        if location == "shm":
            if ref.shm.nbytes != nbytes:
                raise InvalidTensorRef(f"slice nbytes {ref.shm.nbytes} != prod(shape) * itemsize = {nbytes}")
            try:
                files.parse_name(ref.shm.segment, prefix)
            except files.BadSegmentName as exc:
                raise InvalidTensorRef(str(exc)) from exc
            piece = files.Slice(ref.shm.segment, ref.shm.offset, ref.shm.nbytes)
            return cls(ref.dtype, shape, shm=piece, grant=_grant(ref, prefix))
        if location == "inline":
            if len(ref.inline) != nbytes:
                raise InvalidTensorRef(f"inline payload has {len(ref.inline)} bytes, shape needs {nbytes}")
            return cls(ref.dtype, shape, inline=ref.inline)
        if location == "cuda_ipc":
            cuda = _cuda_ref(ref.cuda_ipc, nbytes, prefix, cuda_uuids)
            return cls(ref.dtype, shape, cuda=cuda, grant=_grant(ref, prefix))
        raise InvalidTensorRef("tensor reference has no location")

    def take(self, prefix: str) -> Claim | None:
        """Take the referenced bytes over from their holder (None for inline
        bytes, which the message carries): rank 0's before it says Accepted.
        InvalidTensorRef or TensorTransportFailed when they cannot be had.
        The grant is verified first, so a refused reference never takes
        anything; and a slice must be held by its sender right now
        (`ranges.take`)."""
        if self.cuda is not None:
            with _TRANSLATED:
                self._verify(self.cuda.lease, prefix)
                return ranges.take(self.cuda.lease, prefix)
        if self.shm is None:
            return None
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            return hold(self.shm, prefix)

    def lend(self, prefix: str, *, max_bytes: int, like: torch.device | None = None) -> Lent:
        """The bytes for a step to read (`Lent`), never written by it: inline
        bytes as they arrived and a slab slice in place (under a claim of the
        caller's own: release it when the step ends), a one-off segment
        copied into a fresh buffer (pread, no mapping), a CUDA-IPC range
        copied onto `like`'s device when it is a GPU (None: this process's
        current GPU when it has one, straight from the exporter's pool;
        else the CPU). Raises
        InvalidTensorRef, TensorTransportFailed, or TensorResourcesExhausted
        (no descriptor to spare: OVERLOADED); never anything else for a bad
        reference."""
        if self.inline is not None:
            return Lent(inline.lend(self.inline), None)
        if self.cuda is not None:
            if like is None:
                like = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else _CPU
            return Lent(self._read_device(like, prefix), None)
        if self.shm is None:
            raise InvalidTensorRef("tensor reference has no location")
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            if files.is_slab(self.shm.segment):
                view, held = slab.lend(self.shm, prefix)
                return Lent(view, held)
            raw = torch.empty(self.nbytes, dtype=torch.uint8)
            segment.read_into(self.shm, prefix, memoryview(raw.numpy()), max_segment_bytes=max_bytes)  # type: ignore[arg-type]
            return Lent(raw, None)

    def read_into(self, out: memoryview, *, prefix: str, max_bytes: int) -> None:
        """Copy the tensor's bytes into `out`; raise InvalidTensorRef or
        TensorTransportFailed. Never anything else for a bad reference."""
        if self.inline is not None:
            inline.read_into(self.inline, out)
            return
        if self.cuda is not None:
            raw = self._read_device(_CPU, prefix)
            out.cast("B")[:] = memoryview(raw.cpu().numpy())  # type: ignore[arg-type]
            return
        if self.shm is None:
            raise InvalidTensorRef("tensor reference has no location")
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            read_slice(self.shm, prefix, out, max_segment_bytes=max_bytes)

    def _read_device(self, like: torch.device, prefix: str) -> torch.Tensor:
        """A CUDA-IPC reference's bytes as a uint8 tensor of this process's,
        on `like`'s device when it is a GPU (one device-to-device copy)."""
        assert self.cuda is not None
        lease = self.cuda.lease
        with _TRANSLATED:
            self._verify(lease, prefix)
        try:
            return cuda_ipc.read(self.cuda.handle, lease.segment, lease.offset, lease.nbytes, like)
        except cuda_ipc.DeviceError as exc:
            raise TensorTransportFailed(str(exc)) from exc

    def _verify(self, piece: files.Slice, prefix: str) -> None:
        grants.verify(self.grant, piece.segment, piece.offset, piece.nbytes, prefix)


def place(
    data: memoryview,
    *,
    prefix: str,
    owner_pid: int,
    slab_name: str | None = None,
    max_slice: int = 0,
    wait_s: float = 0.0,
    on_written: Callable[[], None] | None = None,
) -> files.Slice:
    """The tokenizer's side (a worker's, or its own for a cache hit): `data`
    placed in shared memory, where a reference will name it. In slab
    `slab_name` when there is one and `data` is at most `max_slice` bytes
    (waiting up to `wait_s` for room; `on_written` runs while the slice is
    still write-locked), its writer's hold handed off to whoever takes it
    next (`hold`); else in a one-off segment of its own. Raises SlabFull,
    ShmFull or NoDescriptors. Bytes that go in the message are `inline`'s."""
    if slab_name is not None and data.nbytes <= max_slice:
        held = slab.place(slab_name, prefix, data, wait_s=wait_s, on_written=on_written)
        ranges.hand_off(held)
        return held.slice
    return segment.place(prefix, owner_pid, data)


def hold(piece: files.Slice, prefix: str) -> Claim:
    """The tokenizer's own claim on what it placed (a slab slice or a GPU
    pool's range is taken over from its writer, `ranges.take`; a one-off
    segment is locked): held until the scheduler has taken it over, then
    disowned, or released when nobody will. No grant: it is ours."""
    if files.is_slab(piece.segment):
        return ranges.take(piece, prefix)
    return segment.Claim(piece.segment, prefix)


def read_slice(piece: files.Slice, prefix: str, out: memoryview, *, max_segment_bytes: int) -> None:
    """Copy a slice of a slab or of a one-off segment into `out`. A slab is
    bigger than any tensor by design, so only a one-off segment is capped
    by `max_segment_bytes`."""
    if files.is_slab(piece.segment):
        slab.read_into(piece, prefix, out)  # its view checks the name
    else:
        segment.read_into(piece, prefix, out, max_segment_bytes=max_segment_bytes)


def read_bytes(piece: files.Slice, prefix: str, *, max_segment_bytes: int) -> bytes:
    """A copy of a slice of a slab or of a one-off segment. A slab's slice
    is copied straight from the mapping: one copy, with no zeroed buffer
    first (for a 1.35 MB image tensor, 0.07 ms here against 0.9 ms)."""
    if files.is_slab(piece.segment):
        part = slab.view(piece, prefix)
        try:
            return bytes(part)
        finally:
            part.release()
    out = bytearray(piece.nbytes)
    segment.read_into(piece, prefix, memoryview(out), max_segment_bytes=max_segment_bytes)
    return bytes(out)


def _grant(ref: common_pb2.TensorRef, prefix: str) -> grants.Grant:
    if not ref.HasField("grant"):
        raise InvalidTensorRef("a reference to shared or GPU memory must carry its grant")
    try:
        files.parse_name(ref.grant.table, prefix)
    except files.BadSegmentName as exc:
        raise InvalidTensorRef(f"grant table: {exc}") from exc
    if not files.is_grant_table(ref.grant.table):
        raise InvalidTensorRef("grant table: not a grant table's name")
    return grants.Grant(ref.grant.table, ref.grant.index, bytes(ref.grant.tag))


def _cuda_ref(pb: common_pb2.CudaIpcHandle, nbytes: int, prefix: str, uuids: Collection[str]) -> CudaRef:
    if not uuids:
        raise InvalidTensorRef("transport cuda_ipc is not offered by this server")
    if pb.device_uuid not in uuids:
        raise InvalidTensorRef("the tensor is on a GPU this server cannot open (device UUID not among its own)")
    if pb.nbytes != nbytes:
        raise InvalidTensorRef(f"range nbytes {pb.nbytes} != prod(shape) * itemsize = {nbytes}")
    if not pb.handle or len(pb.handle) > cuda_ipc.MAX_HANDLE_BYTES:
        raise InvalidTensorRef(f"the CUDA IPC handle must be 1..{cuda_ipc.MAX_HANDLE_BYTES} bytes")
    try:
        files.parse_name(pb.lease, prefix)
    except files.BadSegmentName as exc:
        raise InvalidTensorRef(f"lease: {exc}") from exc
    if not files.is_slab(pb.lease):
        raise InvalidTensorRef("lease: not a lease map's name")
    return CudaRef(bytes(pb.handle), pb.device_uuid, files.Slice(pb.lease, pb.offset, pb.nbytes))


class _Translated:
    """shm's errors into ours, once, where they enter a request's life
    (`with _TRANSLATED:`). A class, not a generator-based context manager:
    that one cost ~12 µs per use with the caches a rank's step leaves,
    a twentieth of a slab hand-off."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, files.NoDescriptors):
            raise TensorResourcesExhausted(str(exc)) from exc
        if isinstance(exc, (files.BadSegmentName, files.SegmentBounds, files.NotASegment, grants.GrantRefused)):
            # What the reference names is not a usable segment: the sender's fault.
            raise InvalidTensorRef(str(exc)) from exc
        if isinstance(exc, (files.SegmentMissing, files.ForeignSegment, ranges.SliceLost)):
            # Gone, or a deployment whose services run as different users.
            raise TensorTransportFailed(str(exc)) from exc
        if isinstance(exc, OSError):
            # strerror only: the full text names the segment's path.
            raise TensorTransportFailed(f"the segment could not be read: {exc.strerror}") from exc


_TRANSLATED = _Translated()
