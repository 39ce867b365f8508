"""The tensor reference codec: `TensorRef` <-> `TensorSpec`, with validation.

`TensorSpec` is the plain, picklable form the scheduler puts in its step plan.
Everything that can be checked from the message alone is checked in
`from_pb` (dtype allow-list, shape, size cap, name pattern, byte counts);
what needs the segment itself (existence, bounds) is checked by `read_into`
on every rank. A reference to shared or GPU memory is a capability: every
method that locks or reads one first verifies its grant
(`mmsplit_server.grants`), so naming a location is not enough to read it.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError
from mmsplit_server import devices, grants, shm, slab
from mmsplit_server.shm import Lock, Slice

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
MAX_DIMS = 8


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


@dataclass(frozen=True)
class CudaRef:
    """A range of an exporter's GPU pool (`mmsplit_server.devices`): its handle and
    device, and the range of the pool's lease map standing for it."""

    handle: bytes
    uuid: str
    lease: shm.Slice  # lease map name, offset, nbytes: the same range of the pool


@dataclass(frozen=True)
class TensorSpec:
    dtype: int
    shape: tuple[int, ...]
    shm: shm.Slice | None = None
    inline: bytes | None = None
    cuda: CudaRef | None = None
    grant: grants.Grant | None = None  # with shm and cuda: the sender's proof (mmsplit_server.grants)

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
                shm.parse_name(ref.shm.segment, prefix)
            except shm.BadSegmentName as exc:
                raise InvalidTensorRef(str(exc)) from exc
            piece = shm.Slice(ref.shm.segment, ref.shm.offset, ref.shm.nbytes)
            return cls(ref.dtype, shape, shm=piece, grant=_grant(ref, prefix))
        if location == "inline":
            if len(ref.inline) != nbytes:
                raise InvalidTensorRef(f"inline payload has {len(ref.inline)} bytes, shape needs {nbytes}")
            return cls(ref.dtype, shape, inline=ref.inline)
        if location == "cuda_ipc":
            cuda = _cuda_ref(ref.cuda_ipc, nbytes, prefix, cuda_uuids)
            return cls(ref.dtype, shape, cuda=cuda, grant=_grant(ref, prefix))
        raise InvalidTensorRef("tensor reference has no location")

    def read_into(self, out: memoryview, *, prefix: str, max_bytes: int) -> None:
        """Copy the tensor's bytes into `out`; raise InvalidTensorRef or
        TensorTransportFailed. Never anything else for a bad reference."""
        if self.inline is not None:
            out.cast("B")[:] = self.inline
            return
        if self.cuda is not None:
            raw = self.read_device(torch.device("cpu"), prefix)
            out.cast("B")[:] = memoryview(raw.cpu().numpy())  # type: ignore[arg-type]
            return
        if self.shm is None:
            raise InvalidTensorRef("tensor reference has no location")
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            slab.read_slice(self.shm, prefix, out, max_segment_bytes=max_bytes)

    def borrow(self, prefix: str) -> tuple[memoryview, slab.Held | None] | None:
        """The tensor's bytes in place, read-only, where they can be had
        without a copy: inline bytes as they arrived, or a slab slice in
        this process's mapping under a lock of the caller's own (`take`;
        release it when done with the view, which is valid until then).
        None for a one-off segment or a CUDA-IPC range (`read_into`).
        Raises InvalidTensorRef, TensorTransportFailed, or
        TensorResourcesExhausted (no descriptor to spare: OVERLOADED)."""
        if self.inline is not None:
            return memoryview(self.inline).toreadonly(), None
        if self.shm is None or not shm.is_slab(self.shm.segment):
            return None
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            held = slab.take(self.shm, prefix)
            try:
                return held.view(), held
            except BaseException:
                held.close()
                raise

    def read_device(self, like: torch.device, prefix: str) -> torch.Tensor:
        """A CUDA-IPC reference's bytes as a uint8 tensor of this process's,
        on `like`'s device when it is a GPU (one device-to-device copy)."""
        assert self.cuda is not None
        lease = self.cuda.lease
        with _TRANSLATED:
            self._verify(lease, prefix)
        try:
            return devices.read(self.cuda.handle, lease.segment, lease.offset, lease.nbytes, like)
        except devices.DeviceError as exc:
            raise TensorTransportFailed(str(exc)) from exc

    def lock(self, prefix: str) -> Lock | slab.Held | None:
        """Take ownership of the referenced segment or slab slice (None for
        inline bytes); InvalidTensorRef or TensorTransportFailed when it
        cannot be had. The grant is verified first, so a refused reference
        never locks anything; and a slab slice must be held by its sender
        right now (`slab.take`)."""
        if self.cuda is not None:
            with _TRANSLATED:
                self._verify(self.cuda.lease, prefix)
                return slab.take(self.cuda.lease, prefix)
        if self.shm is None:
            return None
        with _TRANSLATED:
            self._verify(self.shm, prefix)
            if shm.is_slab(self.shm.segment):
                return slab.take(self.shm, prefix)
            return shm.Lock(self.shm.segment, prefix)

    def _verify(self, piece: Slice, prefix: str) -> None:
        grants.verify(self.grant, piece.segment, piece.offset, piece.nbytes, prefix)

    def release(self) -> None:
        """Unlink the segment this spec refers to (idempotent, never raises).
        A slab slice is released by dropping its lock, never by unlinking."""
        if self.shm is not None and not shm.is_slab(self.shm.segment):
            shm.unlink(self.shm.segment)


def _grant(ref: common_pb2.TensorRef, prefix: str) -> grants.Grant:
    if not ref.HasField("grant"):
        raise InvalidTensorRef("a reference to shared or GPU memory must carry its grant")
    try:
        shm.parse_name(ref.grant.table, prefix)
    except shm.BadSegmentName as exc:
        raise InvalidTensorRef(f"grant table: {exc}") from exc
    if not shm.is_grant_table(ref.grant.table):
        raise InvalidTensorRef("grant table: not a grant table's name")
    return grants.Grant(ref.grant.table, ref.grant.index, bytes(ref.grant.tag))


def _cuda_ref(pb: common_pb2.CudaIpcHandle, nbytes: int, prefix: str, uuids: Collection[str]) -> CudaRef:
    if not uuids:
        raise InvalidTensorRef("transport cuda_ipc is not offered by this server")
    if pb.device_uuid not in uuids:
        raise InvalidTensorRef("the tensor is on a GPU this server cannot open (device UUID not among its own)")
    if pb.nbytes != nbytes:
        raise InvalidTensorRef(f"range nbytes {pb.nbytes} != prod(shape) * itemsize = {nbytes}")
    if not pb.handle or len(pb.handle) > devices.MAX_HANDLE_BYTES:
        raise InvalidTensorRef(f"the CUDA IPC handle must be 1..{devices.MAX_HANDLE_BYTES} bytes")
    try:
        shm.parse_name(pb.lease, prefix)
    except shm.BadSegmentName as exc:
        raise InvalidTensorRef(f"lease: {exc}") from exc
    if not shm.is_slab(pb.lease):
        raise InvalidTensorRef("lease: not a lease map's name")
    return CudaRef(bytes(pb.handle), pb.device_uuid, shm.Slice(pb.lease, pb.offset, pb.nbytes))


class _Translated:
    """shm's errors into ours, once, where they enter a request's life
    (`with _TRANSLATED:`). A class, not a generator-based context manager:
    that one cost ~12 µs per use with the caches a rank's step leaves,
    a twentieth of a slab hand-off."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, shm.NoDescriptors):
            raise TensorResourcesExhausted(str(exc)) from exc
        if isinstance(exc, (shm.BadSegmentName, shm.SegmentBounds, shm.NotASegment, grants.GrantRefused)):
            # What the reference names is not a usable segment: the sender's fault.
            raise InvalidTensorRef(str(exc)) from exc
        if isinstance(exc, (shm.SegmentMissing, shm.ForeignSegment, slab.SliceLost)):
            # Gone, or a deployment whose services run as different users.
            raise TensorTransportFailed(str(exc)) from exc
        if isinstance(exc, OSError):
            # strerror only: the full text names the segment's path.
            raise TensorTransportFailed(f"the segment could not be read: {exc.strerror}") from exc


_TRANSLATED = _Translated()
