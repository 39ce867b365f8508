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

from mmsplit_server import devices, shm, slab

PREFIX = os.environ.get("MMSPLIT_SHM_PREFIX", "mmsplit")


def uuid() -> str:
    return "FAKE-" + shm.namespace_id()[:12]


class FakeExported:
    def __init__(self, nbytes: int) -> None:
        self._memory = slab.Slab(PREFIX, os.getpid(), nbytes)
        self.handle = json.dumps({"fake": self._memory.name}).encode()
        self.uuid = uuid()

    def write(self, offset: int, data: memoryview) -> None:
        fd = shm.open_segment(self._memory.name, PREFIX, write=True)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._memory.close()


class FakeBackend:
    def uuids(self) -> list[str]:
        return [uuid()]

    def allocate(self, nbytes: int) -> devices.Exported:
        return FakeExported(nbytes)

    def read(self, handle: bytes, offset: int, nbytes: int, like: torch.device) -> torch.Tensor:
        try:
            name = json.loads(handle)["fake"]
            out = np.empty(nbytes, dtype=np.uint8)
            view = memoryview(out)  # type: ignore[arg-type]
            slab.read_slice(shm.Slice(name, offset, nbytes), PREFIX, view, max_segment_bytes=1 << 40)
        except (ValueError, KeyError, TypeError, shm.SegmentError) as exc:
            raise devices.DeviceError(f"the fake device handle could not be opened: {type(exc).__name__}") from exc
        return torch.from_numpy(out)

    def forget(self, handle: bytes) -> None:
        pass


def make() -> devices.Backend:
    return FakeBackend()
