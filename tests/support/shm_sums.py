"""Run by tests/scheduler/test_shm_allreduce.py in a fresh interpreter:
make an `Arena` for WORLD ranks, fork them (as rank 0 forks its ranks,
before any thread), let each run CASE, and print one JSON line with what
each rank saw.

    python -m tests.support.shm_sums WORLD CASE PORT
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from scheduler_svc.shm_allreduce import SLOT_BYTES, Arena

# Element counts: one, a decode step's hidden state, a batch's, more than a slot.
SIZES = (1, 512, 30 * 512, SLOT_BYTES // 4 + 1000)


def _inputs(rank: int, dtype: Any) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=generator).to(dtype) for n in SIZES]


def sums(arena: Arena, rank: int, world: int) -> dict[str, Any]:
    """Each size in float32 and bfloat16: equal to the sum in rank order, bit for bit."""
    import torch

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        mine = _inputs(rank, dtype)
        everyone = [_inputs(r, dtype) for r in range(world)]
        for i, tensor in enumerate(mine):
            arena.all_reduce_(tensor)
            expected = everyone[0][i] + everyone[1][i]
            for other in everyone[2:]:
                expected = expected + other[i]
            out[f"{dtype}-{SIZES[i]}"] = [bool(torch.equal(tensor, expected)), tensor.float().sum().item()]
    out["pieces"] = arena.sums
    return out


def late(arena: Arena, rank: int, world: int) -> dict[str, Any]:
    """Rank 1 never comes: rank 0's sum fails after its timeout, naming it."""
    import torch

    if rank == 1:
        return {}
    began = time.monotonic()
    try:
        arena.all_reduce_(torch.ones(4))
    except RuntimeError as exc:
        return {"error": str(exc), "waited": time.monotonic() - began}
    return {"error": ""}


def _join_gloo(rank: int, world: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def routed(arena: Arena, rank: int, world: int, port: int) -> dict[str, Any]:
    """`_TPDist`: a SUM of a contiguous CPU tensor goes through the arena;
    MAX, and a tensor that is not contiguous, go through gloo."""
    import torch
    import torch.distributed as dist

    from scheduler_svc.shm_allreduce import _TPDist

    _join_gloo(rank, world, port)
    try:
        routes = _TPDist(arena)
        out: dict[str, Any] = {}
        t = torch.full((8,), float(rank + 1))
        routes.all_reduce(t)
        out["sum"] = [t.tolist(), arena.sums]
        t = torch.full((8,), float(rank + 1))
        routes.all_reduce(t, op=dist.ReduceOp.MAX)
        out["max"] = [t.tolist(), arena.sums]
        t = torch.full((4, 2), float(rank + 1)).t()
        routes.all_reduce(t)
        out["strided"] = [t.reshape(-1).tolist(), arena.sums]
        out["world"] = routes.get_world_size()  # everything else is torch.distributed's
        return out
    finally:
        dist.destroy_process_group()


def aborted(arena: Arena, rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 1's "forward" fails before the second sum and aborts: rank 0,
    waiting in that sum, raises SumAborted at once; both meet in a gloo
    collective (the engine's agreement), resync, and sum right again."""
    import torch
    import torch.distributed as dist

    from scheduler_svc.shm_allreduce import SumAborted

    _join_gloo(rank, world, port)
    try:
        out: dict[str, Any] = {}
        t = torch.full((4,), float(rank + 1))
        arena.all_reduce_(t)
        out["first"] = t.tolist()
        began = time.monotonic()
        if rank == 1:
            arena.abort()
        else:
            try:
                arena.all_reduce_(torch.ones(4))
                out["second"] = "summed"
            except SumAborted:
                out["second"] = "aborted"
        out["waited"] = time.monotonic() - began
        sums = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sums, torch.tensor([arena.sums]))
        arena.resync([int(s) for s in sums])
        for _ in range(3):
            t = torch.full((4,), float(rank + 1))
            arena.all_reduce_(t)
        out["after"] = t.tolist()
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    world, case, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    # Imported once, before the fork, as the scheduler's ranks are forked
    # from a process that imported torch and runs no thread yet (each rank
    # importing it again cost ~2 s of CPU).
    import torch
    import torch.distributed  # noqa: F401

    arena = Arena(world)
    reads = []
    pids = []
    for rank in range(world):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                arena.attach(rank, 1.0 if case == "late" else 30.0)
                if case in ("routed", "aborted"):
                    result = {"routed": routed, "aborted": aborted}[case](arena, rank, world, port)
                else:
                    result = {"sums": sums, "late": late}[case](arena, rank, world)
            except BaseException:
                result, code = {"exception": traceback.format_exc()}, 1
            os.write(w, json.dumps(result).encode())
            os._exit(code)
        os.close(w)
        reads.append(r)
        pids.append(pid)
    results = []
    for r, pid in zip(reads, pids, strict=True):
        with os.fdopen(r) as f:
            results.append(json.loads(f.read() or "{}"))
        os.waitpid(pid, 0)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
