"""Tool calls in a model's output, for the OpenAI API's `tool_choice`
(tokenizer_svc/openai_api.py maps the request's fields and shapes the
answer): each way of finding them splits a choice's whole output into its
content and its calls (OpenAI's `tool_calls` entries: an id, the name, the
arguments as JSON text), and never loses text it cannot read as calls.

- `Forced`: a named function or "required", where the output was
  constrained (the request's json_schema) to the arguments, or to a list of
  {"name", "parameters"} calls;
- `Hermes`: "auto" with --tool-call-parser hermes, where the model writes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` itself.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Forced:
    """tool_choice "required" (`name` empty: the output is a JSON list of
    {"name", "parameters"} objects, one per call) or a named function (the
    output is its arguments). Either is the request's json_schema, so the
    output is such a document (unless max_tokens cut it short)."""

    name: str

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A choice's whole output as (content, tool calls): the calls and no
        content, or, when it is not calls (cut short), the text as content."""
        if self.name:
            return None, [_tool_call(self.name, text)]
        try:
            listed = json.loads(text)
        except json.JSONDecodeError:
            return text, None
        if not isinstance(listed, list) or not all(isinstance(c, dict) and "name" in c for c in listed):
            return text, None
        return None, [
            _tool_call(str(c["name"]), json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in listed
        ]


@dataclass(frozen=True)
class Hermes:
    """tool_choice "auto" with `--tool-call-parser hermes`: the model
    writes each call as ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` (Qwen2.5's and many others' format), after any text."""

    OPEN = "<tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
    # parallel_tool_calls false: the first call only (the rest of the output is dropped, as after the calls).
    single: bool = False

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(the text before the first call, or None when there is none; the
        calls), or (the whole text, None) when it holds no call or one that
        does not parse: nothing of it is lost."""
        at = text.find(self.OPEN)
        if at < 0:
            return text, None
        calls = []
        for found in self.CALL.finditer(text, at):
            try:
                call = json.loads(found.group(1))
            except json.JSONDecodeError:
                return text, None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, None
            calls.append(_tool_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        if not calls:
            return text, None
        return text[:at].rstrip() or None, calls[:1] if self.single else calls

    def held(self, text: str, start: int = 0) -> int:
        """Where a stream's content must stop for now: at a call's opening,
        or before a tail that may become one, and before the blanks that
        may precede one (the content then ends where `split`'s does).
        `start`: what was sent already, which holds no opening (so each
        delta searches only what is new, not the whole output again)."""
        upto = text.find(self.OPEN, start)
        if upto < 0:
            upto = len(text)
            for n in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
                if self.OPEN.startswith(text[-n:]):
                    upto -= n
                    break
        while upto and text[upto - 1].isspace():
            upto -= 1
        return upto


def call_id() -> str:
    """A new call's id, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": call_id(), "type": "function", "function": function}
