"""Tool calls in a model's output, for the OpenAI API's `tool_choice`
(tokenizer_svc/openai_api.py maps the request's fields,
tokenizer_svc/openai_answers.py shapes the answer): each way of finding them splits a choice's whole output into its
content and its calls (OpenAI's `tool_calls` entries: an id, the name, the
arguments as JSON text), and never loses text it cannot read as calls.

- `Forced`: a named function or "required", where the output was
  constrained (the request's json_schema) to the arguments, or to a list of
  {"name", "parameters"} calls;
- `Auto`: "auto" with a --tool-call-parser, where the model writes its
  calls in its own format: `Hermes` (``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` after any text), `Llama3Json` (Llama
  3.1's ``{"name": ..., "parameters": {...}}``, calls joined by ``;``, the
  whole output) and `Pythonic` (``[get_weather(city="Oslo"), ...]``, the
  whole output, as Llama 3.2 and 4 write them) and `Qwen3Coder`
  (``<tool_call><function=NAME><parameter=KEY>value</parameter>...``,
  Qwen3-Coder's, after any text; each value typed by the tool's schema);
  `PARSERS` names them.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mmsplit_server import strict_json, structured
from tokenizer_svc.errors import InvalidRequest


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
            listed = strict_json.loads(text)
        except json.JSONDecodeError:
            return text, None
        if not isinstance(listed, list) or not all(isinstance(c, dict) and "name" in c for c in listed):
            return text, None
        return None, [
            _tool_call(str(c["name"]), json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in listed
        ]


@dataclass(frozen=True)
class Auto:
    """tool_choice "auto": the model decides, writing its calls in its own
    format, which a subclass reads. Each answers `split` (a choice's whole
    output as content and calls) and `held` (how much of a streamed output
    may go out as content now)."""

    # parallel_tool_calls false: the first call only (the rest of the output is dropped, as after the calls).
    single: bool = False
    # The request's tools' parameters by name (a format whose values are text reads their types here).
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(the content, or None when there is none; the calls), or (the
        whole text, None) when it holds no call or one that does not parse:
        nothing of it is lost."""
        found = self._calls(text)
        if found is None:
            return text, None
        content, calls = found
        return content, calls[:1] if self.single else calls

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        raise NotImplementedError

    def held(self, text: str, start: int = 0) -> int:
        """Where a stream's content must stop for now (`start`: what was
        sent already, which holds no call)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Whole(Auto):
    """A format whose calls are the whole output (blanks around them
    aside) or none of it: an output that starts as a call may be one, so it
    is held to its end; any other output is content as it comes."""

    # What the output starts with when it is calls (its special token, if the text keeps it, first).
    STARTS: ClassVar[tuple[str, ...]] = ()

    def held(self, text: str, start: int = 0) -> int:
        if start:
            return len(text)
        head = text.lstrip()
        if any(s.startswith(head) or head.startswith(s) for s in self.STARTS):
            return 0
        return len(text)

    def _body(self, text: str) -> str | None:
        """The output without blanks around it and its special opening;
        None when it does not start as calls do."""
        body = text.strip()
        if not body.startswith(self.STARTS):
            return None
        return body.removeprefix(self.STARTS[0]).strip() if len(self.STARTS) > 1 else body


@dataclass(frozen=True)
class Hermes(Auto):
    """`--tool-call-parser hermes`: the model writes each call as
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Qwen2.5's and many others' format), after any text."""

    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        at = text.find(self.OPEN)
        if at < 0:
            return None
        calls = []
        for body, _ in _tagged(text, at, self.OPEN, self.CLOSE):
            try:
                call = strict_json.loads(body.strip())
            except json.JSONDecodeError:
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            calls.append(_tool_call(call["name"], _arguments(call.get("arguments", {}))))
        if not calls:
            return None
        return text[:at].rstrip() or None, calls

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


@dataclass(frozen=True)
class Llama3Json(Whole):
    """`--tool-call-parser llama3_json`: Llama 3.1's JSON calls, the whole
    output: ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
    several joined by ``;``, after ``<|python_tag|>`` when the text keeps
    that special token."""

    STARTS: ClassVar[tuple[str, ...]] = ("<|python_tag|>", "{")

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        body = self._body(text)
        if body is None:
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            try:
                call, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            calls.append(_tool_call(call["name"], _arguments(call.get("parameters", call.get("arguments", {})))))
            rest = body[at:].lstrip()
            if not rest:
                return None, calls
            if not rest.startswith(";"):
                return None
            at = len(body) - len(rest[1:].lstrip())


@dataclass(frozen=True)
class Pythonic(Whole):
    """`--tool-call-parser pythonic`: a Python list of calls with keyword
    arguments of literals, the whole output, ``[get_weather(city="Oslo"),
    ...]`` (Llama 3.2's and 4's format; Llama 4 wraps it in
    ``<|python_start|>`` and ``<|python_end|>``, special tokens that the
    text may keep). Read by Python's own parser, never evaluated."""

    STARTS: ClassVar[tuple[str, ...]] = ("<|python_start|>", "[")

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        body = self._body(text)
        if body is None:
            return None
        body = body.removesuffix("<|python_end|>").rstrip()
        try:
            listed = ast.parse(body, mode="eval").body
            if not isinstance(listed, ast.List) or not listed.elts:
                return None
            calls = []
            for call in listed.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                    return None
                arguments = {}
                for k in call.keywords:
                    if k.arg is None:  # **kwargs
                        return None
                    arguments[k.arg] = ast.literal_eval(k.value)
                calls.append(_tool_call(call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            # Not Python, not literals, or not JSON's values (a set, bytes, a NaN).
            return None
        return None, calls


@dataclass(frozen=True)
class Qwen3Coder(Hermes):
    """`--tool-call-parser qwen3_coder`: Qwen3-Coder's calls, after any text,
    each ``<tool_call>`` + ``<function=NAME>`` + a ``<parameter=KEY>`` value
    ``</parameter>`` per argument + ``</function>`` + ``</tool_call>`` (one
    line break around a value is the format's, not the value's). A value is
    text: it becomes the type the tool's schema gives its parameter, as
    vLLM's parser reads it: ``null`` is null; a string stays text; an
    integer, number or boolean is read as one (else kept as text); any other
    type, or none, is read as JSON (else kept as text); a parameter the
    schema does not name stays text. A call with anything else in it, or
    not closed, is no call: the whole output is content."""

    FUNCTION: ClassVar[str] = "<function="

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        at = text.find(self.OPEN)
        if at < 0:
            return None
        calls, end = [], at
        for body, (start, stop) in _tagged(text, at, self.OPEN, self.CLOSE):
            if text[end:start].strip():
                return None  # text between calls: not this format's
            end = stop
            inner = body.strip()
            named = inner.find(">")
            if not inner.startswith(self.FUNCTION) or named < 0 or not inner.endswith("</function>"):
                return None
            name = inner[len(self.FUNCTION) : named].strip()
            if not name or "\n" in name:
                return None
            found = self._parameters(inner[named + 1 : -len("</function>")], name)
            if found is None:
                return None
            calls.append(_tool_call(name, _arguments(found)))
        if not calls or text[end:].strip():
            return None
        return text[:at].rstrip() or None, calls

    def _parameters(self, body: str, name: str) -> dict[str, Any] | None:
        """A call's ``<parameter=KEY>value</parameter>`` arguments, typed by
        the tool's schema; None when the body holds anything else."""
        properties = self.schemas.get(name, {}).get("properties")
        arguments: dict[str, Any] = {}
        end = 0
        for value, (start, stop) in _tagged(body, 0, "<parameter=", "</parameter>"):
            if body[end:start].strip():
                return None
            end = stop
            named = value.find(">")
            key = value[:named].strip()
            if named < 0 or not key or "\n" in key:
                return None
            value = value[named + 1 :].removeprefix("\n").removesuffix("\n")
            spec = properties.get(key) if isinstance(properties, dict) else None
            arguments[key] = _typed(value, spec if isinstance(spec, dict) else None)
        return None if body[end:].strip() else arguments


def _tagged(text: str, at: int, open_tag: str, close_tag: str) -> Iterator[tuple[str, tuple[int, int]]]:
    """Each ``open_tag``...``close_tag`` from `at` on: its inside, and where
    the whole of it starts and ends. One pass: an opening with no closing
    after it ends the search (a lazy regex would scan to the end from each
    such opening)."""
    while (start := text.find(open_tag, at)) >= 0:
        inside = start + len(open_tag)
        close = text.find(close_tag, inside)
        if close < 0:
            return
        at = close + len(close_tag)
        yield text[inside:close], (start, at)


def _typed(value: str, spec: dict[str, Any] | None) -> Any:
    """A qwen3_coder parameter's text as its schema's type (`spec`: the
    parameter's schema; None: the schema does not name it)."""
    if spec is None:
        return value
    if value.strip().lower() == "null":
        return None
    kinds = spec.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if kinds & {"string", "str", "text"}:
        return value
    text = value.strip()
    try:
        if "integer" in kinds:
            return int(text)
        if "number" in kinds:
            try:
                return int(text)
            except ValueError:
                number = float(text)
            return number if math.isfinite(number) else value
        if "boolean" in kinds:
            return {"true": True, "false": False}[text.lower()]
        return strict_json.loads(text)
    except (ValueError, KeyError, RecursionError):
        return value


# --tool-call-parser's values.
PARSERS: dict[str, type[Auto]] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "pythonic": Pythonic,
    "qwen3_coder": Qwen3Coder,
}
_NEEDS_PARSER = (
    'tool_choice "auto" needs the tool calls a model writes in its own format found, and this server was started '
    'without a --tool-call-parser; ask for "required" or name a function, or send tool_choice "none"'
)


def choose(
    choice: str, schemas: dict[str, dict[str, Any]], parser: str, *, single: bool = False
) -> tuple[Forced | Auto, str]:
    """How an output answers with calls, and the JSON Schema that constrains
    it (empty for "auto", whose calls the model writes in its own format,
    found by `parser`): `choice` is "auto", "required" or a tool's name
    (`schemas`: each tool's parameters). `single`: at most one call. A
    choice that cannot be served is INVALID_REQUEST naming tool_choice."""
    if choice == "auto":
        if parser not in PARSERS:
            raise InvalidRequest(_NEEDS_PARSER, metadata={"param": "tool_choice"})
        return PARSERS[parser](single=single, schemas=schemas), ""
    if choice == "required":
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in schemas.items()
        ]  # fmt: skip
        listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if single:
            listed["maxItems"] = 1
        return Forced(""), json.dumps(listed)
    if choice not in schemas:
        raise InvalidRequest(
            f"tool_choice names {choice!r}, which is not among the tools", metadata={"param": "tool_choice"}
        )
    return Forced(choice), json.dumps(schemas[choice])


async def check_schema(schema: str) -> None:
    """A forced call's schema (made of the tools' parameters), compiled off
    the event loop, so that one that cannot be is the tools' fault in the
    error, not the structured output's (the service finds it compiled)."""
    await structured.compile_off_loop(("json_schema", schema))
    try:
        structured.grammar(("json_schema", schema))
    except ValueError as exc:
        raise InvalidRequest(f"the tool's parameters (a JSON Schema) {exc}", metadata={"param": "tools"}) from None


def call_id() -> str:
    """A new call's id, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": call_id(), "type": "function", "function": function}


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
