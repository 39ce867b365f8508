"""Rank 0's sampler: greedy and seeded rows, the processors, min_tokens,
logit_bias and the penalties, and one row's failure staying that row's."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from mmsplit.errors import E
from mmsplit_server.sampling import Sampling
from scheduler_svc.sampler import Bans, LogitAdjust, NothingToDraw, RowSampling, Sampler, make_generator, row_argmax
from tests.support import hf_loaded

EOS = 3
CPU = torch.device("cpu")


def row(
    params: Sampling,
    *,
    seed: int = 1,
    generated: int = 0,
    rid: str = "r",
    prompt: tuple[int, ...] = (),
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> RowSampling:
    adjust = LogitAdjust(params, prompt) if params.adjusts_logits else None
    bans = Bans(params.allowed_token_ids, bad_words) if params.allowed_token_ids or bad_words else None
    return RowSampling(rid, params, generated, make_generator(params, seed, CPU), adjust, bans=bans)


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


def test_min_p_keeps_only_tokens_near_the_likeliest_and_logprobs_are_of_what_is_kept() -> None:
    """min_p 0.2 at temperature 1: a token stays only while its probability
    is at least a fifth of the likeliest's (here: probabilities 0.4, 0.3,
    0.1, 0.07 and the rest far smaller: the first two and the third stay,
    0.07 < 0.08 goes); the log probabilities are the kept tokens'
    renormalized."""
    probs = torch.tensor([0.4, 0.3, 0.1, 0.07] + [0.13 / 46] * 46)
    x = probs.log()[None]
    r = row(Sampling(max_tokens=4, temperature=1.0, min_p=0.2, logprobs=True))
    sampler = Sampler(frozenset())
    drawn: set[int] = set()
    for _ in range(300):
        tokens, lps = sampler.sample_rows(x, [r])
        drawn.add(int(tokens[0]))  # type: ignore[arg-type]
        kept = probs[:3] / probs[:3].sum()
        assert lps[0].logprob == pytest.approx(float(kept[int(tokens[0])].log()), abs=1e-4)  # type: ignore[index]
    assert drawn == {0, 1, 2}
    # min_p 1: only the likeliest.
    assert sampler.sample(x, [row(Sampling(max_tokens=4, temperature=5.0, min_p=1.0))]) == [0]


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


def test_penalties_and_bias_follow_their_definitions_over_a_generation() -> None:
    """Each step's greedy token is the argmax of a reference computed here
    from the definitions (transformers' repetition penalty over prompt and
    output, OpenAI's frequency and presence over the output, the bias added
    first), for each knob alone and all together, beside a row with none."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt = (4, 9, 9, 17)
    cases = [
        Sampling(max_tokens=20, repetition_penalty=1.7),
        Sampling(max_tokens=20, repetition_penalty=0.6),
        Sampling(max_tokens=20, frequency_penalty=1.5),
        Sampling(max_tokens=20, presence_penalty=-1.0),
        Sampling(max_tokens=20, logit_bias=((4, 3.0), (11, -2.5))),
        Sampling(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.8,
                 logit_bias=((2, 1.0),)),
    ]  # fmt: skip
    sampler = Sampler(frozenset())
    for params in cases:
        rows = [row(params, prompt=prompt), row(Sampling(max_tokens=20), rid="plain")]
        out: list[int] = []
        changed = False
        for step in range(20):
            x = logits(2, vocab=24, seed=step) / 3  # a small vocabulary: tokens come back
            expected = x[0].clone()
            for token, bias in params.logit_bias:
                expected[token] += bias
            if params.repetition_penalty != 1.0:
                seen = torch.tensor([list(prompt) + out])
                expected = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, expected[None])[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=24).float()
            expected -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
            got = sampler.sample(x.clone(), rows)
            assert got == [int(expected.argmax()), int(x[1].argmax())], (params, step)
            changed |= got[0] != int(x[0].argmax())
            for r, token in zip(rows, got, strict=True):
                r.took(token)  # type: ignore[arg-type]
            out.append(got[0])  # type: ignore[arg-type]
        assert changed, ("the knob never changed a token: the case proves nothing", params)


def test_a_strong_bias_decides_greedy_and_sampled_rows_and_logprobs_see_it() -> None:
    x = logits(2, vocab=40)
    params = [Sampling(max_tokens=4, logit_bias=((7, 100.0),), logprobs=True),
              Sampling(max_tokens=4, temperature=1.0, logit_bias=((7, 100.0),), logprobs=True)]  # fmt: skip
    rows = [row(p) for p in params]
    tokens, logprobs = Sampler(frozenset()).sample_rows(x, rows)
    assert tokens == [7, 7]
    assert logprobs[0].logprob == pytest.approx(0.0, abs=1e-6)
    banned = [Sampling(max_tokens=4, temperature=2.0, logit_bias=tuple((t, -100.0) for t in range(39)))]
    assert Sampler(frozenset()).sample(logits(1, vocab=40), [row(banned[0])]) == [39]


def test_a_row_whose_adjusting_raises_fails_alone() -> None:
    """The rows are adjusted at once; when that raises, row by row: the
    others get their own adjusted tokens, once."""
    x = logits(3)
    bad = row(Sampling(max_tokens=4, frequency_penalty=1.0))
    bad.took(10**9)  # a token no vocabulary holds: gathering its logit raises
    biased = row(Sampling(max_tokens=4, logit_bias=((5, 2.0),), logprobs=True))
    out, logprobs = Sampler(frozenset()).sample_rows(x.clone(), [bad, row(Sampling(max_tokens=4)), biased])
    assert isinstance(out[0], str)
    assert out[0].startswith("applying logit_bias or a penalty failed")
    assert out[1] == int(x[1].argmax())
    once = x[2].clone()
    once[5] += 2.0
    assert out[2] == int(once.argmax())
    assert logprobs[2].logprob == pytest.approx(float(torch.log_softmax(once, 0)[out[2]]), abs=1e-5)


def test_a_long_prompt_s_ids_are_all_penalized() -> None:
    """Hundreds of entries (the arrays grow as ids come): the distribution
    is transformers' repetition penalty over every one of them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt = tuple(range(0, 900, 3))
    params = Sampling(max_tokens=8, repetition_penalty=1.5, logprobs=True, top_logprobs=20)
    r = row(params, prompt=prompt)
    x = logits(1, vocab=1000) / 3
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt]), x.clone())[0]
    out, logprobs = Sampler(frozenset()).sample_rows(x.clone(), [r])
    assert out == [int(expected.argmax())]
    top = torch.log_softmax(expected, 0).topk(20)
    assert logprobs[0].top_ids == tuple(top.indices.tolist())
    assert list(logprobs[0].top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-5)


def test_structured_output_draws_only_what_keeps_the_document_in_its_schema(tiny_model: Path) -> None:
    """Sampled rows under a JSON Schema (random logits, so any token would
    come without it): each ends with EOS on a document of the schema, and
    the unconstrained row beside them gets its own argmax every step."""
    import json

    from mmsplit.checks import SCHEMA  # the conformance kits' schema
    from mmsplit_server.structured import Grammars

    eos = hf_loaded.tokenizer(tiny_model).eos_token_id
    grammars = Grammars(tiny_model, frozenset([eos]))
    tokenizer = hf_loaded.tokenizer(tiny_model)
    sampler = Sampler(frozenset([eos]))
    for seed in range(3):
        structure = ("json_schema", json.dumps(SCHEMA))
        params = Sampling(max_tokens=64, temperature=1.0, structure=structure)
        constrained = RowSampling(
            "s", params, 0, make_generator(params, seed, CPU), constraint=grammars.constraint(structure)
        )
        plain = row(Sampling(max_tokens=64), rid="plain")
        out: list[int] = []
        for step in range(64):
            x = logits(2, vocab=32064, seed=1000 * seed + step)
            got = sampler.sample(x.clone(), [constrained, plain])
            assert got[1] == int(x[1].argmax())
            token = got[0]
            assert isinstance(token, int), token
            constrained.took(token)
            out.append(token)
            if token == eos:
                break
        assert out[-1] == eos, tokenizer.decode(out)
        document = json.loads(tokenizer.decode(out[:-1]))
        assert document["color"] in ("red", "blue")
        assert isinstance(document["ok"], bool)


def test_a_row_whose_constraint_could_not_be_made_fails_alone() -> None:
    from mmsplit_server.structured import Broken

    x = logits(2)
    broken = RowSampling("b", Sampling(max_tokens=4), 0, None, constraint=Broken("no grammar"))
    out = Sampler(frozenset()).sample(x, [broken, row(Sampling(max_tokens=4))])
    assert out[0] == "structured output failed: no grammar"
    assert out[1] == int(x[1].argmax())


def test_allowed_token_ids_leave_only_those_to_draw_and_logprobs_are_of_them() -> None:
    """Greedy and sampled rows draw only listed ids, whatever the other rows
    allow; a greedy row's log probabilities are over the allowed ids alone;
    a row with no list is untouched."""
    sampler = Sampler(frozenset([EOS]))
    allowed = (4, 9, 31)
    greedy = row(Sampling(max_tokens=64, allowed_token_ids=allowed, logprobs=True, top_logprobs=5))
    sampled = row(
        Sampling(max_tokens=64, temperature=2.0, allowed_token_ids=(1, 2), logprobs=True, top_logprobs=5),
        seed=7,
        rid="s",
    )
    free = row(Sampling(max_tokens=64), rid="f")
    seen: set[int] = set()
    for step in range(40):
        x = logits(3, seed=step)
        out, logprobs = sampler.sample_rows(x.clone(), [greedy, sampled, free])
        assert out[0] == max(allowed, key=lambda t: float(x[0, t]))
        assert out[1] in (1, 2)
        seen.add(out[1])  # type: ignore[arg-type]
        assert out[2] == int(x[2].argmax())
        # As many alternatives as asked: the drawable ones first, then banned ones at -inf.
        for lp, drawable in ((logprobs[0], set(allowed)), (logprobs[1], {1, 2})):
            assert len(lp.top_ids) == 5
            assert set(lp.top_ids[: len(drawable)]) == drawable
            assert all(math.isfinite(v) for v in lp.top_logprobs[: len(drawable)])
            assert all(v == float("-inf") for v in lp.top_logprobs[len(drawable) :])
        expected = torch.log_softmax(x[0, list(allowed)], dim=0)
        assert logprobs[0].logprob == pytest.approx(float(expected.max()), abs=1e-5)
        for r, token in zip((greedy, sampled, free), out, strict=True):
            r.took(token)  # type: ignore[arg-type]
    assert seen == {1, 2}, "temperature 2 over two allowed ids should draw both"


def test_bad_words_ban_a_word_s_last_token_only_after_its_earlier_ones() -> None:
    """A one-token bad word is never drawn; a longer one's last token is
    banned exactly where the generated tokens end with its earlier ones
    (the prompt's do not count), so the word never appears whole."""
    sampler = Sampler(frozenset([EOS]))
    vocab = 12
    # Token t scores highest, then t+1, ...: greedy would walk 5, 6, 7, 8, ...
    r = row(Sampling(max_tokens=64), bad_words=((8,), (6, 7)), prompt=(6,))
    out = []
    for _ in range(6):
        x = torch.zeros(1, vocab)
        if not out:
            x[0, 7], x[0, 5] = 3.0, 2.0  # 7 right after the prompt's 6: allowed (output tokens only)
        else:
            start = out[-1] + 1
            for k in range(vocab):
                x[0, (start + k) % vocab] = float(vocab - k)
        token = sampler.sample(x, [r])[0]
        assert isinstance(token, int)
        out.append(token)
        r.took(token)
    assert out[0] == 7
    assert 8 not in out
    assert all((a, b) != (6, 7) for a, b in itertools.pairwise(out)), out
    assert out == [7, 9, 10, 11, 0, 1]
    words = Bans((), ((6, 7), (6, 7, 9)))
    for token in (1, 6):
        words.took(token)
    assert sorted(words.banned()) == [7]
    words.took(7)
    assert words.banned() == [9]


def test_a_row_left_with_nothing_to_draw_fails_alone_as_the_client_s_error() -> None:
    """allowed_token_ids that only hold EOS before min_tokens, or a bad word
    that is the only allowed token: that row fails with INVALID_REQUEST
    naming the field; the others are sampled."""
    sampler = Sampler(frozenset([EOS]))
    x = logits(3)
    rows = [
        row(Sampling(max_tokens=8, min_tokens=2, allowed_token_ids=(EOS,))),
        row(Sampling(max_tokens=8, allowed_token_ids=(5,)), bad_words=((5,),), rid="b"),
        row(Sampling(max_tokens=8), rid="ok"),
    ]
    out = sampler.sample(x, rows)
    for failed in out[:2]:
        assert isinstance(failed, NothingToDraw)
        assert failed.error_code == E.ERROR_CODE_INVALID_REQUEST
        assert failed.metadata["param"] == "sampling.allowed_token_ids"
    assert out[2] == int(x[2].argmax())
