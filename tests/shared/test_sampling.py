"""The contract's sampling limits, as both services check them."""

from __future__ import annotations

import math

import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E
from mmsplit_server.sampling import InvalidSampling, Sampling


def check(pb: common_pb2.SamplingParams, **kw: object) -> Sampling:
    args: dict[str, object] = {"max_tokens_limit": 4096, "default_max_tokens": 64, "vocab_size": 1000}
    args.update(kw)
    return Sampling.from_pb(pb, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": 1e-39}, "temperature"),
        ({"temperature": 1e-30}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_tokens": 10, "min_tokens": 11}, "min_tokens"),
        ({"min_tokens": 65}, "min_tokens"),  # over the default max_tokens of 64
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(33))}, "stop_token_ids"),
        ({"stop": ["x"] * 9}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["y" * 129]}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {1000: 1.0}}, "logit_bias"),  # outside the vocabulary of 1,000
        ({"logit_bias": {t: 1.0 for t in range(1025)}}, "logit_bias"),
        ({"json_schema": "not json"}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ({"json_schema": '{"type": "object", "description": "' + "x" * 70_000 + '"}'}, "json_schema"),
        ({"json_schema": '{"type": "object"}', "min_tokens": 3}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"regex": "a" * 70_000}, "regex"),
        ({"regex": "[a-z]+", "min_tokens": 2}, "regex"),
        ({"choice": [""]}, "choice"),
        ({"choice": ["x" * 1025]}, "choice"),
        ({"choice": ["a"] * 1025}, "choice"),
        ({"json_schema": '{"type": "object"}', "regex": "a"}, "regex"),
        ({"regex": "a", "choice": ["a"]}, "choice"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": "start: " + '"a" | ' * 20_000 + '"b"'}, "grammar"),
        ({"grammar": 'start: "a"', "min_tokens": 1}, "grammar"),
        ({"grammar": 'start: "a"', "regex": "a"}, "grammar"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"ignore_eos": True, "choice": ["a"]}, "ignore_eos"),
        ({"allowed_token_ids": [3, 1000]}, "allowed_token_ids"),  # outside the vocabulary of 1,000
        ({"allowed_token_ids": [1] * 262_145}, "allowed_token_ids"),
        ({"bad_words": ["x"] * 65}, "bad_words"),
        ({"bad_words": ["   "]}, "bad_words"),
        ({"bad_words": ["z" * 129]}, "bad_words"),
    ],
)
def test_out_of_limits_is_invalid_request_naming_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSampling) as info:
        check(common_pb2.SamplingParams(**params))  # type: ignore[arg-type]
    assert info.value.error_code == E.ERROR_CODE_INVALID_REQUEST
    assert f"sampling.{field}" in info.value.message


def test_the_limit_is_named_when_max_tokens_is_over_it() -> None:
    with pytest.raises(InvalidSampling, match="over the limit 4096"):
        check(common_pb2.SamplingParams(max_tokens=4097))


def test_defaults_and_accepted_values() -> None:
    plain = check(common_pb2.SamplingParams())
    assert plain == Sampling(max_tokens=64)
    assert plain.greedy
    full = check(
        common_pb2.SamplingParams(
            max_tokens=20,
            temperature=0.7,
            seed=5,
            top_p=0.9,
            top_k=40,
            min_tokens=3,
            stop_token_ids=[7, 8],
            stop=["###"],
        )
    )
    assert full.max_tokens == 20
    assert full.temperature == pytest.approx(0.7)
    assert full.top_p == pytest.approx(0.9)
    assert (full.top_k, full.seed, full.min_tokens, full.stop_token_ids, full.stop) == (40, 5, 3, (7, 8), ("###",))
    assert not full.greedy
    # Edges of the documented ranges are inside them.
    assert check(common_pb2.SamplingParams(temperature=0.001, top_p=1.0)).top_p == 1.0
    assert check(common_pb2.SamplingParams(temperature=100.0)).temperature == 100.0
    # A huge top_k is allowed: it means "off".
    assert check(common_pb2.SamplingParams(top_k=10**9)).top_k == 10**9
    # No penalty and no bias adjust nothing (repetition 0 is unset: 1).
    assert not plain.adjusts_logits
    assert plain.repetition_penalty == 1.0
    assert not check(common_pb2.SamplingParams(repetition_penalty=1.0)).adjusts_logits
    edges = check(
        common_pb2.SamplingParams(
            presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0, logit_bias={9: -100.0, 2: 100.0}
        )
    )
    assert (edges.presence_penalty, edges.frequency_penalty, edges.repetition_penalty) == (-2.0, 2.0, 2.0)
    assert edges.logit_bias == ((2, 100.0), (9, -100.0))
    assert edges.adjusts_logits
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    assert check(common_pb2.SamplingParams(json_schema=schema)).structure == ("json_schema", schema)
    assert check(common_pb2.SamplingParams(regex="[0-9]{3}")).structure == ("regex", "[0-9]{3}")
    assert check(common_pb2.SamplingParams(choice=["yes", 'n"o'])).structure == ("choice", '["yes", "n\\"o"]')
    assert (check(common_pb2.SamplingParams(min_p=1.0)).min_p, check(common_pb2.SamplingParams()).min_p) == (1.0, 0.0)
    assert check(common_pb2.SamplingParams(ignore_eos=True)).ignore_eos
    lark, gbnf = 'start: "yes" | "no"', 'root ::= [0-9]+ "!"'
    assert check(common_pb2.SamplingParams(grammar=lark)).structure == ("grammar", lark)
    assert check(common_pb2.SamplingParams(grammar=gbnf)).structure == ("grammar", gbnf)
    assert check(common_pb2.SamplingParams()).structure is None
    # allowed_token_ids: a set, sorted; bad_words as given (the tokenizer service tokenizes them).
    bans = check(common_pb2.SamplingParams(allowed_token_ids=[9, 2, 9, 999], bad_words=[" Paris", "z" * 128]))
    assert bans.allowed_token_ids == (2, 9, 999)
    assert bans.bad_words == (" Paris", "z" * 128)
    assert (plain.allowed_token_ids, plain.bad_words) == ((), ())


def test_the_tokenizer_side_leaves_the_default_and_the_vocabulary_to_the_scheduler() -> None:
    # No default max_tokens and no vocabulary: 0 stays 0 and ids are not checked here.
    loose = Sampling.from_pb(common_pb2.SamplingParams(stop_token_ids=[10**6], min_tokens=100), max_tokens_limit=4096)
    assert loose.max_tokens == 0
    assert loose.stop_token_ids == (10**6,)
    bias = Sampling.from_pb(common_pb2.SamplingParams(logit_bias={10**6: 1.0}), max_tokens_limit=4096)
    assert bias.logit_bias == ((10**6, 1.0),)
