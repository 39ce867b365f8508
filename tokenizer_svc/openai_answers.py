"""The OpenAI-compatible API's answers: the contract's events (a request's
GenerateResponses, per choice) into chat and completion objects and
streamed chunks, tool calls included (`Shape`), and what the choices
produced, for the final object and the usage (`Choices`). No I/O here
(`tokenizer_svc.http_api` serves it; `tokenizer_svc.openai_api` maps the
requests)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.detokenize import token_text
from tokenizer_svc.reasoning import Stream, Think
from tokenizer_svc.tool_calls import Auto, Forced, call_id

FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CONTEXT_LENGTH: "length",
}


@dataclass(frozen=True)
class Echo:
    """What completions' `echo` and vLLM's `prompt_logprobs` show of each
    prompt (`openai_api.Call`)."""

    texts: tuple[str, ...] = ()  # by prompt: its text, which each of its choices starts with (empty: no echo)
    logprobs: int | None = None  # echo's top entries per prompt token (None: no log probabilities)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, top tokens per entry (None: not asked)
    # Completions' echo with max_tokens 0: the prompt alone, the token the
    # scheduler made for it neither shown nor counted (`openai_api.Call.scored_only`).
    alone: bool = False


# What a log probability of -inf (a token that could not be drawn: banned,
# masked, cut by top_k) is written as: JSON has no infinity, and OpenAI's
# API (and vLLM's) uses this.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


class Choices:
    """What the choices of one request have produced, for the final object
    and the usage: text, finish reason and token counts per choice. With
    several prompts (completions), `per_prompt` choices are each prompt's."""

    def __init__(
        self,
        n: int,
        tokens: Any = None,
        per_prompt: int = 0,
        echo: Echo | None = None,
        token_ids: bool = False,
        tokens_as_ids: bool = False,
    ) -> None:
        """`tokens`: the tokenizer, to name the tokens of log probabilities;
        `token_ids`: the ids are shown (return_token_ids), so a response
        that adds only ids is shown too; `tokens_as_ids`: log probabilities
        name a token "token_id:<id>" (return_tokens_as_token_ids; the
        legacy text offsets then count those names, as vLLM's do)."""
        self.want_ids = token_ids
        self.tokens_as_ids = tokens_as_ids
        self.echo = echo or Echo()
        self._echoed: set[int] = set()  # choices whose output began (with their echo, if any)
        self.prompt_logprobs: dict[int, list[dict[str, Any] | None]] = {}  # vLLM's, by choice
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.per_prompt = per_prompt or n
        # Per prompt: its tokens, and those the scheduler's prefix cache
        # spared (the most of any of its choices).
        self._prompt: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self.completion_tokens = [0] * n
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._offset = [0] * n  # characters of the tokens of each choice's entries so far (legacy text_offset)
        self._names: dict[int, str] = {}  # token id -> its text (`_text`)
        self.tokens = tokens
        # With return_token_ids: each choice's prompt ids, and its generated ids.
        self.prompt_ids: dict[int, list[int]] = {}
        self.token_ids: list[list[int]] = [[] for _ in range(n)]

    def add(self, i: int, response: tokenizer_pb2.GenerateResponse) -> Shown | None:
        """Record a response of choice `i`: what to show of it, or None
        when it adds nothing to show."""
        kind = response.WhichOneof("event")
        shown: Shown | None = None
        if kind == "prompt_tokens":
            self.prompt_ids[i] = list(response.prompt_tokens.token_ids)
            shown = Shown("", None, [], prompt_ids=self.prompt_ids[i])
        elif kind == "prompt_logprobs":
            scored = response.prompt_logprobs
            if self.echo.prompt_logprobs is not None:
                self.prompt_logprobs[i] = self._vllm_form(scored, self.echo.prompt_logprobs)
            if self.echo.logprobs is not None:
                shown = Shown("", None, self._prompt_entries(scored, self.echo.logprobs))
        elif kind == "delta" and not self.echo.alone:
            d = response.delta
            entries = [self._entry(t, lp) for t, lp in zip(d.token_ids, d.logprobs, strict=False)]
            shown = Shown(d.text, None, entries, token_ids=list(d.token_ids))
            self.token_ids[i] += d.token_ids
        elif kind == "finished":
            f = response.finished
            self.finish[i] = "length" if self.echo.alone else FINISH.get(f.finish_reason, "stop")
            prompt = i // self.per_prompt
            self._prompt[prompt] = f.prompt_tokens
            self._cached[prompt] = max(self._cached.get(prompt, 0), f.cached_tokens)
            self.completion_tokens[i] = 0 if self.echo.alone else f.completion_tokens
            shown = Shown("", self.finish[i], [])
        if shown is not None and i not in self._echoed and self.echo.texts:
            # The choice's first output: its prompt's text goes first (with
            # the prompt's log probabilities, which come before any token).
            shown = dataclasses.replace(shown, text=self.echo.texts[i // self.per_prompt] + shown.text)
        ids = self.want_ids and bool(shown and (shown.token_ids or shown.prompt_ids is not None))
        if shown is None or not (shown.text or shown.logprobs or shown.finish or ids):
            return None
        self._echoed.add(i)
        self.text[i] += shown.text
        if shown.logprobs:
            shown = dataclasses.replace(shown, offset=self._offset[i])
            self._offset[i] += sum(len(e["token"]) for e in shown.logprobs)
        self.logprobs[i] += shown.logprobs
        return shown

    def _entry(self, token: int, lp: common_pb2.TokenLogprob, top: int | None = None) -> dict[str, Any]:
        """OpenAI's chat form of one token's log probability (and its first `top` alternatives)."""
        pairs = list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))[:top]
        return {**self._named(token, lp.logprob), "top_logprobs": [self._named(t, v) for t, v in pairs]}

    def _prompt_entries(self, scored: tokenizer_pb2.PromptLogprobs, top: int) -> list[dict[str, Any]]:
        """Echo's log probabilities of the prompt tokens: the first has none (null)."""
        ids = list(scored.token_ids)
        first = {**self._named(ids[0], None), "top_logprobs": None} if ids else None
        rest = [self._entry(t, lp, top) for t, lp in zip(ids[1:], scored.logprobs, strict=True)]
        return [first, *rest] if first else rest

    def _vllm_form(self, scored: tokenizer_pb2.PromptLogprobs, top: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: null for the first token, then per token
        {token id: {logprob, rank, decoded_token}}, the token first and
        then its position's `top` most likely."""
        out: list[dict[str, Any] | None] = [None] if scored.token_ids else []
        for token, lp in zip(scored.token_ids[1:], scored.logprobs, strict=True):
            entry = {str(token): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": self._text(token)}}
            for rank, (t, v) in enumerate(list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))[:top], 1):
                entry.setdefault(str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": self._text(t)})
            out.append(entry)
        return out

    def _named(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = f"token_id:{token}" if self.tokens_as_ids else self._text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def _text(self, token: int) -> str:
        """A token's text, decoded once per answer (a long prompt's top
        tokens repeat: each decode is a call into the tokenizer)."""
        text = self._names.get(token)
        if text is None:
            text = self._names[token] = token_text(self.tokens, token) if self.tokens is not None else str(token)
        return text

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt.values())

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def usage_so_far(self) -> dict[str, Any]:
        """vLLM's continuous usage: the prompts whose ids came (GenerateRequest.return_prompt_token_ids)
        and the tokens streamed."""
        prompts = {i // self.per_prompt: len(ids) for i, ids in self.prompt_ids.items()}
        prompt, completion = sum(prompts.values()), sum(map(len, self.token_ids))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(self) -> dict[str, Any]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Shown:
    """What one response adds to a choice: text, a finish reason, and the
    log probabilities of its tokens (empty unless asked)."""

    text: str
    finish: str | None
    logprobs: list[dict[str, Any]]
    offset: int = 0  # the first entry's legacy text_offset: its choice's earlier tokens' characters
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens it adds
    prompt_ids: list[int] | None = None  # the choice's prompt (return_token_ids), before any output


def completion_logprobs(entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    """The legacy completions form of log probabilities. A token's
    text_offset counts the characters of the choice's tokens before it
    (from `start`, those of earlier chunks), as the text is when the
    tokens spell it (an echoed prompt's special tokens, a chat template
    the server applied to a plain prompt, and a stop string cut from the
    end do not)."""
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class Shape:
    """How one endpoint's objects look: chat completions or completions."""

    chat: bool
    id: str
    model: str
    created: int
    calls: Forced | Auto | None = None  # how the output answers with tool calls
    # vLLM's return_token_ids: the prompt's ids (chat: the answer's; completions:
    # each choice's) and each choice's generated ids; streamed, the prompt's in
    # each choice's first chunk (which then comes once they are known) and a
    # chunk's own ids in it.
    token_ids: bool = False
    # --reasoning-parser: a chat answer's thinking apart from its content
    # (the request then asks for the prompt's ids, which say whether the
    # model starts inside its thinking). `constrained`: its output is
    # structured (a grammar from the first token), which a prompt that
    # opens the model's thinking cannot take.
    reasoning: Think | None = None
    constrained: bool = False
    shows_reasoning: bool = True  # vLLM's include_reasoning: false drops the thinking from the answer
    # A stream's named-function calls: each choice's call id, once its first chunk went.
    _opened: dict[int, str] = dataclasses.field(default_factory=dict, compare=False)
    # A stream under "auto": each choice's characters sent as content.
    _sent: dict[int, int] = dataclasses.field(default_factory=dict, compare=False)
    # With `reasoning`: whether each choice starts inside its thinking, and
    # each one's stream of it.
    _thinks: dict[int, bool] = dataclasses.field(default_factory=dict, compare=False)
    _streams: dict[int, Stream] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def of(
        cls,
        chat: bool,
        rid: str,
        model: str,
        calls: Forced | Auto | None = None,
        *,
        token_ids: bool = False,
        reasoning: Think | None = None,
        constrained: bool = False,
        shows_reasoning: bool = True,
    ) -> Shape:
        kind = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, kind + rid, model, int(time.time()), calls, token_ids, reasoning, constrained, shows_reasoning)

    def prompted(self, i: int, prompt_ids: list[int]) -> None:
        """Choice `i`'s prompt is known (its PromptTokens event, before any
        of its output, read whether or not it is shown): whether its model
        starts inside its thinking (`Think.start`)."""
        if self.reasoning is not None and self.chat:
            self._thinks[i] = self.reasoning.start(prompt_ids, self.constrained)

    def _thought(self, i: int, text: str, final: bool) -> tuple[str | None, str]:
        """Choice `i`'s (reasoning, content) of its output so far."""
        assert self.reasoning is not None
        return self.reasoning.split(text, self._thinks.get(i, False), final)

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""), "created": self.created,
                "model": self.model}  # fmt: skip

    def complete(self, choices: Choices, logprobs: bool = False) -> dict[str, Any]:
        out = self._head(chunk=False)
        out["choices"] = []
        for i, (text, f) in enumerate(zip(choices.text, choices.finish, strict=True)):
            lps = self._logprobs(choices.logprobs[i]) if logprobs else None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reasoning = None
                if self.reasoning is not None:
                    reasoning, text = self._thought(i, text, final=True)
                    shown = reasoning if self.shows_reasoning else None
                    # vLLM's: a part that is empty is null (the content, where there was thinking).
                    message = {"role": "assistant", "content": text if reasoning is None else text or None,
                               "reasoning": shown or None, "reasoning_content": shown or None}  # fmt: skip
                content, calls = self.calls.split(text) if self.calls else (text, None)
                if calls:
                    message = {**message, "content": content, "tool_calls": calls}
                    f = "tool_calls" if f == "stop" else f
                out["choices"].append({"index": i, "message": message, "logprobs": lps, "finish_reason": f})
            else:
                out["choices"].append({"index": i, "text": text, "logprobs": lps, "finish_reason": f})
                if choices.echo.prompt_logprobs is not None:
                    out["choices"][-1]["prompt_logprobs"] = choices.prompt_logprobs.get(i)
                if self.token_ids:
                    out["choices"][-1]["prompt_token_ids"] = choices.prompt_ids.get(i)
            if self.token_ids:
                out["choices"][-1]["token_ids"] = choices.token_ids[i]
        if self.chat and choices.echo.prompt_logprobs is not None:  # vLLM's: the request's, once
            out["prompt_logprobs"] = choices.prompt_logprobs.get(0)
        if self.chat and self.token_ids:  # vLLM's: the request's, once
            out["prompt_token_ids"] = choices.prompt_ids.get(0)
        out["usage"] = self._usage(choices)
        return out

    def _usage(self, choices: Choices) -> dict[str, Any]:
        """The usage, with --reasoning-parser the tokens of the thinking
        among the completion's (OpenAI's completion_tokens_details)."""
        usage = choices.usage()
        if self.reasoning is not None and self.chat:
            thinking = sum(self.reasoning.tokens(ids, self._thinks.get(i, False), choices.text[i])
                           for i, ids in enumerate(choices.token_ids))  # fmt: skip
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return usage

    def _logprobs(self, entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
        """Chat's form, or the legacy one with text offsets from `start`."""
        return {"content": entries} if self.chat else completion_logprobs(entries, start)

    def first(self, i: int, prompt_ids: list[int] | None = None) -> dict[str, Any] | None:
        """A chat stream's first chunk of a choice: the assistant's role
        (with return_token_ids, sent with the prompt's ids once they come)."""
        if not self.chat or (self.token_ids and prompt_ids is None):
            return None
        out = self.chunk(i, {"role": "assistant", "content": ""}, None)
        if prompt_ids is not None:
            out["prompt_token_ids"] = prompt_ids
        return out

    def delta(self, i: int, shown: Shown, text: str = "") -> dict[str, Any] | None:
        """The chunk of what a response adds to choice `i` (None: nothing to
        send yet); `text`: the choice's output so far, this response's
        included (its tool calls, when they are made at the end)."""
        if self.token_ids and shown.prompt_ids is not None:
            return self._prompted(i, shown)
        out = (
            self._thinking(i, shown, text) if self.reasoning is not None and self.chat else self._delta(i, shown, text)
        )
        if self.token_ids and (out is not None or shown.token_ids):
            # A chunk's tokens go with it, or alone when its text is held back.
            out = out or self.chunk(i, {}, None)
            out["choices"][0]["token_ids"] = shown.token_ids
        return out

    def _prompted(self, i: int, shown: Shown) -> dict[str, Any] | None:
        """A choice's first chunk with return_token_ids: chat's role with the
        prompt's ids (vLLM's, at the chunk's top), completions' echoed text
        (if any) with them in the choice."""
        if self.chat:
            return self.first(i, shown.prompt_ids)
        out = self.chunk(i, {"content": shown.text}, None)
        out["choices"][0]["prompt_token_ids"] = shown.prompt_ids
        return out

    def _thinking(self, i: int, shown: Shown, text: str) -> dict[str, Any] | None:
        """A chunk of a chat answer with --reasoning-parser: the new
        reasoning as `reasoning` (and `reasoning_content`), the new content
        as any answer's content (tool calls found in it alone)."""
        stream = self._streams.get(i) or self._streams.setdefault(i, Stream(self._thinks.get(i, False)))
        thought, added = stream.feed(text, final=shown.finish is not None)
        thought = thought if self.shows_reasoning else ""
        new = dataclasses.replace(shown, text=added)
        # The content so far, for the tool calls in it (read whole) only.
        content = stream.content(text) if self.calls is not None else ""
        out = self._delta(i, new, content) if self.calls is not None or new.text or shown.finish else None
        if thought:
            out = out or self.chunk(
                i, {}, None, self._logprobs(shown.logprobs, shown.offset) if shown.logprobs else None
            )
            delta = out["choices"][0]["delta"]
            out["choices"][0]["delta"] = {"reasoning": thought, "reasoning_content": thought, **delta}
        elif out is None and shown.logprobs:
            out = self.chunk(i, {}, None, self._logprobs(shown.logprobs, shown.offset))
        return out

    def _delta(self, i: int, shown: Shown, text: str) -> dict[str, Any] | None:
        logprobs = self._logprobs(shown.logprobs, shown.offset) if shown.logprobs else None
        if isinstance(self.calls, Forced) and self.chat:
            return self._called(i, shown, text, logprobs)
        if isinstance(self.calls, Auto) and self.chat:
            return self._auto(i, shown, text, logprobs)
        delta = {"content": shown.text} if shown.text or not shown.finish else {}
        return self.chunk(i, delta, shown.finish, logprobs)

    def _called(self, i: int, shown: Shown, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        """A forced tool call's chunks: a named function's arguments as they
        come (its id and name with the first); "required"'s list of calls,
        whole, at the end (it is parsed then); a choice whose output is not
        calls (cut short) ends as content."""
        assert isinstance(self.calls, Forced)
        finish = shown.finish
        if self.calls.name:
            delta: dict[str, Any] = {}
            if shown.text or (finish and i not in self._opened):
                call: dict[str, Any] = {"index": 0, "function": {"arguments": shown.text}}
                if i not in self._opened:
                    self._opened[i] = call_id()
                    call = {"index": 0, "id": self._opened[i], "type": "function",
                            "function": {"name": self.calls.name, "arguments": shown.text}}  # fmt: skip
                delta = {"tool_calls": [call]}
            return self.chunk(i, delta, "tool_calls" if finish == "stop" else finish, logprobs)
        if not finish:
            return self.chunk(i, {}, None, logprobs) if logprobs else None
        return self._ended(i, text, finish, logprobs, sent=0)

    def _auto(self, i: int, shown: Shown, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        """tool_choice "auto": the text streams as content up to a call's
        opening (or a tail that may become one); at the end, the rest of
        the content and the calls, parsed from the whole output."""
        assert isinstance(self.calls, Auto)
        sent = self._sent.get(i, 0)
        if shown.finish:
            return self._ended(i, text, shown.finish, logprobs, sent)
        upto = self.calls.held(text, sent)
        if upto <= sent:
            return self.chunk(i, {}, None, logprobs) if logprobs else None
        self._sent[i] = upto
        return self.chunk(i, {"content": text[sent:upto]}, None, logprobs)

    def _ended(self, i: int, text: str, finish: str, logprobs: dict[str, Any] | None, sent: int) -> dict[str, Any]:
        """A choice's last chunk: the content not yet sent (all of the rest
        when the output holds no calls) and its calls."""
        assert self.calls is not None
        content, calls = self.calls.split(text)
        if calls is None:
            return self.chunk(i, {"content": text[sent:]}, finish, logprobs)
        delta: dict[str, Any] = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        if content and len(content) > sent:
            delta["content"] = content[sent:]
        return self.chunk(i, delta, "tool_calls" if finish == "stop" else finish, logprobs)

    def chunk(
        self, i: int, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = self._head(chunk=True)
        if self.chat:
            out["choices"] = [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        else:
            text = delta.get("content", "")
            out["choices"] = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]
        return out

    def usage_chunk(self, choices: Choices) -> dict[str, Any]:
        out = self._head(chunk=True)
        out["choices"] = []
        out["usage"] = self._usage(choices)
        return out

    # A stream's events, as http_api writes every kind of answer's stream
    # (`openai_responses.Answer` has the same methods).

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Before any output: each choice's first chunk (chat: the role)."""
        return [chunk for i in range(n) if (chunk := self.first(i)) is not None]

    def step(self, i: int, shown: Shown, text: str) -> list[dict[str, Any]]:
        chunk = self.delta(i, shown, text)
        return [] if chunk is None else [chunk]

    def closing(self, choices: Choices, include_usage: bool) -> list[dict[str, Any]]:
        return [self.usage_chunk(choices)] if include_usage else []

    @staticmethod
    def failure(body: dict[str, Any]) -> dict[str, Any]:
        """The event of an error after the stream began (`body`: the OpenAI error body)."""
        return body

    @staticmethod
    def rename(exc: MmsplitError) -> MmsplitError:
        """An error of this request as the API names its fields (chat's: as it is)."""
        return exc

    @staticmethod
    def sse(event: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    DONE: ClassVar[bytes] = b"data: [DONE]\n\n"
