"""SamplingParams.bad_words as token sequences for the scheduler
(scheduler GenerateRequest.bad_words), as vLLM tokenizes them.

A word can begin the output or follow a space, and a tokenizer spells the
two differently ("Paris" against " Paris" as one token with its space).
So each word, its leading spaces removed, is tokenized alone, and after a
space; the second is kept where it is another word token (its first id
differs and it has as many ids), which is vLLM's rule
(`SamplingParams.update_from_tokenizer`). The scheduler bans a sequence's
last token wherever the generated tokens end with the ones before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmsplit_server.sampling import MAX_BAD_WORD_TOKENS, InvalidSampling


def token_sequences(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Each word's token ids alone and, where another word token, after a
    space; no sequence twice. A word longer than MAX_BAD_WORD_TOKENS ids is
    INVALID_REQUEST."""
    out: list[tuple[int, ...]] = []
    for word in words:
        word = word.lstrip()
        alone = tuple(tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        if len(alone) > MAX_BAD_WORD_TOKENS:
            raise InvalidSampling(
                f"sampling.bad_words: {word[:32]!r} is {len(alone)} tokens, at most {MAX_BAD_WORD_TOKENS}"
            )
        ways = [alone] if alone else []
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            ways.append(spaced)
        out += [ids for ids in ways if ids not in out]
    return out
