"""The only place that calls torch.distributed. `Collective` is the small
interface the step needs; `TorchCollective` implements it over a process group
and tests substitute a fake for the agreement logic."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Collective(Protocol):
    rank: int
    world_size: int

    def broadcast_from_0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        """Stack every rank's 1-D int64 `row` (same length everywhere) into [world, n]."""

    def gather_to_0(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""


class TorchCollective:
    def __init__(self, device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device

    def broadcast_from_0(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        row = row.to(self.device)
        out = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(out, row)
        return torch.stack(out).cpu()

    def gather_to_0(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def pick_device(setting: str) -> torch.device:
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_group(
    *, rank: int, world_size: int, master_addr: str, master_port: int, device: str, timeout_s: float
) -> None:
    """Join the group. gloo on CPU, NCCL on CUDA; `env://`-style rendezvous."""
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    log.info("rank %d/%d joined the %s group at %s:%s", rank, world_size, backend, master_addr, master_port)
