"""Materializing tensor references on a rank.

A `TensorReader` turns a validated `TensorSpec` into a torch tensor or raises
an `MmsplitError` (InvalidTensorRef / TensorTransportFailed). It is the
component tests substitute to inject read failures on chosen ranks: the
`tensor_reader` setting names a ``module:factory`` that is called as
``factory(rank=..., prefix=..., max_bytes=...)`` on every rank.

What `read` returns is **borrowed**: the engine reads it (checks, hashes,
converts or concatenates it into the model's own inputs) and never writes
it or hands it to the model as is, and it stays valid until the step's
`end_step`. That lets the shared-memory reader give the bytes in place —
a slab slice through this process's mapping of the slab, held by a lock of
the rank's own until the step ends; inline bytes as they arrived — so a
tensor is copied once on its way into the model (by the conversion or the
concatenation the model's inputs need anyway), not twice, and no fresh
tensor's pages are faulted in for it. bench/shm_handoff.py measures lending
against copying into a fresh tensor, whole hand-offs to a rank other than
0: 1.5x faster at 0.6 MB, 1.6 to 1.8x at 1.35 MB and 2.0 to 2.1x at 6.8 MB (four runs).
On rank 0 the reader shares the lock rank 0 holds since Accepted (`ranges.take`).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Protocol

import numpy as np
import torch

from mmsplit_server.handoff import cuda_ipc, ranges
from mmsplit_server.handoff.reference import Claim, TensorSpec
from scheduler_svc.settings import SchedulerSettings

# Wire dtype -> the torch dtype, and the numpy dtype a lent tensor is made
# through (a numpy array over the bytes, then torch's view of it):
# bfloat16, which numpy lacks, as its bits, viewed as bfloat16 after.
DTYPES = {
    1: (torch.float32, np.float32),
    2: (torch.float16, np.float16),
    3: (torch.bfloat16, np.uint16),
    4: (torch.uint8, np.uint8),
    5: (torch.int64, np.int64),
}


log = logging.getLogger(__name__)

# Borrowed bytes are read-only (a slab mapping, a bytes object); torch warns
# once that it cannot mark a tensor so. The engine never writes them.
warnings.filterwarnings("ignore", message="The given (buffer|NumPy array) is not writable", category=UserWarning)


class TensorReader(Protocol):
    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        """The tensor, borrowed until `end_step`: read it, never write it."""
        ...

    def end_step(self) -> None:
        """The step is over: what its reads lent may go (never raises)."""
        ...


class SharedMemoryReader:
    """Lends slab slices and inline bytes in place; copies one-off segments
    (read with pread, no mapping) and CUDA-IPC ranges into fresh tensors
    (`TensorSpec.lend`)."""

    def __init__(self, *, rank: int, prefix: str, max_bytes: int) -> None:
        self.rank = rank
        self.prefix = prefix
        self.max_bytes = max_bytes
        # The claims of this step's reads (slices lent in place), each this rank's own.
        self._held: list[Claim] = []

    def end_step(self) -> None:
        # Every rank steps at least once per heartbeat: pools of tokenizers
        # that are gone are closed here, on each rank (at most once a second).
        try:
            cuda_ipc.imported.tidy()
        except Exception:
            log.exception("rank %d: closing the CUDA IPC pools of gone tokenizers failed", self.rank)
        held, self._held = self._held, []
        for claim in held:
            try:
                claim.release()
            except Exception:  # never let one keep the others (or the step's end) from happening
                log.exception("rank %d: releasing a lent slice failed; dropping its lock now", self.rank)
                if isinstance(claim, ranges.Held):  # what lends in place: a slab slice
                    claim.close()

    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        dtype, through = DTYPES[spec.dtype]
        lent = spec.lend(self.prefix, max_bytes=self.max_bytes)
        if lent.claim is not None:
            self._held.append(lent.claim)
        data = lent.data
        if isinstance(data, torch.Tensor):  # a copy: a one-off segment's, or a CUDA-IPC range's
            return data.view(dtype).view(spec.shape)
        # Through numpy, not `torch.frombuffer(...).view(...)`: the first
        # calls after a megabyte-sized copy run with cold caches, and there
        # torch's two calls cost 44 µs here against 30 for these.
        lent_tensor = torch.from_numpy(np.ndarray(spec.shape, through, data))
        return lent_tensor if lent_tensor.dtype == dtype else lent_tensor.view(dtype)


def build_reader(settings: SchedulerSettings, rank: int) -> TensorReader:
    if not settings.tensor_reader:
        return SharedMemoryReader(rank=rank, prefix=settings.shm_prefix, max_bytes=settings.max_tensor_bytes)
    module_name, _, attr = settings.tensor_reader.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    reader: TensorReader = factory(rank=rank, prefix=settings.shm_prefix, max_bytes=settings.max_tensor_bytes)
    return reader
