"""The CUDA-IPC transport: device memory handed from the tokenizer to
scheduler ranks by CUDA IPC.

The tokenizer stages preprocessed tensors into one allocation on its GPU (a
`DevicePool`) and exports the pool's IPC handle; ranks on the same node open
the handle once per pool and copy each tensor's range into a tensor of their
own. The pool's memory is leased exactly as the shared-memory slab's is
(`ranges`, as under the slab transport): a **lease map** — a sparse
slab file in /dev/shm whose byte ranges stand for the pool's — carries the
byte-range locks. The writer
holds a range from the moment it is allocated, rank 0 takes its own lock
before `Accepted`, the tokenizer then lets go, and rank 0 lets go after the
step (every rank has copied). Locks vanish with their holder, so a dead
importer never pins pool memory; a dead exporter's GPU memory goes with it
(and its lease map is swept like any unowned segment). No pid, no lease
timer, no release message.

What touches a device is a `Backend`, chosen by a ``module:factory`` setting
on both services: `cuda_backend` (torch's CUDA IPC) in production, a fake in
the tests (`tests/support/fake_device.py`), which keeps "device" memory in
shared memory so the protocol, the accounting and the transport choice run
without a GPU.

The handle travels as JSON of plain fields (never pickle: the scheduler
decodes what a caller sent).

An importer keeps each pool it opened (`Imported`): opening a handle maps
the exporter's whole allocation, and keeps it allocated while it stays open.
So each rank closes a pool once its exporter is gone (its lease map removed:
the tokenizer stopped, or its janitor swept it after a crash), checked at
most once a second from the end of each step (rank 0's heartbeat makes steps
on every rank even when idle), and keeps at most `--cuda-ipc-max-pools` open,
closing the least recently used one beyond that. Without this, each
tokenizer restart or scale-in left a whole staging pool mapped, and so
allocated, on every rank's GPU until the scheduler restarted.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmsplit_server.handoff import files, ranges

MAX_HANDLE_BYTES = 4096
# Pools an importer keeps open at most (`--cuda-ipc-max-pools` on the scheduler).
DEFAULT_MAX_POOLS = 8

log = logging.getLogger(__name__)


class DeviceError(Exception):
    """A handle that cannot be decoded or opened here."""


class Exported(Protocol):
    """One allocation of the exporter's, with its IPC handle."""

    handle: bytes
    uuid: str

    def write(self, offset: int, data: memoryview) -> None:
        """Copy host bytes into [offset, offset + len); done when it returns."""

    def close(self) -> None:
        """Free the allocation (importers' copies are theirs)."""


class Opened(Protocol):
    """An exporter's allocation as an importer opened it."""

    def read(self, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        """A tensor of this process's (on `like`'s device type) holding a copy
        of [offset, offset + nbytes); DeviceError for a range outside it."""

    def close(self) -> None:
        """Let the allocation go (its memory is freed once its exporter and
        every importer have let go)."""


class Backend(Protocol):
    def uuids(self) -> list[str]:
        """The devices this process can export from or import on."""

    def allocate(self, nbytes: int) -> Exported: ...

    def open(self, handle: bytes) -> Opened:
        """Open an exporter's handle; DeviceError if it cannot be opened here."""


# --- torch's CUDA IPC ---------------------------------------------------------


class _CudaExported:
    def __init__(self, nbytes: int, index: int) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        fields = self.memory.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
        self.handle = _encode(fields)
        self.uuid = str(torch.cuda.get_device_properties(index).uuid)

    def write(self, offset: int, data: memoryview) -> None:
        src = torch.frombuffer(data, dtype=torch.uint8)
        self.memory[offset : offset + src.numel()].copy_(src)
        torch.cuda.synchronize(self.memory.device)

    def close(self) -> None:
        self.memory = torch.empty(0, dtype=torch.uint8)


class _CudaOpened:
    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage: torch.UntypedStorage | None = storage

    def read(self, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        storage = self.storage
        if storage is None:
            raise DeviceError("the pool was closed")
        if offset + nbytes > storage.nbytes():
            raise DeviceError("the range lies outside the exported allocation")
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        target = like if like.type == "cuda" else storage.device
        out = whole[offset : offset + nbytes].to(target, copy=True)
        torch.cuda.synchronize(out.device)
        return out

    def close(self) -> None:
        # The mapping goes with the last reference to the storage; the
        # caching allocator's IPC bookkeeping is told to let it go now.
        self.storage = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


class CudaBackend:
    """torch's CUDA IPC: an allocation shared by `_share_cuda_`, opened by
    `UntypedStorage._new_shared_cuda` (what torch.multiprocessing's reductions
    use)."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def uuids(self) -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]

    def allocate(self, nbytes: int) -> Exported:
        return _CudaExported(nbytes, self.index)

    def open(self, handle: bytes) -> Opened:
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*_decode(handle))  # type: ignore[attr-defined]
        except (RuntimeError, TypeError, ValueError) as exc:
            raise DeviceError(f"the CUDA IPC handle could not be opened: {type(exc).__name__}") from exc
        return _CudaOpened(storage)


def cuda_backend() -> Backend:
    return CudaBackend()


def _encode(fields: tuple[Any, ...]) -> bytes:
    """`_share_cuda_`'s tuple as JSON: ints and bools as they are, bytes in base64."""
    plain = [
        {"b": base64.b64encode(f).decode()} if isinstance(f, bytes) else f for f in fields
    ]  # int, bool, bytes only
    return json.dumps(plain).encode()


def _decode(handle: bytes) -> tuple[Any, ...]:
    if len(handle) > MAX_HANDLE_BYTES:
        raise ValueError("not a CUDA IPC handle: too long")
    try:
        fields = json.loads(handle)
    except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError("not a CUDA IPC handle: not JSON") from exc
    if not isinstance(fields, list):
        raise ValueError("not a CUDA IPC handle: not a list of fields")
    out: list[Any] = []
    for f in fields:
        if isinstance(f, dict) and set(f) == {"b"} and isinstance(f["b"], str):
            out.append(base64.b64decode(f["b"], validate=True))
        elif isinstance(f, bool | int):
            out.append(f)
        else:
            raise ValueError("not a CUDA IPC handle: an unexpected field")
    return tuple(out)


# --- the backend a process uses ----------------------------------------------

_loaded: dict[str, Backend] = {}
_loaded_lock = threading.Lock()


DEFAULT_BACKEND = "mmsplit_server.handoff.cuda_ipc:cuda_backend"
_current = DEFAULT_BACKEND


def load(spec: str) -> Backend:
    """The backend a ``module:factory`` setting names, made once per process."""
    with _loaded_lock:
        if spec not in _loaded:
            module_name, _, attr = spec.partition(":")
            factory: Callable[[], Backend] = getattr(importlib.import_module(module_name), attr)
            _loaded[spec] = factory()
        return _loaded[spec]


def configure(spec: str) -> Backend:
    """Make `spec` this process's backend (each service and rank at start)."""
    global _current
    _current = spec or DEFAULT_BACKEND
    return load(_current)


def current() -> Backend:
    return load(_current)


# --- the importer's open pools ------------------------------------------------


@dataclass
class _Pool:
    opened: Opened
    lease: str  # the exporter's lease map: gone when the exporter is
    readers: int = 0
    closing: bool = False


class Imported:
    """The pools this process opened, by handle: kept for the next read,
    closed once their exporter is gone (`tidy`), and at most `max_pools`
    of them (the least recently used beyond that is closed; one being read
    is closed when its read ends)."""

    def __init__(self, max_pools: int = DEFAULT_MAX_POOLS) -> None:
        self.max_pools = max_pools
        self._pools: OrderedDict[bytes, _Pool] = OrderedDict()
        self._lock = threading.Lock()
        self._tidied = 0.0

    def read(
        self, backend: Backend, handle: bytes, lease: str, offset: int, nbytes: int, like: torch.device
    ) -> torch.Tensor:
        """A copy of [offset, offset + nbytes) of the pool `handle` names
        (opened now, or kept from before); DeviceError if it cannot be."""
        with self._lock:
            pool = self._pools.get(handle)
            if pool is None or pool.lease != lease:
                if pool is not None:  # the same handle, another lease map: not the pool we opened
                    raise DeviceError("the CUDA IPC handle does not belong to this lease map")
                pool = _Pool(backend.open(handle), lease)
                self._pools[handle] = pool
                self._over_cap()
            self._pools.move_to_end(handle)
            pool.readers += 1
        try:
            return pool.opened.read(offset, nbytes, like)
        finally:
            with self._lock:
                pool.readers -= 1
                if pool.closing and not pool.readers:
                    pool.opened.close()

    def tidy(self, *, every_s: float = 1.0) -> int:
        """Close the pools whose exporter is gone (at most once per
        `every_s`; 0 checks now); how many were closed."""
        now = time.monotonic()
        with self._lock:
            if every_s and now - self._tidied < every_s:
                return 0
            self._tidied = now
            leases = {pool.lease for pool in self._pools.values()}
        gone = {lease for lease in leases if not lease_alive(lease)}
        if not gone:
            return 0
        with self._lock:
            closed = [handle for handle, pool in self._pools.items() if pool.lease in gone]
            for handle in closed:
                self._close(handle)
        log.info("closed %d CUDA IPC pool(s) whose exporter is gone", len(closed))
        return len(closed)

    def count(self) -> int:
        """Pools open now."""
        with self._lock:
            return len(self._pools)

    def close_all(self) -> None:
        with self._lock:
            for handle in list(self._pools):
                self._close(handle)

    def _over_cap(self) -> None:
        while len(self._pools) > self.max_pools:
            oldest = next(iter(self._pools))
            log.info("more than %d CUDA IPC pools open: closing the least recently used", self.max_pools)
            self._close(oldest)

    def _close(self, handle: bytes) -> None:
        pool = self._pools.pop(handle)
        pool.closing = True
        if not pool.readers:
            pool.opened.close()


imported = Imported()


def read(handle: bytes, lease: str, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
    """This process's read of an exporter's range (`Imported.read`, with the current backend)."""
    return imported.read(current(), handle, lease, offset, nbytes, like)


# --- the exporter's pool -------------------------------------------------------


class DevicePool:
    """The tokenizer's staging memory on one device: an allocation of the
    backend's and the lease map that accounts for it (same size, same
    offsets). Created once; removed with `close`."""

    def __init__(self, backend: Backend, prefix: str, owner_pid: int, nbytes: int) -> None:
        self.leases = ranges.Slab(prefix, owner_pid, nbytes, sparse=True)
        try:
            self.memory = backend.allocate(self.leases.size)
        except BaseException:
            self.leases.close()
            raise
        self.prefix = prefix

    @property
    def size(self) -> int:
        return self.leases.size

    @property
    def uuid(self) -> str:
        return self.memory.uuid

    @property
    def handle(self) -> bytes:
        return self.memory.handle

    def put(self, data: memoryview, *, wait_s: float) -> ranges.Held:
        """Stage `data` in a free range; the range comes back held by this
        process (a read lock on the lease map). SlabFull when there is no room."""
        data = data.cast("B")
        return ranges.lease(
            self.leases.name,
            self.prefix,
            data.nbytes,
            lambda _fd, _ino, offset: self.memory.write(offset, data),
            wait_s=wait_s,
        )

    def used_bytes(self) -> int:
        return self.leases.used_bytes()

    def close(self) -> None:
        self.memory.close()
        self.leases.close()


def lease_alive(name: str) -> bool:
    """Whether an exporter's lease map still exists (else its pool is gone)."""
    try:
        (files.SHM_DIR / name).stat()
    except FileNotFoundError:
        return False
    return True
