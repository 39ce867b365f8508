"""A reasoning model's thinking apart from its answer, for the OpenAI API's
chat completions (vLLM's --reasoning-parser): the output's reasoning goes
to the message's `reasoning` (and `reasoning_content`, the older name
DeepSeek's API and many clients read), the rest to its `content`, whole or
streamed.

Qwen3 and DeepSeek-R1 write their thinking between ``<think>`` and
``</think>``. Where the model starts is the prompt's: a chat template that
ends its generation prompt with an open ``<think>`` (DeepSeek-R1, the
Qwen3 "Thinking" models) has the model reason first, writing only the end
tag; one that does not (Qwen3's hybrid template; with
``enable_thinking: false`` it closes an empty ``<think></think>`` itself)
leaves the model to open its thinking with ``<think>`` at the very start
of its output, or to answer at once. `Think.opens` reads that from the
prompt (where the tags are tokens of their own, the last of them in the
prompt: an assistant turn continued inside its thinking,
continue_final_message, is read as thinking too; else the prompt's last
tokens), so a stream knows from its first token which field
its text goes to, instead of guessing (vLLM's Qwen3 parser took a whole
output with no end tag for content, and a stream cannot wait for the end).

What is read: reasoning until ``</think>`` (an output cut short before it
is all reasoning), without the tags and the whitespace around it; then the
content, without its leading whitespace (Qwen3 writes a blank line after
the tag). An output that does not start in thinking is all content, as it
came. A stream shows the same two texts, chunk by chunk: it holds back
what may still turn out to be the end tag, and whitespace that may end
the reasoning, until the next text says what they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizer_svc.errors import InvalidRequest

START, END = "<think>", "</think>"
# The prompt's tail read to find an open <think> (a few tokens: the tag and
# the whitespace a template writes after it).
_TAIL_TOKENS = 8
# With tags of their own: the prompt's last ids looked at one by one before scanning it all.
_TAG_WINDOW = 64


class Think:
    """The ``<think>``...``</think>`` form (Qwen3, DeepSeek-R1)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # The end tag's own token, where the vocabulary has one (Qwen3's and
        # DeepSeek-R1's do): the thinking's tokens then end at its first.
        encode = getattr(tokenizer, "encode", None)
        spelled = list(encode(END, add_special_tokens=False)) if encode is not None else []
        self._end_id = spelled[0] if len(spelled) == 1 else None
        opening = list(encode(START, add_special_tokens=False)) if encode is not None else []
        self._start_id = opening[0] if len(opening) == 1 else None

    def opens(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the model inside its thinking. Where
        both tags are tokens of their own (Qwen3's, DeepSeek-R1's
        vocabularies: the chat template alone writes them, user text cannot
        hold them), the prompt's last tag is ``<think>``: a generation prompt
        that opens it, or an assistant turn continued inside its thinking
        (continue_final_message). Else its last few tokens end with
        ``<think>`` (whitespace after it aside)."""
        if self._start_id is not None and self._end_id is not None:
            ids = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
            # The usual: a tag in the generation prompt, among the last few ids.
            for token in reversed(ids[-_TAG_WINDOW:]):
                if token in (self._start_id, self._end_id):
                    return token == self._start_id
            if self._start_id not in ids:  # one scan in C; no thinking was ever opened
                return False
            backwards = ids[::-1]  # a turn continued inside its thinking: which tag is last
            return _first(backwards, self._start_id) < _first(backwards, self._end_id)
        tail = self.tokenizer.decode(list(prompt_ids[-_TAIL_TOKENS:]), skip_special_tokens=False)
        return bool(tail.rstrip().endswith(START))

    def start(self, prompt_ids: Sequence[int], constrained: bool) -> bool:
        """`opens`, for a request whose output is structured (`constrained`:
        masked by a grammar from its first token) or not: such a request
        cannot go where the prompt opens the thinking (INVALID_REQUEST)."""
        opened = self.opens(prompt_ids)
        if opened and constrained:
            raise InvalidRequest(
                "structured output (response_format, text.format, a forced tool call, structured_outputs) cannot be "
                "honoured when the chat template opens the model's thinking (its prompt ends with <think>): the "
                'grammar would hold from the first token; turn the thinking off (chat_template_kwargs: {"enable_'
                'thinking": false}, where the template takes it) or leave the structure out'
            )
        return opened

    def tokens(self, ids: Sequence[int], opened: bool, text: str | None = None) -> int:
        """How many of an output's tokens (`ids`, whose text is `text`, decoded
        here when not given) are its thinking: those up to the one that
        completes the end tag, all when it never ends, none when it does not
        think (the usage's reasoning_tokens). Where the tag is a token of its
        own, that token's place; else the shortest run of ids whose text
        holds the tag (a bisection of decodes: ~0.2 s for 46,000 ids, on the
        event loop, for a tokenizer that spells the tag in pieces)."""
        ids = list(ids)
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if self.split(text, opened)[0] is None:
            return 0
        if END not in text:
            return len(ids)
        if self._end_id is not None and self._end_id in ids:
            return ids.index(self._end_id) + 1
        low, high = 1, len(ids)  # the shortest run of ids whose text holds the end tag
        while low < high:
            middle = (low + high) // 2
            if END in self.tokenizer.decode(ids[:middle], skip_special_tokens=True):
                high = middle
            else:
                low = middle + 1
        return low

    def split(self, text: str, opened: bool, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of an output so far: None for reasoning
        when the output does not think. Not `final`: what may be shown of
        them now, each a prefix of what a longer output shows."""
        if not opened:
            lead = text.lstrip()
            if lead.startswith(START):
                text, opened = lead[len(START) :], True
            elif not final and START.startswith(lead):  # "", or a start of the tag: not known yet
                return None, ""
            else:
                return None, text
        end = text.find(END)
        if end >= 0:
            return text[:end].strip(), text[end + len(END) :].lstrip()
        reasoning = text.lstrip()
        if final:
            return reasoning.rstrip(), ""
        return _held(reasoning), ""


class Stream:
    """One output's `Think.split`, as it grows: each `feed` of the output so
    far gives what it adds to the reasoning and to the content shown (the
    same texts `split` gives, not final or final), in time linear in the
    output: the end tag is searched for in what is new, and the texts are
    kept as places in the output, not copied each token."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.thinking: bool | None = None  # whether the output thinks (None: not known yet)
        self._begin = 0  # where the reasoning's text starts (after its <think>)
        self._first: int | None = None  # its first character that is no whitespace
        self._end: int | None = None  # where </think> is
        self._searched = 0  # how far the end tag was looked for
        self._content: int | None = None  # where the content shown starts
        self._reasoning_sent = 0  # characters of the reasoning given so far
        self._content_sent = 0  # and of the content

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `text` (the whole output so far) adds."""
        if self.thinking is None and not self._decide(text, final):
            return "", ""
        if not self.thinking:
            self._content = 0
            return "", self._content_delta(text)
        if self._end is None:
            found = text.find(END, max(self._begin, self._searched - len(END) + 1))
            self._searched = len(text)
            self._end = found if found >= 0 else None
        limit = len(text) if self._end is None else self._end
        if self._first is None:
            first = _nonspace(text, self._begin, limit)
            self._first = first if first < limit else None
        reasoning = ""
        if self._first is not None:
            upto = self._reasoning_end(text, limit, final)
            reasoning = text[self._first + self._reasoning_sent : upto]
            self._reasoning_sent += len(reasoning)
        if self._end is not None and self._content is None:
            first = _nonspace(text, self._end + len(END), len(text))
            self._content = first if first < len(text) else None
        return reasoning, self._content_delta(text)

    def _decide(self, text: str, final: bool) -> bool:
        """Whether the output thinks, once its start says (False: not yet)."""
        if self.opened:
            self.thinking = True
            return True
        lead = _nonspace(text, 0, len(text))
        if text.startswith(START, lead):
            self.thinking, self._begin = True, lead + len(START)
        elif not final and START.startswith(text[lead:]):
            return False
        else:
            self.thinking = False
        return True

    def _reasoning_end(self, text: str, limit: int, final: bool) -> int:
        """Where the reasoning shown ends: before the end tag (or, not final,
        a tail that may begin it) and the whitespace before that."""
        upto = limit
        if self._end is None and not final:
            for k in range(min(len(END) - 1, upto - self._first), 0, -1):  # type: ignore[operator]
                if END.startswith(text[upto - k : upto]):
                    upto -= k
                    break
        while upto > self._first and text[upto - 1].isspace():  # type: ignore[operator]
            upto -= 1
        return upto

    def content(self, text: str) -> str:
        """The content shown of `text`, the output as last fed (for what reads it whole: tool calls)."""
        return "" if self._content is None else text[self._content :]

    def _content_delta(self, text: str) -> str:
        if self._content is None:
            return ""
        delta = text[self._content + self._content_sent :]
        self._content_sent += len(delta)
        return delta


def _first(ids: list[int], token: int) -> int:
    """Where `token` first is in `ids`; past the end when nowhere."""
    try:
        return ids.index(token)
    except ValueError:
        return len(ids)


def _nonspace(text: str, start: int, limit: int) -> int:
    """The first place in text[start:limit] that is no whitespace (`limit` if none)."""
    while start < limit and text[start].isspace():
        start += 1
    return start


def _held(reasoning: str) -> str:
    """A stream's reasoning, less what the next text decides: a tail that
    may begin the end tag, and the whitespace before it (which the end tag
    would strip)."""
    for k in range(min(len(END) - 1, len(reasoning)), 0, -1):
        if END.startswith(reasoning[-k:]):
            reasoning = reasoning[:-k]
            break
    return reasoning.rstrip()


def structured(sampling: Any) -> bool:
    """Whether a request's output is structured: masked by a grammar from its first token."""
    return bool(sampling.json_schema or sampling.regex or sampling.choice or sampling.grammar)


# --reasoning-parser names (vLLM's): both are the same tag form.
PARSERS = {"qwen3": Think, "deepseek_r1": Think}
