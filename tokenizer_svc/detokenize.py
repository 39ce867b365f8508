"""Token ids → text deltas, in O(new tokens) per step, and stop strings.

`StreamDecoder` (what `make_decoder` gives where it can) runs `tokenizers`'
own `DecodeStream` in Rust: ~3 µs a token here against two Python-driven
decodes a token. It has no flush, so the held-back tail comes from one
decode at the end, and only when something is held; and it can raise on
sequences it does not expect (random byte tokens, with some tokenizers), so
a request whose stream raises goes on with `IncrementalDecoder`, resumed
where the stream was, never failing the request.

`IncrementalDecoder` keeps two offsets into the ids (the technique of vLLM's
incremental detokenizer): `prefix` marks where a small decoding window
starts, `read` where the text already emitted ends. Each push decodes only
``ids[prefix:read]`` and ``ids[prefix:]``: both start at the same token, so
whatever the tokenizer does at the start of a text (SentencePiece drops the
leading space) happens to both alike, and their difference is exactly the
new text. The window then moves up to the new ids. Text that ends in an
incomplete UTF-8 sequence (a character split across byte tokens decodes to
U+FFFD) is held back until a later token completes it; `flush` releases
whatever is held at the end. The concatenated deltas equal one decode of all
ids (a test checks this over thousands of tokens).

`StopMatcher` finds stop strings in the streamed text: text that could be
the start of a stop string is held back, so the client never sees part of
one, and on a match the text ends just before it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
# Tokens one character can span (a 4-byte UTF-8 sequence as byte tokens),
# with room to spare: how far back a resumed decoder looks.
_CHAR_TOKENS = 8


def byte_tokens(backend: Any) -> frozenset[int]:
    """The ids of a byte-fallback vocabulary's byte tokens (``<0x00>``..
    ``<0xFF>``); none for other vocabularies. Made once per tokenizer."""
    key = id(backend)
    found = _BYTE_TOKENS.get(key)
    if found is None:
        ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        found = _BYTE_TOKENS[key] = frozenset(i for i in ids if i is not None)
    return found


_BYTE_TOKENS: dict[int, frozenset[int]] = {}


def token_text(tokenizer: Any, token: int) -> str:
    """One token's text, as log probabilities name it: its decode alone,
    with the leading spaces that decode strips given back. A SentencePiece
    vocabulary writes a word's space as a marker ("▁there") and its decoder
    drops the first space of any text, so alone "▁there" decodes to "there"
    while in a text it is " there"; the names of a choice's tokens would not
    add up to its text. The marker's count in the raw piece says how many
    spaces the token starts with (as vLLM's `convert_ids_list_to_tokens`
    now restores them); vocabularies with no such marker (byte-level BPE
    keeps a lone token's space) are decoded as they are."""
    text = str(tokenizer.decode([token]))
    marker = space_marker(tokenizer)
    if marker is None:
        return text
    raw = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(raw, str):
        return text
    spaces = len(raw) - len(raw.lstrip(marker))
    kept = len(text) - len(text.lstrip(" "))
    return " " * (spaces - kept) + text if spaces > kept else text


def space_marker(tokenizer: Any) -> str | None:
    """The character `tokenizer`'s vocabulary writes a space as, where its
    decoder turns it back into one (SentencePiece's "▁": a `Metaspace`
    decoder, or a `Replace` of it with a space); None otherwise. Made once
    per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    key = id(backend)
    if key not in _MARKERS:
        try:
            spec = json.loads(decoder.__getstate__())
        except (TypeError, ValueError):  # a decoder with no serialized form says nothing
            spec = {}
        _MARKERS[key] = _marker(spec)
    return _MARKERS[key]


def _marker(spec: dict[str, Any]) -> str | None:
    kind = spec.get("type")
    if kind == "Metaspace":
        return str(spec.get("replacement", "\u2581"))
    if kind == "Replace" and spec.get("content") == " ":
        pattern = spec.get("pattern", {}).get("String")
        return pattern if isinstance(pattern, str) and len(pattern) == 1 else None
    if kind == "Sequence":
        return next((found for part in spec.get("decoders", []) if (found := _marker(part))), None)
    return None


_MARKERS: dict[int, str | None] = {}


def make_decoder(tokenizer: Any, *, skip_special_tokens: bool = True) -> StreamDecoder | IncrementalDecoder:
    """The fastest exact decoder for `tokenizer`: `DecodeStream` on its Rust
    tokenizer when transformers' decode would only wrap that (no clean-up of
    spaces), else `IncrementalDecoder`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return StreamDecoder(tokenizer, backend, skip_special_tokens=skip_special_tokens)
    return IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer directly, when transformers' decode would only
        # wrap it (no clean-up of spaces): the wrapper costs more than the decode.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    @classmethod
    def resumed(
        cls, tokenizer: Any, ids: list[int], read: int, *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """A decoder that has given out the text of ``ids[:read]`` (and holds
        the rest back), as if it had decoded them itself."""
        decoder = cls(tokenizer, skip_special_tokens=skip_special_tokens)
        decoder.ids = list(ids)
        decoder._read = read
        decoder._prefix = max(0, read - _CHAR_TOKENS)
        return decoder

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        decoder = self._backend or self.tokenizer
        text: str = decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text


class StreamDecoder:
    """`DecodeStream` with what it lacks: the held-back tail at the end
    (`flush`), a fallback to `IncrementalDecoder` for a request whose
    stream raises, and byte runs decoded whole.

    A byte-fallback decoder turns a run of byte tokens into text as one:
    valid UTF-8 becomes characters, and every byte of an invalid run
    becomes U+FFFD, so a byte that decodes to "2" alone is "\ufffd" once an
    invalid byte follows it. A run is therefore held until a token that is
    not a byte ends it (or the stream ends): what is given out never
    changes afterwards, and the text is one decode of every id."""

    def __init__(self, tokenizer: Any, backend: Any, *, skip_special_tokens: bool = True, stream: Any = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend
        self._stream = stream if stream is not None else DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted = 0  # characters of text given out
        self._held = False  # the last step gave nothing: text may be held back
        self._fallback: IncrementalDecoder | None = None
        self._bytes = byte_tokens(backend)
        self._run: list[int] = []  # ids of a byte run not yet ended, not yet decoded

    @property
    def fell_back(self) -> bool:
        return self._fallback is not None

    def push(self, token_ids: list[int]) -> str:
        end = len(token_ids)
        while end and token_ids[end - 1] in self._bytes:
            end -= 1
        if end == 0:  # the run goes on
            self._run.extend(token_ids)
            return ""
        token_ids, self._run = [*self._run, *token_ids[:end]], list(token_ids[end:])
        return self._step(token_ids)

    def _step(self, token_ids: list[int]) -> str:
        if self._fallback is not None:
            return self._fallback.push(token_ids)
        self.ids.extend(token_ids)
        try:
            chunk = self._stream.step(self._backend, token_ids[0] if len(token_ids) == 1 else token_ids)
        except Exception as exc:  # "Invalid prefix", or worse: this request decodes on without the stream
            log.info("DecodeStream failed after %d tokens (%s); decoding on without it", len(self.ids), exc)
            return self._fall_back()
        self._held = not chunk
        if not chunk:
            return ""
        self._emitted += len(chunk)
        text: str = chunk
        return text

    def flush(self) -> str:
        """The text still held back: what one decode of every id has past
        the text given out (no decode when nothing is held)."""
        run, self._run = self._run, []
        if self._fallback is not None:
            return self._fallback.push(run) + self._fallback.flush() if run else self._fallback.flush()
        if run:
            self.ids.extend(run)
            self._held = True
        if not self._held:
            return ""
        self._held = False
        full = self._decode(self.ids)
        tail, self._emitted = full[self._emitted :], len(full)
        return tail

    def _fall_back(self) -> str:
        """Go on with `IncrementalDecoder` from here, after the text past
        what was given out (one decode of every id: a rare path)."""
        # What was handed in ends with a token that is not a byte (`push`):
        # its text is final, so all of it is given out.
        text = self._decode(self.ids)
        self._fallback = IncrementalDecoder.resumed(
            self.tokenizer, self.ids, len(self.ids), skip_special_tokens=self.skip_special_tokens
        )
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _decode(self, ids: list[int]) -> str:
        decoded: str = self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return decoded


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        """`include`: the text shown ends with the stop string found, not
        before it."""
        self.stops = stops
        self.include = include
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` that can be shown now. After a stop string is
        found, `stopped` is set and nothing more is shown."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        held = self._held + text
        found = [(i, s) for i, s in ((held.find(s), s) for s in self.stops) if i >= 0]
        if found:
            # The first to begin; of those, the first listed.
            cut, stop = min(found, key=lambda f: f[0])
            self.stopped = True
            self._held = ""
            return held[: cut + len(stop)] if self.include else held[:cut]
        keep = self._longest_stop_prefix_suffix(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    def flush(self) -> str:
        """At the end of the stream: what was held back, since no stop string came."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best


def stream_text(decoder: StreamDecoder | IncrementalDecoder, stops: StopMatcher, ids: list[int]) -> tuple[str, int]:
    """The text that one streamed message's `ids` add (a step's token, or
    several: the scheduler's --stream-interval), and how many of the ids
    count: all of them, or, when a stop string ends the stream
    (`stops.stopped`), those up to the token it falls in. With stop strings
    the ids go in one at a time, so where the stream ends does not depend
    on how many tokens a message carries."""
    if not stops.stops or len(ids) == 1:
        return stops.feed(decoder.push(ids)), len(ids)
    text = ""
    for n, token in enumerate(ids, start=1):
        text += stops.feed(decoder.push([token]))
        if stops.stopped:
            return text, n
    return text, len(ids)
