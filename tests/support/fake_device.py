"""A fake GPU for the CUDA-IPC transport (`--cuda-ipc-backend
tests.support.fake_device:make` on both services): "device memory" is a
shared-memory slab of the test's prefix, its "IPC handle" the slab's name.
Everything around the copy — the lease map, the hand-over, the release after
the agreement, the accounting, the transport choice — runs as with a GPU.
Its UUID is derived from the /dev/shm namespace, so two processes "see the
same GPU" exactly when they share /dev/shm."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from mmsplit_server.handoff import cuda_ipc, files, ranges

PREFIX = os.environ.get("MMSPLIT_SHM_PREFIX", "mmsplit")


def uuid() -> str:
    return "FAKE-" + files.namespace_id()[:12]


class FakeExported:
    def __init__(self, nbytes: int) -> None:
        self._memory = ranges.Slab(PREFIX, os.getpid(), nbytes)
        self.handle = json.dumps({"fake": self._memory.name}).encode()
        self.uuid = uuid()

    def write(self, offset: int, data: memoryview) -> None:
        fd = files.open_segment(self._memory.name, PREFIX, write=True)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._memory.close()


class FakeOpened:
    """The fake memory as an importer holds it: an open descriptor of its
    segment, which keeps the memory allocated, as an opened CUDA IPC handle
    keeps the exporter's GPU memory, until closed. `live` counts those open
    in this process."""

    live = 0

    def __init__(self, name: str) -> None:
        self._fd: int | None = files.open_segment(name, PREFIX)
        self.size = os.fstat(self._fd).st_size
        FakeOpened.live += 1

    def read(self, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        if self._fd is None:
            raise cuda_ipc.DeviceError("the pool was closed")
        if offset + nbytes > self.size:
            raise cuda_ipc.DeviceError("the range lies outside the exported allocation")
        out = np.empty(nbytes, dtype=np.uint8)
        if os.preadv(self._fd, [memoryview(out)], offset) != nbytes:  # type: ignore[list-item]
            raise cuda_ipc.DeviceError("the fake device memory is shorter than its range")
        return torch.from_numpy(out)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            FakeOpened.live -= 1


class FakeBackend:
    def uuids(self) -> list[str]:
        return [uuid()]

    def allocate(self, nbytes: int) -> cuda_ipc.Exported:
        return FakeExported(nbytes)

    def open(self, handle: bytes) -> cuda_ipc.Opened:
        try:
            return FakeOpened(json.loads(handle)["fake"])
        except (ValueError, KeyError, TypeError, files.SegmentError) as exc:
            raise cuda_ipc.DeviceError(f"the fake device handle could not be opened: {type(exc).__name__}") from exc


def make() -> cuda_ipc.Backend:
    return FakeBackend()
