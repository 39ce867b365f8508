"""The only place that calls torch.distributed. `Collective` is the small
interface the step needs; `TorchCollective` implements it over a process group
and tests substitute a fake for the agreement logic."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scheduler_svc.counted_sums import CountedSums
from scheduler_svc.rendezvous import Rendezvous, take_listener
from scheduler_svc.shm_allreduce import Arena

log = logging.getLogger(__name__)

# A step's plan fits one broadcast of this many bytes unless it carries
# inline pixel tensors (then a second broadcast moves the rest).
PLAN_BUFFER_BYTES = 64 * 1024


class Collective(Protocol):
    rank: int
    world_size: int

    def broadcast_from_0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        """Stack every rank's 1-D int64 `row` (same length everywhere) into [world, n]."""

    def gather_to_0(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""

    def gather_columns_to_0(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Every rank's 2-D `part` (``[rows, widths[rank]]``, the same rows
        everywhere) side by side in rank order on rank 0 (None elsewhere)."""


class TorchCollective:
    def __init__(self, device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
        # Where the model's TP sums go when not through the group (`scheduler_svc.shm_allreduce`).
        self.arena: Arena | None = None
        # Else the group's sums, counted (`scheduler_svc.counted_sums`).
        self.sums: CountedSums | None = None

    # A group of one has nobody to talk to: its collectives are identities
    # (no pickling, no tensor round trip on the step's hot path).
    def broadcast_from_0(self, obj: Any) -> Any:
        """One broadcast of a fixed-size buffer when the pickled object fits
        it (every decode step's plan does), a second for the rest when not
        (plans carrying inline pixels). `broadcast_object_list` always costs
        two: the sizes, then the bytes."""
        if self.world_size == 1:
            return obj
        head = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8)
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            first = data[: PLAN_BUFFER_BYTES - 8]
            head[: 8 + len(first)] = torch.frombuffer(
                bytearray(len(data).to_bytes(8, "little") + first), dtype=torch.uint8
            )
        head = head.to(self.device)
        dist.broadcast(head, src=0)
        if self.rank == 0:
            if len(data) > PLAN_BUFFER_BYTES - 8:
                dist.broadcast(
                    torch.frombuffer(bytearray(data[PLAN_BUFFER_BYTES - 8 :]), dtype=torch.uint8).to(self.device), src=0
                )
            return obj
        received = head.cpu().numpy().tobytes()
        size = int.from_bytes(received[:8], "little")
        data = received[8 : 8 + min(size, PLAN_BUFFER_BYTES - 8)]
        if size > PLAN_BUFFER_BYTES - 8:
            rest = torch.empty(size - (PLAN_BUFFER_BYTES - 8), dtype=torch.uint8, device=self.device)
            dist.broadcast(rest, src=0)
            data += rest.cpu().numpy().tobytes()
        # Rank 0 is this group's own process: its plans are trusted like its code.
        return pickle.loads(data)

    def all_gather_row(self, row: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return row[None]
        row = row.to(self.device)
        out = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(out, row)
        return torch.stack(out).cpu()

    def gather_columns_to_0(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        if self.world_size == 1:
            return part
        # gather takes equal shapes: every part padded to the widest.
        widest = max(widths)
        if part.shape[1] < widest:
            part = torch.nn.functional.pad(part, (0, widest - part.shape[1]))
        part = part.contiguous()
        if self.rank != 0:
            dist.gather(part, None, dst=0)
            return None
        parts = [torch.empty_like(part) for _ in range(self.world_size)]
        dist.gather(part, parts, dst=0)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def gather_to_0(self, obj: Any) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def _uses_cuda(setting: str) -> bool:
    return setting == "cuda" or (setting == "auto" and torch.cuda.is_available())


def model_device(setting: str) -> torch.device:
    """The kind of device `setting` puts the model on (no index: any process may ask)."""
    return torch.device("cuda" if _uses_cuda(setting) else "cpu")


def cuda_problem(setting: str, tp: int, *, local: bool) -> str:
    """What keeps `--device` from running the group on CUDA here (empty
    when nothing does, or when it runs on the CPU): no GPU visible to this
    process, or a local group with more ranks than visible GPUs (NCCL
    refuses two ranks on one GPU). Call only where CUDA may be used (the
    ranks are spawned, never forks of this process)."""
    if not _uses_cuda(setting):
        return ""
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"--device cuda: this process sees no CUDA device ({shown}; torch {torch.__version__}, {built}): "
            "give it a GPU, or use --device cpu"
        )
    if local and tp > count:
        return (
            f"--tp {tp}: a group on CUDA takes one GPU a rank (NCCL refuses two ranks on one GPU), and this "
            f"process sees {count}: use --tp {count} or fewer here, or --launch env with a GPU per pod"
        )
    return ""


def pick_device(setting: str) -> torch.device:
    """This rank's device; call after `init_group`."""
    if not _uses_cuda(setting):
        return torch.device("cpu")
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())


# Rank 0's listening socket of a local group's store: it lives as long as the process.
_store_listener: list[socket.socket] = []


def _local_store(rendezvous: Rendezvous, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store of a group on this host. Rank 0 binds its socket to the
    rendezvous address (loopback) and hands it to the store: torch's own
    store listens on every address of the host, where anyone who can reach
    the port could write into the group's rendezvous (it has no
    authentication)."""
    if rendezvous.rank != 0:
        return dist.TCPStore(rendezvous.addr, rendezvous.port, rendezvous.world_size, False, timeout)
    listener = take_listener(rendezvous)  # bound when its port was chosen (`local_rendezvous`)
    if listener is None:
        listener = socket.socket(socket.AF_INET6 if ":" in rendezvous.addr else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((rendezvous.addr, rendezvous.port))
        listener.listen(max(64, rendezvous.world_size))
    _store_listener.append(listener)
    return dist.TCPStore(
        rendezvous.addr, rendezvous.port, rendezvous.world_size, True, timeout, master_listen_fd=listener.fileno()
    )


def init_group(*, rendezvous: Rendezvous | None, device: str, timeout_s: float, startup_timeout_s: float) -> None:
    """Join the group: gloo on CPU, NCCL on CUDA. With `rendezvous` (local
    launch) over TCP at its address; without it through torch's ``env://``
    (torch itself reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Two timeouts: ranks may take minutes to start (imports, a busy node), so
    the rendezvous waits `startup_timeout_s`; collectives afterwards fail
    after `timeout_s` instead of hanging."""
    use_cuda = _uses_cuda(device)
    backend = "nccl" if use_cuda else "gloo"
    startup = datetime.timedelta(seconds=startup_timeout_s)
    if rendezvous is None:
        store, rank, world = next(dist.rendezvous("env://", -1, -1, timeout=startup))
    else:
        store, rank, world = _local_store(rendezvous, startup), rendezvous.rank, rendezvous.world_size
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    if use_cuda:
        # The device first (NCCL binds its communicator to the current one),
        # and NCCL's watchdog turns a collective past the timeout into an
        # error that ends the process, never a hang (torch's default too;
        # stated here so an environment cannot quietly turn it off).
        torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    log.info("rank %d/%d joined the %s group", dist.get_rank(), dist.get_world_size(), backend)
