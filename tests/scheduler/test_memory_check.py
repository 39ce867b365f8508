"""`ranks.memory_shortfall`: a scheduler whose KV budget and caches may
outgrow its device says so at start, naming the flags to lower; and
`server.budget_shortfall`: one whose KV budget cannot hold the model's
context says so too, naming the flag to raise."""

from __future__ import annotations

from pathlib import Path

from scheduler_svc.model import ModelInfo
from scheduler_svc.ranks import memory_shortfall
from scheduler_svc.settings import SchedulerSettings

GIB = 2**30


def info() -> ModelInfo:
    return ModelInfo(
        name="m", vocab_size=1000, num_layers=4, kv_heads=8, head_dim=64, max_context=4096,
        eos_token_ids=frozenset(), family=None,  # type: ignore[arg-type]
    )  # fmt: skip


def settings(**kw: object) -> SchedulerSettings:
    return SchedulerSettings(model_dir=Path("unused"), **kw)  # type: ignore[arg-type]


def test_budgets_that_fit_say_nothing() -> None:
    s = settings(kv_cache_bytes=4 * GIB, prefix_cache_bytes=GIB, encoder_cache_bytes=GIB // 4)
    assert memory_shortfall(s, info(), 2, free_bytes=6 * GIB) == ""


def test_budgets_over_the_free_memory_name_each_flag_and_the_sum() -> None:
    s = settings(kv_cache_bytes=4 * GIB, prefix_cache_bytes=GIB, encoder_cache_bytes=GIB // 4)
    said = memory_shortfall(s, info(), 2, free_bytes=5 * GIB)
    assert "--kv-cache-bytes 4.00 GiB + --prefix-cache-bytes 1.00 GiB + --encoder-cache-bytes 0.25 GiB" in said
    assert "= 5.25 GiB" in said
    assert "5.00 GiB free" in said
    assert "OVERLOADED" in said


def test_a_budget_in_tokens_counts_as_the_bytes_it_takes() -> None:
    per_token = info().kv_bytes_per_token(tp=2, itemsize=2)  # 4 layers x 2 x 4 heads x 64 x 2 bytes = 4 KiB
    tokens = 2 * GIB // per_token
    s = settings(kv_budget_tokens=tokens, tp=2, prefix_cache_bytes=0, encoder_cache_bytes=0)
    assert memory_shortfall(s, info(), 2, free_bytes=2 * GIB) == ""
    said = memory_shortfall(s, info(), 2, free_bytes=GIB)
    assert said.startswith("--kv-budget-tokens 2.00 GiB = 2.00 GiB"), said


def test_a_kv_budget_below_the_context_is_said_at_start_with_the_setting_to_raise() -> None:
    from scheduler_svc.server import budget_shortfall, kv_budget

    small = settings(kv_cache_bytes=100_000)  # 4 layers x 2 x 8 heads x 64 x 2 bytes = 8 KiB a token: 12 tokens
    budget = kv_budget(small, info(), 2)
    assert budget == 12
    said = budget_shortfall(small, budget, info().max_context)
    assert said == (
        "the KV budget (12 tokens) is less than the model's context (4096): every request whose prompt and "
        "max_tokens need more is refused (INVALID_REQUEST); raise --kv-cache-bytes to serve the whole context"
    )
    assert "raise --kv-budget-tokens" in budget_shortfall(settings(kv_budget_tokens=100), 100, 4096)
    assert budget_shortfall(settings(), kv_budget(settings(), info(), 2), info().max_context) == ""
