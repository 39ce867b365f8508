"""bad_words as the tokenizer service tokenizes them for the scheduler (vLLM's rule)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mmsplit_server.sampling import MAX_BAD_WORD_TOKENS, InvalidSampling
from tokenizer_svc.bad_words import token_sequences


class Spaced:
    """A tokenizer that spells a word after a space as other tokens, as
    byte-level BPEs do ("Paris" 1 token, " Paris" another)."""

    WORDS = {"Paris": (11,), " Paris": (12,), "the end": (20, 21), " the end": (22, 21), "ab": (30, 31), " ab": (32,)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return list(self.WORDS[text])


def test_vllm_s_rule_keeps_the_spaced_form_only_where_it_is_another_word_of_as_many_tokens() -> None:
    tok = Spaced()
    assert token_sequences(tok, ["Paris"]) == [(11,), (12,)]
    assert token_sequences(tok, ["  the end"]) == [(20, 21), (22, 21)]
    assert token_sequences(tok, ["ab"]) == [(30, 31)]  # " ab" is one token, "ab" two: not the same word split
    assert token_sequences(tok, ["Paris", " Paris"]) == [(11,), (12,)]


def test_each_word_alone_and_after_a_space_with_the_models_tokenizer(family_models: Callable[[str], Path]) -> None:
    """The tiny models' SentencePiece tokenizer: the word alone always;
    after a space when that is a different first token of the same length;
    leading spaces of the word do not count; no sequence twice."""
    tok = AutoTokenizer.from_pretrained(family_models("llava"))

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    for word in ("Paris", "the end", "日本"):
        alone, spaced = ids(word), ids(" " + word)
        expected = [alone]
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            expected.append(spaced)
        assert token_sequences(tok, [word]) == expected
        assert token_sequences(tok, ["  " + word]) == expected
        assert token_sequences(tok, [word, word]) == expected


def test_a_word_of_more_tokens_than_the_scheduler_takes_is_refused(family_models: Callable[[str], Path]) -> None:
    tok = AutoTokenizer.from_pretrained(family_models("llava"))
    with pytest.raises(InvalidSampling, match=f"at most {MAX_BAD_WORD_TOKENS}") as info:
        token_sequences(tok, ["🦜" * 40])
    assert info.value.metadata["param"] == "sampling.bad_words"
