"""A mixture-of-experts model's experts split over a TP group's ranks, after
loading.

Qwen3-VL-MoE keeps each layer's experts as two fused weights,
``gate_up_proj [experts, 2 x I, hidden]`` (the gate's I rows, then the up
projection's) and ``down_proj [experts, hidden, I]``. transformers (5.23)
cannot load them split: its loader cuts ``down_proj`` along the checkpoint's
layout, which is the transpose of the model's (a size mismatch). So the
family loads them whole on every rank (`Family.tp_plan_overrides`:
transformers' ``replicate``), where every rank computed every expert for
every token: a TP group's MoE layers ran no faster than one process and
each rank kept every expert, most of such a model.

`split` then keeps, on rank r of n, each expert's intermediate units
r*I/n .. (r+1)*I/n: those rows of the gate half and of the up half of
``gate_up_proj``, and those columns of ``down_proj``; the rest is freed.
An expert's output is ``down @ (act(gate @ x) * (up @ x))``, a sum over
its intermediate units, so a rank's share of it is a partial sum, and so
is the MoE block's output (the routing weights and the sum over experts
are linear). Each MoE block's output is then summed over the group in
place: one more all-reduce per MoE layer, made through transformers' TP
module (`transformers.distributed.tensor_parallel.dist`, looked up at each
sum), so that the shared-memory sums and the engine's counted sums
(`scheduler_svc.shm_allreduce`, `scheduler_svc.counted_sums`) see it as
any other of the model's sums, of the same ``[rows, tokens, hidden]`` shape.
The router stays whole on every rank, so every rank picks the same experts
for a token. The tokens are those of the whole experts up to the order of
floating-point sums.

Loading still holds every expert on every rank for a moment (the peak
memory of a load is unchanged); the split frees all but 1/n of them after.
On a CPU host the whole experts were pages of the checkpoint's file shared
by the ranks, so there the split costs memory (the experts once more, as
the ranks' private shares) and buys speed (docs/media-and-models.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor, where transformers made one
    return to_local() if callable(to_local) else t


def fused_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(MoE block, its experts) for every block of `model` whose experts
    are fused as above: the block has `experts` and a router `gate`, the
    experts have 3-D `gate_up_proj` and `down_proj` and no biases."""
    found: list[tuple[torch.nn.Module, Any]] = []
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, torch.nn.Module) or not hasattr(block, "gate"):
            continue
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            continue
        if gate_up.dim() != 3 or down.dim() != 3 or getattr(experts, "has_bias", False):
            continue
        gate_up, down = _local(gate_up), _local(down)
        if gate_up.shape[:2] != (down.shape[0], 2 * down.shape[2]) or gate_up.shape[2] != down.shape[1]:
            continue  # not [experts, 2 x I, hidden] and [experts, hidden, I]
        found.append((block, experts))
    return found


def tp_group(model: torch.nn.Module) -> Any:
    """The process group transformers' TP layers of `model` sum over (its
    device mesh's "tp" dimension); None (the default group) without one."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    return mesh.get_group("tp") if mesh.ndim > 1 else mesh.get_group()


def split(model: torch.nn.Module) -> int:
    """Keep this rank's share of every fused expert of `model` (loaded
    whole on every rank of its TP group) and sum each MoE block's output
    over that group; the number of blocks split. None is split (every rank
    keeps its experts whole, and the model works as before) where the
    experts' intermediate size does not divide by the group's size: every
    rank makes the same choice."""
    import torch.distributed as dist

    group = tp_group(model)
    return split_blocks(fused_experts(model), dist.get_rank(group), dist.get_world_size(group), group)


def split_blocks(blocks: list[tuple[torch.nn.Module, Any]], rank: int, world: int, group: Any) -> int:
    """`split`'s work on the (block, experts) pairs `fused_experts` found,
    as rank `rank` of `world`, summing over `group`."""
    if world <= 1 or not blocks:
        return 0
    sizes = {_local(experts.down_proj).shape[-1] for _, experts in blocks}
    if any(size % world for size in sizes):
        log.warning("experts kept whole on every rank: intermediate sizes %s do not divide by %d", sorted(sizes), world)
        return 0
    for block, experts in blocks:
        gate_up, down = _local(experts.gate_up_proj.data), _local(experts.down_proj.data)
        inter = down.shape[-1]
        share = inter // world
        mine = slice(rank * share, (rank + 1) * share)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        experts.gate_up_proj = torch.nn.Parameter(
            torch.cat((gate[:, mine], up[:, mine]), dim=1).contiguous(), requires_grad=False
        )
        experts.down_proj = torch.nn.Parameter(down[:, :, mine].contiguous(), requires_grad=False)
        if hasattr(experts, "intermediate_dim"):
            experts.intermediate_dim = share
        block.register_forward_hook(_summed(group))
    if any(experts.down_proj.is_cuda for _, experts in blocks):
        torch.cuda.empty_cache()  # what was let go, back to the device (the memory check after the load reads it)
    log.info("rank %d: the experts of %d MoE layers split over %d ranks", rank, len(blocks), world)
    return len(blocks)


def _summed(group: Any) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        from transformers.distributed import tensor_parallel

        summed = output.contiguous()  # summed in place: the output itself, as it is contiguous already
        tensor_parallel.dist.all_reduce(summed, group=group)
        return summed

    return hook
