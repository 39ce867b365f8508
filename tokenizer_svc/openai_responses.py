"""The OpenAI Responses API (`POST /v1/responses`) over the chat path.

A Responses body becomes a chat completions body (`to_chat`), which
`openai_api.parse_chat` then checks and maps as it does any chat request,
errors naming the Responses field (`param`); the output of its one choice
becomes a Response object, or its stream of typed events (`Answer`).

What is taken: `input` (a string, or items: messages with role user,
system, developer or assistant and content a string or parts `input_text`,
`input_image` with an `image_url`, `output_text`; `function_call` and
`function_call_output` items, a conversation's earlier tool calls and
their results), `instructions` (a system message first), `max_output_tokens`,
`temperature`, `top_p`, `text.format` (text, json_object, json_schema:
structured output), `include: ["message.output_text.logprobs"]` with
`top_logprobs` (the text's log probabilities, as chat completions gives
them), `tools` (functions) and `tool_choice`,
`parallel_tool_calls`, `stream`, and the sampling fields the chat API takes
besides (`seed`, `stop`, vLLM's `top_k`, `min_p`...). `store` (true unless
false) keeps the answer in the tokenizer's memory
(`tokenizer_svc.response_store`) and `previous_response_id` continues a
kept one: its conversation comes before `input` (`to_chat`'s `history`).
With the tokenizer's --reasoning-parser, a thinking model's thinking is
a `reasoning` output item (its text a `reasoning_text` part) before the
message, streamed as `response.reasoning_text.delta` events; a
`reasoning` input item (an earlier output sent back) goes to the chat
template with the assistant turn after it, as chat's `reasoning_content`.
Refused, each a 400 naming its field: `conversation` objects, `background`,
hosted tools (web search, files...), file inputs and reasoning options.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mmsplit.errors import MmsplitError
from tokenizer_svc import openai_api
from tokenizer_svc.openai_answers import Choices, Shown
from tokenizer_svc.openai_api import invalid
from tokenizer_svc.reasoning import Stream, Think
from tokenizer_svc.tool_calls import Auto, Forced

# Field -> the values that ask for nothing (accepted) and why others are refused.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "conversation": ((None,), "this server stores no conversations: send the whole conversation as input"),
    "background": ((None, False), "this server answers in the request"),
    "prompt": ((None,), "this server has no stored prompts"),
    "reasoning": (
        (None, {}),
        "this server has no reasoning options (effort, summary): a reasoning model's "
        "thinking comes back as a reasoning item where the server has a --reasoning-parser",
    ),
    "truncation": ((None, "disabled"), "this server does not drop input to fit: too long an input is refused"),
    "max_tool_calls": ((None,), "the model's output decides the calls"),
}
# Responses fields that mean what chat completions' of the same name do.
_SAME = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "tool_choice", "seed", "stop",
         "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
         "logit_bias", "stop_token_ids", "ignore_eos", "cache_salt", "structured_outputs",
         "mm_processor_kwargs")  # fmt: skip
_ROLES = ("user", "system", "developer", "assistant")
# What `include` may ask for: the output text's log probabilities.
LOGPROBS = "message.output_text.logprobs"


def to_chat(body: Any, history: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The chat completions body of a Responses body, and where each of its
    messages came from (`instructions`, `input`, `input[3]`), to name a
    message's error by the Responses field. `history`: the conversation of
    the response `previous_response_id` names (chat messages), after the
    instructions and before the input."""
    body = openai_api.refuse(body, REFUSED)
    chat = {k: body[k] for k in _SAME if k in body}
    messages: list[dict[str, Any]] = []
    places: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
        places.append("instructions")
    for message in history or ():
        messages.append(dict(message))
        places.append("previous_response_id")
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        places.append("input")
    elif isinstance(given, list) and given:
        for k, item in enumerate(given):
            _item(item, f"input[{k}]", messages, places)
    else:
        raise invalid("input must be a string or a non-empty list of items", "input")
    chat["messages"] = messages
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS for i in include):
        raise invalid(f"include may only ask for {LOGPROBS!r}: this server adds nothing else", "include")
    top = body.get("top_logprobs")
    if include or top:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        form = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or not isinstance(form, dict | None):
            raise invalid("text must be an object with a format", "text")
        if form is not None:
            chat["response_format"] = _format(form)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be a list", "tools")
        chat["tools"] = [_tool(t, f"tools[{k}]") for k, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    return chat, places


def _item(item: Any, where: str, messages: list[dict[str, Any]], places: list[str]) -> None:
    """One input item as chat messages: a message, a call (joined to the
    assistant message before it, if any: the text and the calls of one
    answer are one assistant turn, as chat completions has them), a call's
    output."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object", where)
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
        content = _content(item.get("content"), where)
        if role == "assistant" and last is not None and _thought_alone(last):
            last["content"] = content  # the answer after its reasoning item: one assistant turn
            return
        messages.append({"role": role, "content": content})
    elif kind == "reasoning":
        # An earlier answer's thinking: the assistant turn its message (or calls) after it join.
        parts = item.get("content") or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise invalid(f"{where}.content must be a list of reasoning_text parts", f"{where}.content")
        messages.append({"role": "assistant", "content": None, "reasoning_content": "".join(p["text"] for p in parts)})
    elif kind in ("function_call", "function_call_output") and not _is_text(item.get("call_id")):
        raise invalid(f"{where}.call_id must name the call (a non-empty string)", f"{where}.call_id")
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise invalid(f"{where}.output must be a string", f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    else:
        raise invalid(
            f"{where}: item type {kind!r} is not supported (message, reasoning, function_call, function_call_output)",
            where,
        )
    places.append(where)


def _thought_alone(message: dict[str, Any]) -> bool:
    """An assistant turn of a reasoning item alone, so far."""
    return (
        message["role"] == "assistant"
        and message.get("content") is None
        and "tool_calls" not in message
        and ("reasoning_content" in message)
    )


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _content(content: Any, where: str) -> Any:
    """A message's content as chat's: a string, or its parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            if part.get("file_id") is not None:
                raise invalid(f"{at}: file_id is not supported (this server stores no files): give image_url", at)
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise invalid(f"{at}: part type {kind!r} is not supported (input_text, input_image, output_text)", at)
    return parts


def _format(form: dict[str, Any]) -> dict[str, Any]:
    """text.format as chat's response_format."""
    if form.get("type") == "json_schema":
        spec = {k: form[k] for k in ("name", "schema", "strict") if k in form}
        return {"type": "json_schema", "json_schema": spec}
    return form


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"{where}: tool type {kind!r} is not supported (function)", where)
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


# A chat field the chat parser names -> the Responses field it came from.
_RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format", "messages": "input"}  # fmt: skip
_MESSAGE = re.compile(r"messages\[(\d+)\]")


def rename(exc: MmsplitError, places: list[str]) -> MmsplitError:
    """`exc`, raised on the chat body (or by the service on its request),
    naming the Responses field."""
    param = exc.metadata.get("param") if exc.metadata else None
    if not param:
        return exc
    found = _MESSAGE.match(param)
    if found and int(found.group(1)) < len(places):
        param = places[int(found.group(1))] + param[found.end() :]
    exc.metadata["param"] = _RENAMED.get(param, param)
    return exc


@dataclass
class Answer:
    """One request's Response object, whole (`complete`) or as the events
    of a stream (`opening`, `step`, `closing`, `failure`), from its one
    choice (`Choices`). Tool calls come from the output, as in chat
    completions (`calls`); with tools, a stream's text is sent at the end,
    once it is known whether it is calls."""

    id: str
    model: str
    body: dict[str, Any]  # the Responses body but its input, echoed in the object
    calls: Forced | Auto | None = None
    places: list[str] = field(default_factory=list)  # where each chat message came from (`to_chat`)
    # Called with the final Response object (completed or incomplete) when it is to be stored.
    keep: Callable[[dict[str, Any]], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # --reasoning-parser, and whether the output is structured (as chat's `Shape`).
    reasoning: Think | None = None
    constrained: bool = False
    _thinks: bool = False  # the model starts inside its thinking (the prompt says)
    _stream: Stream | None = None  # the output's thinking and content as it streams
    _reasoning: int = -1  # characters of the reasoning item's text streamed; -1: no item opened
    _reasoning_done: bool = False
    _thought_parts: list[str] = field(default_factory=list)  # the reasoning item's text, as streamed
    _sequence: int = 0
    _text_open: bool = False
    _call_open: bool = False  # a named function's call item, added as its arguments began to stream
    _sent: int = 0  # characters of the message's text streamed
    # The named call's id: one for its stream and its final object (not the request id, which a client may reuse).
    _call_id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    DONE: ClassVar[bytes] = b""  # the stream ends with response.completed

    def complete(self, choices: Choices, logprobs: bool = False) -> dict[str, Any]:
        """The whole response (`logprobs`: asked, chat's argument; the
        Responses API's output text carries them when they were)."""
        return self._kept(self._response(choices))

    def prompted(self, i: int, prompt_ids: list[int]) -> None:
        """The prompt's ids: whether the model starts inside its thinking (`Think.start`)."""
        if self.reasoning is not None:
            self._thinks = self.reasoning.start(prompt_ids, self.constrained)

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far (no parser: all content)."""
        return (None, text) if self.reasoning is None else self.reasoning.split(text, self._thinks, final)

    def opening(self, n: int = 1) -> list[dict[str, Any]]:
        response = self._response(None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def step(self, i: int, shown: Shown, text: str = "") -> list[dict[str, Any]]:
        """The events of what one response adds: text deltas, with their
        tokens' log probabilities when asked; a named function's arguments
        as they come (its item added with the first); under "auto", the
        text up to where a call may begin (the calls are parsed at the
        end); nothing under "required". With --reasoning-parser, the
        thinking first, as its own item's deltas, and the rest from the
        content alone."""
        if self.reasoning is None:
            return self._step(shown, text)
        if self._stream is None:
            self._stream = Stream(self._thinks)
        thought, added = self._stream.feed(text, final=False)
        events = self._thought(thought, done=bool(added)) if self._stream.thinking else []
        # The tokens' log probabilities go with the content they made (the final object has them all).
        new = dataclasses.replace(shown, text=added, logprobs=shown.logprobs if added else [])
        content = self._stream.content(text) if self.calls is not None else ""  # read whole by the calls only
        return [*events, *self._step(new, content)]

    def _thought(self, delta: str, done: bool) -> list[dict[str, Any]]:
        """The reasoning item's events for what the thinking adds: added
        (item 0) the first time, its text's delta, and when `done` (the
        content began, or the output ended) its done events."""
        if self._reasoning_done:
            return []
        events = []
        if self._reasoning < 0:
            item = {"type": "reasoning", "id": self._reasoning_id, "status": "in_progress", "summary": [],
                    "content": []}  # fmt: skip
            events.append(self._event("response.output_item.added", output_index=0, item=item))
            self._reasoning = 0
        if delta:
            events.append(self._event("response.reasoning_text.delta", item_id=self._reasoning_id, output_index=0,
                                      content_index=0, delta=delta))  # fmt: skip
            self._reasoning += len(delta)
            self._thought_parts.append(delta)
        if done:
            self._reasoning_done = True
            whole = "".join(self._thought_parts)
            events += [
                self._event("response.reasoning_text.done", item_id=self._reasoning_id, output_index=0,
                            content_index=0, text=whole),
                self._event("response.output_item.done", output_index=0, item=_reasoning_item(self._reasoning_id,
                                                                                            whole)),
            ]  # fmt: skip
        return events

    def _thinking_tokens(self, choices: Choices) -> int:
        """The output's tokens that are its thinking (`Think.tokens`; none without a parser)."""
        return (
            0 if self.reasoning is None else self.reasoning.tokens(choices.token_ids[0], self._thinks, choices.text[0])
        )

    @property
    def _first(self) -> int:
        """The index of the output's first item after its reasoning item, if any."""
        return 1 if self._reasoning >= 0 else 0

    def _step(self, shown: Shown, text: str) -> list[dict[str, Any]]:
        if self._named is not None:
            return self._arguments(shown.text, index=self._first) if shown.text else []
        if isinstance(self.calls, Auto):
            upto = self.calls.held(text, self._sent)
            return self._text(text[self._sent : upto], []) if upto > self._sent else []
        if self.calls is not None or not (shown.text or shown.logprobs):
            return []
        return self._text(shown.text, shown.logprobs)

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A text delta of the message (the first item after any reasoning), after its opening events the
        first time."""
        events = [] if self._text_open else self._open_text(self._first)
        self._text_open = True
        self._sent += len(delta)
        return [*events, self._text_delta(self._first, delta, logprobs)]

    def closing(self, choices: Choices, include_usage: bool = True) -> list[dict[str, Any]]:
        """The output's items, each done (with tools: added and done), then
        the whole response (its usage in it)."""
        response = self._kept(self._response(choices))
        events: list[dict[str, Any]] = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":
                if not self._reasoning_done:  # the stream ended in its thinking (or held its tail)
                    events += self._thought(item["content"][0]["text"][max(self._reasoning, 0) :], done=True)
                continue
            if item["type"] == "message":
                part = item["content"][0]
                if not self._text_open:  # not streamed (under "required", or held): the text, whole, now
                    events += [*self._open_text(index), self._text_delta(index, part["text"], part["logprobs"])]
                elif rest := part["text"][self._sent :]:  # what "auto" held back, now that no call took it
                    events.append(self._text_delta(index, rest, []))
                events += [
                    self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                ]  # fmt: skip
            else:
                if not self._call_open:  # not streamed: added, its arguments whole, now
                    events += self._arguments(item["arguments"], item, index)
                done = {
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
                events.append(self._event("response.function_call_arguments.done", **done))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            self.keep(response)
        return response

    def failure(self, body: dict[str, Any]) -> dict[str, Any]:
        """A stream's error event (`body`: the OpenAI error body)."""
        error = body["error"]
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))

    def rename(self, exc: MmsplitError) -> MmsplitError:
        """An error of this request, naming the Responses field."""
        return rename(exc, self.places)

    @staticmethod
    def sse(event: dict[str, Any]) -> bytes:
        data = json.dumps(event, separators=(",", ":")).encode()
        return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"

    @property
    def _message_id(self) -> str:
        return "msg_" + self.id

    @property
    def _reasoning_id(self) -> str:
        return "rs_" + self.id

    def _open_text(self, index: int = 0) -> list[dict[str, Any]]:
        item = {"type": "message", "id": self._message_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                            content_index=0, part=part)]  # fmt: skip

    @property
    def _named(self) -> str | None:
        """The function a named tool_choice calls (its arguments stream)."""
        return self.calls.name if isinstance(self.calls, Forced) and self.calls.name else None

    def _arguments(self, delta: str, item: dict[str, Any] | None = None, index: int = 0) -> list[dict[str, Any]]:
        """A call's arguments delta, after its item's `added` event the first time."""
        item = item or self._call_item(self._named or "", "")
        events = []
        if not self._call_open:
            self._call_open = item["call_id"] == self._call_id
            opened = {**item, "status": "in_progress", "arguments": ""}
            events.append(self._event("response.output_item.added", output_index=index, item=opened))
        return [*events, self._event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=delta)]  # fmt: skip

    def _call_item(self, name: str, arguments: str, call_id: str = "") -> dict[str, Any]:
        call_id = call_id or self._call_id
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": "completed"}  # fmt: skip

    def _text_delta(self, index: int, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return self._event("response.output_text.delta", item_id=self._message_id, output_index=index,
                           content_index=0, delta=text, logprobs=logprobs)  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _response(self, choices: Choices | None) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        status, incomplete, usage = "in_progress", None, None
        if choices is not None:
            finish = choices.finish[0]
            reasoning, text = self._split(choices.text[0], final=True)
            if reasoning is not None:
                output.append(_reasoning_item(self._reasoning_id, reasoning))
            content, calls = self.calls.split(text) if self.calls else (text, None)
            if content or not calls:
                # Log probabilities (chat's entries: the same shape) of an answer that is all text.
                part = {"type": "output_text", "text": content or "", "annotations": [],
                        "logprobs": choices.logprobs[0] if not calls else []}  # fmt: skip
                output.append({"type": "message", "id": self._message_id, "status": "completed",
                               "role": "assistant", "content": [part]})  # fmt: skip
            for call in calls or []:
                function = call["function"]
                call_id = self._call_id if self._named else call["id"]  # the named call's streamed id
                output.append(self._call_item(function["name"], function["arguments"], call_id))
            cut = finish == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            chat_usage = choices.usage()
            usage = {
                "input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": chat_usage["prompt_tokens_details"],
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._thinking_tokens(choices)},
                "total_tokens": chat_usage["total_tokens"],
            }
        b = self.body
        text_format = (b.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": "resp_" + self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None, "incomplete_details": incomplete,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature", 0.0), "top_p": b.get("top_p", 1.0),
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto" if b.get("tools") else "none"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "text": {"format": text_format},
            "truncation": "disabled", "store": self.keep is not None, "metadata": b.get("metadata") or {},
            "previous_response_id": b.get("previous_response_id"), "reasoning": None, "user": b.get("user"),
        }  # fmt: skip


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    """A reasoning output item, done: the thinking as one reasoning_text part."""
    return {"type": "reasoning", "id": item_id, "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip
