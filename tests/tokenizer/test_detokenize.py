"""Incremental detokenization (O(new tokens) per push, exact text) and stop strings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers.decoders import DecodeStream

from tests.support import hf_loaded
from tokenizer_svc.detokenize import (
    IncrementalDecoder,
    StopMatcher,
    StreamDecoder,
    make_decoder,
    space_marker,
    stream_text,
    token_text,
)

MIXED = (
    "Héllo wörld, naïve café 🙂 — 東京タワーは高い。Ünïcödé ☃ snow, 🎉🎉 done. "
    "Ελληνικά και русский текст, 한국어 문장, עברית, emoji 👩‍👩‍👧‍👦 family. "
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return hf_loaded.tokenizer(tiny_model)


class CountingTokenizer:
    """Wraps a tokenizer and counts the ids each decode call is given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.clean_up_tokenization_spaces = True  # keep the decoder on this wrapper, not the backend
        self.calls: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        text: str = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def stream_ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer.encode(MIXED, add_special_tokens=False))
    return ids[:n]


def test_4096_tokens_decode_to_exactly_one_final_decode_at_constant_cost(tokenizer: Any) -> None:
    ids = stream_ids(tokenizer, 4096)
    assert any(tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids), "no byte-fallback tokens"
    counting = CountingTokenizer(tokenizer)
    decoder = IncrementalDecoder(counting)
    text = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    # Two decodes per push, each over a window of a few tokens: the work per
    # token does not grow with the position in the stream.
    assert len(counting.calls) <= 2 * len(ids) + 2
    assert max(counting.calls) <= 16, f"a decode covered {max(counting.calls)} tokens"
    first, last = counting.calls[:400], counting.calls[-400:]
    assert sum(last) <= sum(first) * 1.5


def test_steps_of_several_tokens_and_the_fast_path_agree(tokenizer: Any) -> None:
    ids = stream_ids(tokenizer, 600)
    decoder = IncrementalDecoder(tokenizer)  # the backend's decode, not transformers' wrapper
    text = "".join(decoder.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + decoder.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_split_character_is_held_back_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("👩", add_special_tokens=False)
    byte_tokens = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_tokens) == 4, "expected the emoji as four byte-fallback tokens"
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + decoder.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_unfinished_character_comes_out_at_flush(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 👩", add_special_tokens=False)[:-1]  # cut inside the emoji's four bytes
    decoder = IncrementalDecoder(tokenizer)
    text = "".join(decoder.push([i]) for i in ids)
    assert text + decoder.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("Hello there", add_special_tokens=False), tokenizer.eos_token_id]
    decoder = IncrementalDecoder(tokenizer)
    text = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert text == "Hello there"


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    shown = ""
    for piece in pieces:
        shown += matcher.feed(piece)
        if matcher.stopped:
            return shown
    return shown + matcher.flush()


def test_stop_string_split_across_deltas_ends_the_text_before_it() -> None:
    matcher = StopMatcher(("STOP here",))
    shown = feed_all(matcher, ["Hello ", "world ST", "OP h", "ere and more"])
    assert matcher.stopped
    assert shown == "Hello world "


def test_text_that_could_begin_a_stop_string_is_held_then_released() -> None:
    matcher = StopMatcher(("<end>",))
    assert matcher.feed("abc <e") == "abc "
    assert matcher.feed("nvelope>") == "<envelope>"
    assert matcher.feed(" tail <") == " tail "
    assert matcher.flush() == "<"
    assert not matcher.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    included = StopMatcher(("<end>", "nd"), include=True)
    assert included.feed("a <e") + included.feed("nd> b") == "a <end>"
    assert included.stopped
    matcher = StopMatcher(("zzz", "b"))
    assert feed_all(matcher, ["aaab zzz"]) == "aaa"


def test_no_stop_strings_passes_everything_through() -> None:
    matcher = StopMatcher(())
    assert feed_all(matcher, ["a", "b", "c"]) == "abc"
    assert not matcher.stopped


def test_a_message_of_several_tokens_stops_where_one_token_a_message_would(tokenizer: Any) -> None:
    """The scheduler may send several tokens a message (--stream-interval):
    the stream still ends at the token the stop string falls in."""
    ids = tokenizer("one two three four five six seven", add_special_tokens=False)["input_ids"]

    def run(messages: list[list[int]]) -> tuple[str, list[int]]:
        decoder, stops = IncrementalDecoder(tokenizer), StopMatcher(("three",))
        shown, kept = "", []
        for message in messages:
            text, n = stream_text(decoder, stops, message)
            shown, kept = shown + text, kept + message[:n]
            if stops.stopped:
                break
        return shown, kept

    one_each = run([[i] for i in ids])
    four_each = run([ids[i : i + 4] for i in range(0, len(ids), 4)])
    assert one_each == four_each
    assert one_each[0] == "one two "
    assert len(one_each[1]) < 4, "the stop string falls inside the first message of four"
    assert "three" in tokenizer.decode(one_each[1])
    assert "three" not in tokenizer.decode(one_each[1][:-1])


def random_ids(tokenizer: Any, n: int, seed: int) -> list[int]:
    """`n` ids drawn from the whole vocabulary, a quarter of them lone byte
    tokens (the pieces of characters, in any order: what a model sampling at
    a high temperature can emit)."""
    rng = random.Random(seed)
    byte_ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    return [rng.choice(byte_ids) if rng.random() < 0.25 else rng.randrange(tokenizer.vocab_size) for _ in range(n)]


def streamed(decoder: StreamDecoder | IncrementalDecoder, ids: list[int], rng: random.Random) -> str:
    text, i = "", 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 4])
        text += decoder.push(ids[i : i + n])
        i += n
    return text + decoder.flush()


def test_the_stream_decoder_is_what_a_fast_tokenizer_gets(tokenizer: Any) -> None:
    assert isinstance(make_decoder(tokenizer), StreamDecoder)
    assert isinstance(make_decoder(CountingTokenizer(tokenizer)), IncrementalDecoder)  # no backend to stream on


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_4096_random_ids_stream_to_exactly_one_final_decode(tokenizer: Any, seed: int) -> None:
    ids = random_ids(tokenizer, 4096, seed)
    decoder = make_decoder(tokenizer)
    text = streamed(decoder, ids, random.Random(seed))
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


class Flaky:
    """A `DecodeStream` that raises at its `fail_at`-th step (as a real one
    does on a prefix it did not expect)."""

    def __init__(self, fail_at: int) -> None:
        self.inner = DecodeStream(skip_special_tokens=True)
        self.steps = 0
        self.fail_at = fail_at

    def step(self, backend: Any, ids: Any) -> str | None:
        self.steps += 1
        if self.steps == self.fail_at:
            raise Exception("Invalid prefix encountered while decoding stream")
        chunk: str | None = self.inner.step(backend, ids)
        return chunk


@pytest.mark.parametrize("fail_at", [1, 2, 7, 50, 200, 400])
def test_a_stream_that_raises_falls_back_and_the_text_stays_exact(tokenizer: Any, fail_at: int) -> None:
    """Wherever the stream raises — inside a character split over byte
    tokens too — the request decodes on without it and its text is one
    decode of every id: nothing lost, nothing twice."""
    ids = random_ids(tokenizer, 1200, fail_at)
    decoder = StreamDecoder(tokenizer, tokenizer.backend_tokenizer, stream=Flaky(fail_at))
    text = streamed(decoder, ids, random.Random(fail_at))
    assert decoder.fell_back
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_cut_at_the_end_comes_out_at_flush_from_the_stream(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 👩", add_special_tokens=False)[:-1]  # cut inside the emoji's four bytes
    decoder = make_decoder(tokenizer)
    text = "".join(decoder.push([i]) for i in ids)
    assert "\ufffd" not in text
    assert text + decoder.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def _byte_level_tokenizer() -> Any:
    """A byte-level BPE tokenizer (GPT-2's and Qwen's kind) trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([MIXED, "hello there  big   spaces"] * 20, trainers.BpeTrainer(vocab_size=400))
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def test_tokens_named_alone_keep_the_spaces_they_begin_with_so_the_names_add_up_to_the_text(tokenizer: Any) -> None:
    """Log probabilities name each token by its text alone. A SentencePiece
    token that begins a word ("▁there") decodes alone to "there", its space
    dropped as a text's first space is: the names are given their spaces
    back, so they join to the text (with the space SentencePiece puts before
    a text's first word). Byte-level BPE keeps a lone token's space, and its
    names are its decodes as they are."""
    text = "hello there  big   spaces, naïve café done"  # (a byte token alone names no character)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert space_marker(tokenizer) == "\u2581"
    names = [token_text(tokenizer, t) for t in ids]
    assert "".join(names) == " " + text
    # A word's token alone: its decode lacks the space its name has.
    there = next(t for t in ids if tokenizer.convert_ids_to_tokens(t) == "\u2581there")
    assert (tokenizer.decode([there]), token_text(tokenizer, there)) == ("there", " there")

    byte_level = _byte_level_tokenizer()
    assert space_marker(byte_level) is None
    ascii_text = "hello there  big   spaces, done"
    ids = byte_level(ascii_text, add_special_tokens=False).input_ids
    names = [token_text(byte_level, t) for t in ids]
    assert any(name.startswith(" ") for name in names)
    assert names == [byte_level.decode([t]) for t in ids]
    assert "".join(names) == ascii_text
