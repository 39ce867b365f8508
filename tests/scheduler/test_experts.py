"""`scheduler_svc.experts`: Qwen3-VL-MoE's fused experts split over TP
ranks. Each rank's MoE block makes a partial output that its hook sums over
the group; the ranks' partial outputs add up to the whole block's. (The
served model's tokens at TP=2 are checked against `generate` in
tests/e2e/test_moe.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers.distributed import tensor_parallel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from scheduler_svc import experts


class Recorded:
    """`torch.distributed` as the hook sees it in one process: each sum
    is recorded (its tensor and group) and left as this rank's part."""

    def __init__(self) -> None:
        self.sums: list[tuple[torch.Tensor, Any]] = []

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        self.sums.append((tensor, group))


def moe_block(intermediate: int) -> torch.nn.Module:
    config = Qwen3VLMoeTextConfig(
        hidden_size=32, moe_intermediate_size=intermediate, num_experts=4, num_experts_per_tok=2, hidden_act="silu"
    )
    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return block.eval()


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_partial_outputs_add_up_to_the_whole_block_s(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = moe_block(intermediate=16)
    hidden = torch.randn(3, 5, 32)
    with torch.no_grad():
        expected = whole(hidden)
    recorded = Recorded()
    monkeypatch.setattr(tensor_parallel, "dist", recorded)

    parts = []
    for rank in range(world):
        block = copy.deepcopy(whole)
        found = experts.fused_experts(block)
        assert [b for b, _ in found] == [block]
        assert experts.split_blocks(found, rank, world, group="tp") == 1
        assert block.experts.gate_up_proj.shape == (4, 2 * 16 // world, 32)
        assert block.experts.down_proj.shape == (4, 32, 16 // world)
        with torch.no_grad():
            parts.append(block(hidden))
    # One sum per block forward, over the TP group, of the block's output itself.
    assert [(tuple(t.shape), group) for t, group in recorded.sums] == [((3, 5, 32), "tp")] * world
    assert all(t is part for (t, _), part in zip(recorded.sums, parts, strict=True))
    torch.testing.assert_close(sum(parts), expected, rtol=1e-5, atol=1e-5)
    # A rank alone is not the whole: the sum is needed.
    assert not torch.allclose(parts[0], expected, atol=1e-3)


def test_experts_that_do_not_divide_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    block = moe_block(intermediate=10)
    gate_up, down = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
    recorded = Recorded()
    monkeypatch.setattr(tensor_parallel, "dist", recorded)
    assert experts.split_blocks(experts.fused_experts(block), 0, 4, group=None) == 0
    assert torch.equal(block.experts.gate_up_proj, gate_up)
    assert torch.equal(block.experts.down_proj, down)
    with torch.no_grad():
        block(torch.randn(1, 2, 32))
    assert recorded.sums == [], "a block kept whole is not summed"


def test_only_fused_experts_are_found() -> None:
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert experts.fused_experts(dense) == []
    block = moe_block(intermediate=8)
    block.experts.down_proj = torch.nn.Parameter(torch.zeros(4, 32, 6))  # not the gate_up's I
    assert experts.fused_experts(block) == []
