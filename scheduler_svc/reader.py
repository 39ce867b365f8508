"""Materializing tensor references on a rank.

A `TensorReader` turns a validated `TensorSpec` into a torch tensor or raises
an `MmsplitError` (InvalidTensorRef / TensorTransportFailed). It is the
component tests substitute to inject read failures on chosen ranks: the
`tensor_reader` setting names a ``module:factory`` that is called as
``factory(rank=..., prefix=..., max_bytes=...)`` on every rank.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from mmsplit.tensors import TensorSpec
from scheduler_svc.settings import SchedulerSettings

TORCH_DTYPES = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.uint8,
    5: torch.int64,
}


class TensorReader(Protocol):
    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor: ...


class SharedMemoryReader:
    """Reads shared-memory slices and inline bytes, copying once into a fresh tensor."""

    def __init__(self, *, rank: int, prefix: str, max_bytes: int) -> None:
        self.rank = rank
        self.prefix = prefix
        self.max_bytes = max_bytes

    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        if spec.cuda is not None:
            # Straight from the exporter's GPU pool into this rank's device.
            like = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
            return spec.read_device(like).view(TORCH_DTYPES[spec.dtype]).reshape(spec.shape)
        raw = torch.empty(spec.nbytes, dtype=torch.uint8)
        out = memoryview(raw.numpy())  # type: ignore[arg-type]
        spec.read_into(out, prefix=self.prefix, max_bytes=self.max_bytes)
        return raw.view(TORCH_DTYPES[spec.dtype]).reshape(spec.shape)


def build_reader(settings: SchedulerSettings, rank: int) -> TensorReader:
    if not settings.tensor_reader:
        return SharedMemoryReader(rank=rank, prefix=settings.shm_prefix, max_bytes=settings.max_tensor_bytes)
    module_name, _, attr = settings.tensor_reader.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    reader: TensorReader = factory(rank=rank, prefix=settings.shm_prefix, max_bytes=settings.max_tensor_bytes)
    return reader
