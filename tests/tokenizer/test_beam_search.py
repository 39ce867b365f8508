"""Beam search's arithmetic (tokenizer_svc/beam_search.py), step by step
on made-up distributions; tests/e2e/test_http_api.py checks the served
beams against transformers' own beam search."""

from __future__ import annotations

import math

import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server.sampling import InvalidSampling
from tokenizer_svc import beam_search
from tokenizer_svc.beam_search import Search
from tokenizer_svc.errors import InvalidRequest

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
END = 2


def dist(*pairs: tuple[int, float]) -> common_pb2.TokenLogprob:
    """A step's alternatives, (token, log probability), most likely first."""
    return common_pb2.TokenLogprob(top_token_ids=[t for t, _ in pairs], top_logprobs=[lp for _, lp in pairs])


def test_candidates_are_ranked_by_their_beams_sums_across_beams() -> None:
    search = Search(2, 1.0, frozenset({END}))
    assert search.k == 4  # max(2, 1 + one end token) x 2
    search.advance([dist((10, -0.1), (11, -0.5), (12, -3.0))])
    assert [b.tokens for b in search.live] == [(10,), (11,)]
    # Beam (11,) at -0.5 has a better next token than (10,) at -0.1 has:
    # the sums decide, not each beam's own order.
    search.advance([dist((20, -2.0), (21, -2.5)), dist((30, -0.2), (31, -4.0))])
    assert [b.tokens for b in search.live] == [(11, 30), (10, 20)]
    assert [b.logprob for b in search.live] == pytest.approx([-0.7, -2.1])
    entry = search.live[0].logprobs[-1]
    assert entry.logprob == pytest.approx(-0.2)
    assert list(entry.top_token_ids) == [30, 31]


def test_an_end_token_completes_a_hypothesis_only_among_the_first_n() -> None:
    search = Search(2, 1.0, frozenset({END}))
    search.advance([dist((10, -0.1), (END, -0.2), (11, -0.3), (12, -0.4))])
    assert [b.tokens for b in search.done] == [(END,)]
    assert search.done[0].finish_reason == STOP
    assert [b.tokens for b in search.live] == [(10,), (11,)]  # the end took a rank, not a beam
    # Ranked third of the candidates, an end token is dropped.
    later = Search(2, 1.0, frozenset({END}))
    later.advance([dist((10, -0.1), (11, -0.2), (END, -0.3), (12, -0.4))])
    assert later.done == []
    assert [b.tokens for b in later.live] == [(10,), (11,)]


def test_tokens_that_cannot_be_drawn_are_no_candidates() -> None:
    search = Search(3, 1.0, frozenset())
    search.advance([dist((10, -0.5), (11, -math.inf), (12, -math.inf))])
    assert [b.tokens for b in search.live] == [(10,)]


def test_the_length_penalty_divides_by_the_tokens_generated_the_end_counted() -> None:
    short = beam_search.Beam((5, END), -2.0, finish_reason=STOP)
    longer = beam_search.Beam((5, 6, 7, 8), -3.0, finish_reason=LENGTH)
    assert Search(1, 0.0, frozenset()).score(short) == -2.0
    assert Search(1, 1.0, frozenset()).score(short) == -1.0
    assert Search(1, 2.0, frozenset()).score(longer) == pytest.approx(-3.0 / 16)
    # No penalty prefers the short one, a penalty of 2 the long one.
    assert Search(1, 0.0, frozenset()).score(short) > Search(1, 0.0, frozenset()).score(longer)
    assert Search(1, 2.0, frozenset()).score(short) < Search(1, 2.0, frozenset()).score(longer)


def test_the_search_is_over_once_no_live_beam_could_do_better() -> None:
    search = Search(1, 1.0, frozenset({END}))
    assert not search.over
    search.advance([dist((END, -1.0), (10, -1.5))])
    assert [b.tokens for b in search.done] == [(END,)]
    # The live beam's -1.5 over 1 token scores worse than the hypothesis' -1.0: over.
    assert search.over
    assert [b.tokens for b in search.best()] == [(END,)]
    # Where the live beam still scores better, the search goes on.
    going = Search(1, 1.0, frozenset({END}))
    going.advance([dist((END, -1.0), (10, -0.9))])
    assert [b.tokens for b in going.live] == [(10,)]
    assert not going.done  # the end ranked second of width 1
    going.advance([dist((END, -0.5), (11, -3.0))])
    assert going.over  # no beam goes on
    assert [(b.tokens, b.finish_reason) for b in going.best()] == [((10, END), STOP)]


def test_the_last_step_completes_the_first_n_candidates() -> None:
    search = Search(2, 1.0, frozenset({END}))
    search.advance([dist((10, -0.1), (11, -0.2), (12, -0.3))], last=True, last_reason=LENGTH)
    assert search.live == []
    assert search.over
    assert [(b.tokens, b.finish_reason) for b in search.best()] == [((10,), LENGTH), ((11,), LENGTH)]


def test_the_number_of_candidates_follows_the_end_tokens_within_the_limit() -> None:
    assert beam_search.candidates(3, frozenset()) == 6
    assert beam_search.candidates(3, frozenset({1, 2})) == 9
    assert beam_search.candidates(8, frozenset({1, 2})) == 20  # top_logprobs' limit


def request(**sampling: object) -> tokenizer_pb2.GenerateRequest:
    out = tokenizer_pb2.GenerateRequest(prompt="x", n=3, sampling=common_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    out.beam_search.SetInParent()
    return out


def test_sampling_fields_beam_search_cannot_honour_are_refused_by_name() -> None:
    assert beam_search.checked(request(temperature=0.7, logit_bias={3: 1.0}, min_tokens=2)) == 1.0
    for field, value in (
        ("stop", ["x"]), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 1.0),
        ("frequency_penalty", 1.0), ("bad_words", ["x"]), ("prompt_logprobs", 0), ("json_schema", "{}"),
        ("regex", "a+"), ("choice", ["a"]), ("grammar", "root ::= \"a\""),
    ):  # fmt: skip
        with pytest.raises(InvalidSampling) as refused:
            beam_search.checked(request(**{field: value}))
        assert refused.value.metadata["param"] == f"sampling.{field}"
    for penalty in (math.nan, math.inf, 10.5, -11.0):
        bad = request()
        bad.beam_search.length_penalty = penalty
        with pytest.raises(InvalidRequest) as refused:
            beam_search.checked(bad)
        assert refused.value.metadata["param"] == "length_penalty"


def test_a_step_asks_one_token_with_its_alternatives() -> None:
    asked = request(max_tokens=50, min_tokens=2, temperature=0.5, logprobs=False)
    asked.return_prompt_token_ids = True
    first = beam_search.step_request(asked, 6, 0)
    assert not first.HasField("beam_search")
    assert (first.n, first.return_prompt_token_ids) == (1, False)
    s = first.sampling
    assert (s.max_tokens, s.logprobs, s.top_logprobs, s.min_tokens, s.temperature) == (1, True, 6, 1, 0.5)
    assert beam_search.step_request(asked, 6, 2).sampling.min_tokens == 0
    assert asked.sampling.max_tokens == 50  # the request itself is untouched
