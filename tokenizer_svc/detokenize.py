"""Token ids → text deltas, in O(new tokens) per step, and stop strings.

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

from typing import Any

REPLACEMENT = "\ufffd"


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


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` that can be shown now. After a stop string is
        found, `stopped` is set and nothing more is shown."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut]
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


def stream_text(decoder: IncrementalDecoder, stops: StopMatcher, ids: list[int]) -> tuple[str, int]:
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
