"""Device memory handed from the tokenizer to scheduler ranks by CUDA IPC.

The tokenizer stages preprocessed tensors into one allocation on its GPU (a
`DevicePool`) and exports the pool's IPC handle; ranks on the same node open
the handle once per pool and copy each tensor's range into a tensor of their
own. The pool's memory is leased exactly as the shared-memory slab's is
(`mmsplit_server.slab`): a **lease map** — a sparse slab file in /dev/shm whose
byte ranges stand for the pool's — carries the byte-range locks. The writer
holds a range from the moment it is allocated, rank 0 takes its own lock
before `Accepted`, the tokenizer then lets go, and rank 0 lets go after the
agreement (every rank has copied). Locks vanish with their holder, so a dead
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
"""

from __future__ import annotations

import base64
import importlib
import json
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mmsplit_server import shm, slab

MAX_HANDLE_BYTES = 4096


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


class Backend(Protocol):
    def uuids(self) -> list[str]:
        """The devices this process can export from or import on."""

    def allocate(self, nbytes: int) -> Exported: ...

    def read(self, handle: bytes, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        """A tensor of this process's (on `like`'s device type) holding a copy of
        [offset, offset + nbytes) of the exporter's allocation; the opened
        handle is kept for the next read. DeviceError if it cannot be opened."""

    def forget(self, handle: bytes) -> None:
        """Close an opened handle (its exporter's pool is gone)."""


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


class CudaBackend:
    """torch's CUDA IPC: an allocation shared by `_share_cuda_`, opened by
    `UntypedStorage._new_shared_cuda` (what torch.multiprocessing's reductions
    use), cached per handle."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._opened: dict[bytes, torch.UntypedStorage] = {}
        self._lock = threading.Lock()

    def uuids(self) -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]

    def allocate(self, nbytes: int) -> Exported:
        return _CudaExported(nbytes, self.index)

    def read(self, handle: bytes, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        with self._lock:
            storage = self._opened.get(handle)
            if storage is None:
                try:
                    storage = torch.UntypedStorage._new_shared_cuda(*_decode(handle))  # type: ignore[attr-defined]
                except (RuntimeError, TypeError, ValueError) as exc:
                    raise DeviceError(f"the CUDA IPC handle could not be opened: {type(exc).__name__}") from exc
                self._opened[handle] = storage
        if offset + nbytes > storage.nbytes():
            raise DeviceError("the range lies outside the exported allocation")
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        target = like if like.type == "cuda" else storage.device
        out = whole[offset : offset + nbytes].to(target, copy=True)
        torch.cuda.synchronize(out.device)
        return out

    def forget(self, handle: bytes) -> None:
        with self._lock:
            self._opened.pop(handle, None)


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


DEFAULT_BACKEND = "mmsplit_server.devices:cuda_backend"
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


# --- the exporter's pool -------------------------------------------------------


class DevicePool:
    """The tokenizer's staging memory on one device: an allocation of the
    backend's and the lease map that accounts for it (same size, same
    offsets). Created once; removed with `close`."""

    def __init__(self, backend: Backend, prefix: str, owner_pid: int, nbytes: int) -> None:
        self.leases = slab.Slab(prefix, owner_pid, nbytes, sparse=True)
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

    def put(self, data: memoryview, *, wait_s: float) -> slab.Held:
        """Stage `data` in a free range; the range comes back held by this
        process (a read lock on the lease map). SlabFull when there is no room."""
        data = data.cast("B")
        return slab.lease(
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
        (shm.SHM_DIR / name).stat()
    except FileNotFoundError:
        return False
    return True
