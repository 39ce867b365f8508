"""Rank 0's sampler: greedy and seeded rows, the processors, min_tokens, and
one row's failure staying that row's."""

from __future__ import annotations

import pytest
import torch

from mmsplit_server.sampling import Sampling
from scheduler_svc.sampler import RowSampling, Sampler, make_generator, row_argmax

EOS = 3
CPU = torch.device("cpu")


def row(params: Sampling, *, seed: int = 1, generated: int = 0, rid: str = "r") -> RowSampling:
    return RowSampling(rid, params, generated, make_generator(params, seed, CPU))


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    x = logits(4)
    out = Sampler(frozenset([EOS])).sample(x, [row(Sampling(max_tokens=8)) for _ in range(4)])
    assert out == x.argmax(dim=1).tolist()


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    sampler = Sampler(frozenset([EOS]))
    params = Sampling(max_tokens=8, temperature=1.3, top_p=0.95, top_k=20)
    target = logits(1, seed=9)[0]

    def draws(others: int) -> list[int]:
        mine = row(params, seed=42)
        crowd = [row(Sampling(max_tokens=8, temperature=0.9), seed=s, rid=f"o{s}") for s in range(others)]
        tokens = []
        for step in range(12):
            batch = torch.cat([logits(others, seed=100 + step), target[None]]) if others else target[None]
            tokens.append(sampler.sample(batch, [*crowd, mine])[-1])
        return tokens  # type: ignore[return-value]

    alone = draws(0)
    assert draws(5) == alone
    assert draws(17) == alone
    assert len(set(alone)) > 1, "temperature 1.3 should not always draw the same token"


def test_top_k_1_and_a_tiny_top_p_are_greedy() -> None:
    x = logits(6)
    greedy = x.argmax(dim=1).tolist()
    sampler = Sampler(frozenset())
    assert sampler.sample(x, [row(Sampling(max_tokens=4, temperature=5.0, top_k=1)) for _ in range(6)]) == greedy
    assert sampler.sample(x, [row(Sampling(max_tokens=4, temperature=5.0, top_p=1e-6)) for _ in range(6)]) == greedy


def test_top_k_keeps_only_the_k_most_likely() -> None:
    x = logits(1)
    allowed = set(x[0].topk(3).indices.tolist())
    r = row(Sampling(max_tokens=4, temperature=50.0, top_k=3))
    drawn = {Sampler(frozenset()).sample(x, [r])[0] for _ in range(200)}
    assert drawn <= allowed
    assert len(drawn) > 1


def test_the_tiniest_temperature_is_finite_and_greedy() -> None:
    # Before the fix, logits / 1e-39 overflowed to inf and multinomial raised.
    x = logits(3)
    params = Sampling(max_tokens=4, temperature=1e-39)
    assert Sampler(frozenset()).sample(x, [row(params) for _ in range(3)]) == x.argmax(dim=1).tolist()


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    x = torch.zeros(2, 10)
    x[:, EOS] = 10.0
    x[:, 7] = 9.0
    x[:, 5] = 8.0
    params = Sampling(max_tokens=8, min_tokens=2, stop_token_ids=(7,))
    sampler = Sampler(frozenset([EOS]))
    early = sampler.sample(x.clone(), [row(params, generated=0), row(params, generated=1)])
    assert early == [5, 5]
    late = sampler.sample(x.clone(), [row(params, generated=2), row(Sampling(max_tokens=8), generated=0)])
    assert late == [EOS, EOS]


def test_a_row_with_non_finite_logits_fails_alone() -> None:
    x = logits(3)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    rows = [row(Sampling(max_tokens=4)), row(Sampling(max_tokens=4, temperature=0.5)), row(Sampling(max_tokens=4))]
    out = Sampler(frozenset()).sample(x, rows)
    assert out[0] == int(x[0].argmax())
    assert isinstance(out[1], str)
    assert "non-finite" in out[1]
    assert isinstance(out[2], str)
    assert "non-finite" in out[2]


def test_a_row_whose_sampling_raises_fails_alone() -> None:
    x = logits(2)
    broken = RowSampling("bad", Sampling(max_tokens=4, temperature=0.7), 0, generator="not a generator")  # type: ignore[arg-type]
    out = Sampler(frozenset()).sample(x, [broken, row(Sampling(max_tokens=4))])
    assert isinstance(out[0], str)
    assert out[0].startswith("sampling failed")
    assert out[1] == int(x[1].argmax())


def test_logits_and_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        Sampler(frozenset()).sample(logits(2), [row(Sampling(max_tokens=1))])


@pytest.mark.parametrize("vocab", [32000, 32001, 32064, 151936, 1024, 1000, 600, 96, 50, 32])
def test_row_argmax_is_torch_argmax_with_ties_nan_and_infinities(vocab: int) -> None:
    """The blocked reduction against torch's own, on logits full of ties
    (small integers), NaN, +inf and -inf in random places, every row kind:
    the same index (the first maximum, or the first NaN) and value."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        x = torch.randint(-3, 4, (9, vocab), generator=gen).float()
        if trial % 2:
            x = torch.randn(9, vocab, generator=gen)
        specials = {1: float("nan"), 2: float("inf"), 3: float("-inf"), 4: float("nan")}
        for r, value in specials.items():
            cols = torch.randint(0, vocab, (3,), generator=gen)
            x[r, cols] = value
        x[5] = float("-inf")  # a row of -inf only
        x[6, -1] = 100.0  # the maximum in the last column
        x[7, 0] = 100.0  # the maximum in the first
        x[8, -1], x[8, vocab // 2] = 50.0, 50.0  # a tie between a block and the last column
        if trial % 4 == 0:
            x[0, -1] = float("nan")  # the only NaN, in the last column
        top, index = row_argmax(x)
        assert index.tolist() == x.argmax(dim=1).tolist()
        want = x.gather(1, x.argmax(dim=1, keepdim=True))[:, 0]
        assert torch.equal(top.isnan(), want.isnan())
        assert torch.equal(top[~want.isnan()], want[~want.isnan()])


def test_min_tokens_bans_each_row_s_own_stop_ids() -> None:
    """Rows with different stop ids in one batch: each row's own are banned
    (and EOS for all), and a row past min_tokens bans nothing."""
    x = torch.zeros(3, 10)
    x[:, EOS], x[:, 7], x[:, 6], x[:, 5] = 10.0, 9.0, 8.5, 8.0
    rows = [
        row(Sampling(max_tokens=8, min_tokens=2, stop_token_ids=(7,)), generated=0),
        row(Sampling(max_tokens=8, min_tokens=2, stop_token_ids=(6,)), generated=0),
        row(Sampling(max_tokens=8, min_tokens=2, stop_token_ids=(7,)), generated=2),
    ]
    assert Sampler(frozenset([EOS])).sample(x, rows) == [6, 7, EOS]
