"""The OpenAI-compatible API's requests: a JSON body into the contract's
GenerateRequest, and our errors into HTTP statuses and OpenAI error
bodies; the contract's events become chat and completion objects and
chunks in `tokenizer_svc.openai_answers`. No I/O here
(`tokenizer_svc.http_api` serves it).

What is accepted, as vLLM, SGLang and TGI accept it:
- `/v1/chat/completions`: `messages` with roles system (or developer),
  user, assistant; content a string or parts `text`, `image_url` (data: or
  http(s); `detail` is accepted and ignored: the model's processor decides
  the resolution), `video_url` (models that take video), and the untyped
  shorthands `{"image_url": "..."}` and `{"video_url": "..."}`.
- `/v1/completions`: `prompt`, a string, a list of token ids, or a list of
  up to MAX_PROMPTS of either (each its own generation, prompt p's choice j
  numbered p * n + j); `echo` (each choice's text starts with its prompt,
  and with `logprobs` its prompt tokens' log probabilities come first, the
  first token's null: what lm-evaluation-harness scores with); with
  `max_tokens: 0`, the prompt alone (OpenAI's and vLLM's way to score a
  text: `finish_reason` "length", no completion tokens).
- vLLM's `prompt_logprobs` (chat and completions, not streamed): each prompt
  token's log probability, rank and top tokens (`SamplingParams.prompt_logprobs`).
- Parameters: temperature, top_p, top_k, seed, stop (a string or a list),
  max_tokens and max_completion_tokens (the smaller when both), min_tokens,
  stop_token_ids, n (up to MAX_CHOICES), stream, stream_options.include_usage
  (and vLLM's continuous_usage_stats: the usage so far in every output chunk),
  logprobs and top_logprobs (chat: a boolean and 0 to 20; completions: the
  legacy integer, the number of top entries), presence_penalty,
  frequency_penalty, logit_bias (token ids as strings, as OpenAI's), vLLM's
  repetition_penalty, allowed_token_ids and bad_words,
  return_tokens_as_token_ids (log probabilities name tokens "token_id:<id>"),
  truncate_prompt_tokens (the rendered prompt's last N tokens; -1: as many
  as the context holds; never through a media item; not with echo),
  priority (the scheduler's admission order, lower first, where it runs
  --scheduling-policy priority), use_beam_search with length_penalty (the
  n best beams; `GenerateRequest.beam_search` says what goes with it),
  `response_format` (text, json_object, json_schema: the contract's
  `SamplingParams.json_schema`, structured output), and vLLM's
  `cache_salt` (a tenant's prefix-cache isolation). The usage reports
  `prompt_tokens_details.cached_tokens`: prompt tokens the scheduler took
  from its prefix cache. vLLM's `mm_processor_kwargs` with `max_pixels`
  and `min_pixels`: a Qwen-VL model's images resized within that budget,
  `max_dynamic_patch` and `min_dynamic_patch`: an InternVL model's images
  cut into that many tiles (GenerateRequest.image_budget), `fps` and
  `max_frames` (GenerateRequest.video_budget; other keys refused).
- Tools (chat only): `tools` reach the chat template (the contract's
  `GenerateRequest.tools`); `tool_choice` a named function or "required"
  constrains the output with a JSON Schema built from the tools (`Forced`),
  "auto" finds the calls the model writes itself with the tokenizer's
  --tool-call-parser (an `Auto`: hermes, llama3_json, pythonic, qwen3_coder), refused without one; calls answer as
  `tool_calls`. Assistant messages' `tool_calls` and tool messages go back
  into the conversation.
- Refused (400, `param` naming the field): the OpenAI fields whose meaning
  this server cannot honour (`UNHONOURED`: the deprecated functions, audio
  output, suffix...) when set to anything but their do-nothing value.
  Answering as if they were absent would hand a client that asked for them
  plain text and no sign why. Other unknown fields are ignored (logged at
  debug).

The HTTP status of each ErrorCode is one table (`STATUS`), next to the gRPC
one in `mmsplit.errors`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server import strict_json
from mmsplit_server.sampling import MAX_TOP_LOGPROBS
from mmsplit_server.serving import Handed
from tokenizer_svc.conversation import MAX_CACHE_SALT, MAX_CHOICES, MAX_VIDEO_FPS, MEDIA, check_sizes, without
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.tool_calls import Auto, Forced, choose

log = logging.getLogger(__name__)

_U63 = (1 << 63) - 1
_U32 = (1 << 32) - 1
_I31 = (1 << 31) - 1

# ErrorCode -> (HTTP status, OpenAI error type). Retriable codes also get
# Retry-After; every error says x-should-retry, so the OpenAI SDK (which
# retries 408, 409, 429 and every 5xx unless told) never resends a request
# that cannot succeed, and does resend one that may.
STATUS: dict[int, tuple[int, str]] = {
    E.ERROR_CODE_INVALID_REQUEST: (400, "invalid_request_error"),
    E.ERROR_CODE_MEDIA_DECODE_FAILED: (400, "invalid_request_error"),
    E.ERROR_CODE_MEDIA_UNSUPPORTED: (400, "invalid_request_error"),
    E.ERROR_CODE_MEDIA_NOT_FOUND: (400, "invalid_request_error"),
    E.ERROR_CODE_MEDIA_TOO_LARGE: (413, "invalid_request_error"),
    E.ERROR_CODE_MEDIA_SOURCE_FORBIDDEN: (403, "permission_error"),
    E.ERROR_CODE_UNAUTHENTICATED: (401, "authentication_error"),
    E.ERROR_CODE_OVERLOADED: (429, "rate_limit_error"),
    E.ERROR_CODE_MEDIA_FETCH_FAILED: (502, "server_error"),
    E.ERROR_CODE_PREPROCESS_TIMEOUT: (504, "server_error"),
    E.ERROR_CODE_DEADLINE_EXCEEDED: (504, "server_error"),
    E.ERROR_CODE_PREPROCESS_WORKER_CRASHED: (503, "server_error"),
    E.ERROR_CODE_FEATURE_TRANSPORT_FAILED: (503, "server_error"),
    E.ERROR_CODE_SCHEDULER_UNAVAILABLE: (503, "server_error"),
    E.ERROR_CODE_SHUTTING_DOWN: (503, "server_error"),
    E.ERROR_CODE_CANCELLED: (499, "invalid_request_error"),  # the client went away; nobody reads it
    E.ERROR_CODE_INTERNAL: (500, "server_error"),
}
NOT_FOUND = (404, "not_found_error")
ROLES = {
    "system": tokenizer_pb2.CHAT_ROLE_SYSTEM,
    "developer": tokenizer_pb2.CHAT_ROLE_SYSTEM,
    "user": tokenizer_pb2.CHAT_ROLE_USER,
    "assistant": tokenizer_pb2.CHAT_ROLE_ASSISTANT,
    "tool": tokenizer_pb2.CHAT_ROLE_TOOL,
}
KNOWN = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "min_tokens", "stop_token_ids", "n", "stream", "stream_options", "logprobs", "top_logprobs", "user",
    "cache_salt", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format",
    "tools", "tool_choice", "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "min_p", "ignore_eos", "echo", "prompt_logprobs",
    "include_stop_str_in_output", "continue_final_message", "add_generation_prompt", "chat_template_kwargs",
    "mm_processor_kwargs", "return_token_ids", "skip_special_tokens", "allowed_token_ids", "bad_words",
    "return_tokens_as_token_ids", "truncate_prompt_tokens", "priority", "documents", "spaces_between_special_tokens",
    "chat_template", "use_beam_search", "length_penalty", "request_id", "add_special_tokens", "include_reasoning",
}  # fmt: skip

# Prompts one completions request may give (each its own generation).
MAX_PROMPTS = 16
# vLLM's names for an InternVL image's tile bounds in mm_processor_kwargs -> ImageBudget's.
TILE_KWARGS = {"max_dynamic_patch": "max_tiles", "min_dynamic_patch": "min_tiles"}
# The most a pixel bound may say (GenerateRequest.image_budget's fields are 32-bit).
MAX_PIXELS = (1 << 32) - 1
# The json_schema of "any JSON object" (response_format json_object).
ANY_OBJECT = '{"type": "object"}'
# Field -> (the values that ask for nothing, and are accepted; why any other
# value is refused).
_FUNCTIONS = "the deprecated functions API is not served: use tools and tool_choice"
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), _FUNCTIONS),
    "function_call": ((None, "none"), _FUNCTIONS),
    "modalities": ((None, ["text"]), "this server answers in text only"),
    "audio": ((None,), "this server answers in text only"),
    "suffix": ((None, ""), "this server does not insert text"),
    "best_of": ((None, 1), "this server returns every choice it makes (use n)"),
    "web_search_options": ((None,), "this server does not search the web"),
    # vLLM's extensions that this server does not serve (those it does are in KNOWN).
    "logits_processors": ((None, []), "this server runs no custom logits processors"),
}


class BodyTimeout(InvalidRequest):
    """The request's body did not arrive within --http-request-timeout-s:
    the client's (INVALID_REQUEST), answered 408 Request Timeout."""

    http_status = 408


def error_body(exc: MmsplitError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of an error response."""
    status, kind = STATUS.get(exc.error_code, (500, "server_error"))
    status = getattr(exc, "http_status", status)
    return status, error_json(exc.message, kind, exc.reason, param_name(exc)), retry_headers(exc)


def error_json(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def retry_headers(exc: MmsplitError) -> dict[str, str]:
    if not exc.kind.retriable:
        return {"x-should-retry": "false"}
    seconds = max(1, math.ceil(exc.retry_after_ms / 1000)) if exc.retry_after_ms else 1
    return {"x-should-retry": "true", "Retry-After": str(seconds)}


@dataclass
class Call:
    """A parsed request (the contract's, n included) and how to answer.
    Its first request is handed to the service (`hand_over`), the call
    keeping a copy without the media; its fields are otherwise not changed
    once made (`dataclasses.replace` makes another)."""

    request: tokenizer_pb2.GenerateRequest
    n: int
    stream: bool
    include_usage: bool
    # How the output answers with tool calls (None: as content only).
    calls: Forced | Auto | None = None
    # Completions of several prompts: the requests of the second and later
    # (the first is `request`); prompt p's choice j is choice p * n + j.
    others: tuple[tokenizer_pb2.GenerateRequest, ...] = ()
    # Completions: each choice's text (and, with logprobs, its log
    # probabilities) starts with its prompt's.
    echo: bool = False
    # vLLM's prompt_logprobs: how many top tokens each prompt token's entry
    # names (None: not asked). The requests ask for the most that `echo`
    # and this need (`SamplingParams.prompt_logprobs`).
    prompt_logprobs: int | None = None
    # vLLM's return_token_ids: the prompt's ids and each choice's generated
    # ids in the answer (GenerateRequest.return_prompt_token_ids).
    token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: log probabilities name each token
    # "token_id:<id>" instead of its text (which may be no whole character).
    tokens_as_ids: bool = False
    # vLLM's include_reasoning: false leaves a reasoning model's thinking
    # (--reasoning-parser) out of the answer (its content stays the rest).
    include_reasoning: bool = True
    # vLLM's stream_options.continuous_usage_stats (with include_usage):
    # every chunk of output carries the usage so far.
    continuous_usage: bool = False
    # Completions' echo with max_tokens 0: each choice is its prompt alone
    # (scored, with logprobs), no output shown or counted; the scheduler
    # is asked for one token, which is dropped.
    scored_only: bool = False

    @property
    def choices(self) -> int:
        """Choices in all, over every prompt."""
        return self.n * (1 + len(self.others))

    @property
    def requests(self) -> tuple[tokenizer_pb2.GenerateRequest, ...]:
        return (self.request, *self.others)

    def hand_over(self) -> Handed[tokenizer_pb2.GenerateRequest]:
        """`request`, for the service to take (`TokenizerService.generate`):
        the call keeps it without its media (`conversation.MEDIA`: its
        sampling and its prompt's text are what the answer reads), so that
        a data: URL's megabytes go once the service has prepared them, not
        when the answer ends. Once: a second call hands over the copy."""
        given = Handed(self.request)
        self.request = without(self.request, MEDIA)
        return given


def _listed(message: Any, name: str) -> int:
    """How many items a message's list field holds (0 where it is no list)."""
    value = message.get(name) if isinstance(message, dict) else None
    return len(value) if isinstance(value, list) else 0


def parse_chat(body: Any, tool_parser: str = "none") -> Call:
    """`tool_parser`: how the tool calls a model writes itself are found
    (the tokenizer's --tool-call-parser), for tool_choice "auto"."""
    body = _object(body)
    if body.get("echo") not in (None, False):
        raise invalid("echo is not supported by chat completions: it goes with completions", "echo")
    if _special_tokens(body):  # vLLM's default for chat is false
        raise invalid(
            "add_special_tokens true is not supported with messages: the chat template writes the special tokens",
            "add_special_tokens",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    check_sizes(len(messages), (_listed(m, "content") for m in messages), (_listed(m, "tool_calls") for m in messages))
    request = tokenizer_pb2.GenerateRequest(messages=[_message(m, i) for i, m in enumerate(messages)])
    tools = _tools(body, request, tool_parser)
    _template_options(body, request)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs must be true or false", "logprobs")
    request.sampling.logprobs = bool(logprobs)
    top = _int(body, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if top and not logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        request.sampling.top_logprobs = top
    call = _finish(body, request)
    call = _prompt_logprobs(body, call, echo=False)
    if tools is None:
        return call
    calls, schema = tools
    if schema:
        if call.request.sampling.json_schema:
            raise invalid("response_format cannot go with a tool_choice that calls a tool", "tool_choice")
        call.request.sampling.json_schema = schema
    return dataclasses.replace(call, calls=calls)


def _template_options(body: dict[str, Any], request: tokenizer_pb2.GenerateRequest) -> None:
    """vLLM's continue_final_message (with add_generation_prompt false or
    absent), add_generation_prompt false alone (no generation prompt),
    chat_template_kwargs and documents."""
    for name in ("continue_final_message", "add_generation_prompt"):
        if not isinstance(body.get(name, False), bool):
            raise invalid(f"{name} must be true or false", name)
    request.continue_final_message = body.get("continue_final_message") is True
    generation_prompt = body.get("add_generation_prompt")
    if request.continue_final_message and generation_prompt is True:
        raise invalid("continue_final_message needs add_generation_prompt false (or absent)", "add_generation_prompt")
    request.no_generation_prompt = not request.continue_final_message and generation_prompt is False
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    if kwargs:
        request.chat_template_kwargs = json.dumps(kwargs)
    documents = body.get("documents")
    if documents is not None and not isinstance(documents, list):
        raise invalid("documents must be a list of objects", "documents")
    if documents:
        request.documents = json.dumps(documents)  # the service checks their shape and text
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise invalid("chat_template must be a string (a Jinja template)", "chat_template")
    request.chat_template = template or ""  # the service takes it where it trusts requests' templates


def _tools(
    body: dict[str, Any], request: tokenizer_pb2.GenerateRequest, parser: str
) -> tuple[Forced | Auto, str] | None:
    """OpenAI's tools into the request (the chat template gets them), and
    the tool_choice: None for "none" (the default without tools); else how
    the output answers and the JSON Schema that constrains it ("required"
    and a named function; "" for "auto", the default with tools, whose
    calls the model writes in its own format: `parser` finds them, and
    without one "auto" is refused)."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise invalid("tools must be a list of tools", "tools")
    schemas: dict[str, dict[str, Any]] = {}
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        description = function.get("description", "")
        parameters = function.get("parameters")
        if not isinstance(description, str):
            raise invalid(f"{where}.function.description must be a string", where)
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters must be a JSON Schema object", where)
        name = function["name"]
        schemas[name] = parameters if parameters is not None else {"type": "object", "properties": {}}
        request.tools.add(name=name, description=description, parameters=json.dumps(parameters) if parameters else "")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise invalid(f"tool_choice {_short(choice)} needs tools", "tool_choice")
    single = body.get("parallel_tool_calls") is False
    if choice in ("auto", "required"):
        return choose(choice, schemas, parser, single=single)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise invalid(
            f'tool_choice {_short(choice)} must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return choose(named, schemas, parser, single=single)


def parse_completion(body: Any) -> Call:
    body = _object(body)
    chat_only: tuple[tuple[str, tuple[Any, ...]], ...] = (
        ("tools", (None, [])), ("tool_choice", (None, "none")), ("continue_final_message", (None, False)),
        ("add_generation_prompt", (None, True)), ("chat_template_kwargs", (None, {})), ("documents", (None, [])),
        ("chat_template", (None,)),
    )  # fmt: skip
    for name, nothing in chat_only:
        if body.get(name) not in nothing:
            raise invalid(f"{name} is not supported by completions: it goes with chat completions", name)
    prompts = _prompts(body.get("prompt"))
    request = _prompted(tokenizer_pb2.GenerateRequest(), prompts[0])
    top = _int(body, "logprobs")  # the legacy API: how many top entries, 0 for the token's own only
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs must be within [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        request.sampling.logprobs = True
        request.sampling.top_logprobs = top
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo must be true or false", "echo")
    scored_only = bool(echo) and _int(body, "max_tokens") == 0
    if scored_only:  # the prompt alone: one token is made, for the prefill's sake, and never shown
        if body.get("use_beam_search"):
            raise invalid("max_tokens must be at least 1 with use_beam_search", "max_tokens")
        if _int(body, "min_tokens"):
            raise invalid("min_tokens cannot exceed max_tokens (0: the prompt alone)", "min_tokens")
        call = dataclasses.replace(_finish({**body, "max_tokens": 1}, request), scored_only=True)
    else:
        call = _finish(body, request)
    if echo and request.truncate_prompt_tokens:
        raise invalid("echo cannot go with truncate_prompt_tokens: the prompt echoed is the one sent", "echo")
    call = _prompt_logprobs(body, call, echo=bool(echo))
    if call.n * len(prompts) > MAX_PROMPTS * MAX_CHOICES // 4:
        raise invalid(f"{len(prompts)} prompts of n {call.n}: at most {MAX_PROMPTS * MAX_CHOICES // 4} choices", "n")
    special = _special_tokens(body)
    others = []
    for prompt in prompts[1:]:
        other = tokenizer_pb2.GenerateRequest()
        other.CopyFrom(request)
        others.append(_prompted(other, prompt))
    for asked in (request, *others):  # vLLM's add_special_tokens (default true): a text prompt's BOS
        asked.no_special_tokens = special is False and asked.prompt_as_written
    return dataclasses.replace(call, others=tuple(others))


def _prompts(value: Any) -> list[str | list[int]]:
    """Completions' `prompt`: a string or token ids, or a list of either."""
    if isinstance(value, list) and value and all(isinstance(x, int) for x in value):  # one prompt of ids
        if not _token_ids(value):
            raise invalid(f"prompt: token ids are integers within [0, {_U32}]", "prompt")
        value = [value]
    elif isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_PROMPTS:
        raise invalid(
            f"prompt must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of them", "prompt"
        )
    for k, prompt in enumerate(value):
        if not ((isinstance(prompt, str) and prompt) or _token_ids(prompt)):  # an empty list of ids included
            where = f"prompt[{k}]" if len(value) > 1 else "prompt"
            raise invalid(f"{where} must be a non-empty string or a non-empty list of token ids", where)
    return value


def _token_ids(value: Any, *, empty: bool = False) -> bool:
    """Whether `value` is a list of token ids (each an unsigned 32-bit
    integer, not a boolean); `empty`: the empty list is one."""
    return (
        isinstance(value, list)
        and (empty or bool(value))
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U32 for x in value)
    )


def _special_tokens(body: dict[str, Any]) -> bool | None:
    """vLLM's add_special_tokens (None: not given)."""
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise invalid("add_special_tokens must be true or false", "add_special_tokens")
    return special


def _prompted(request: tokenizer_pb2.GenerateRequest, prompt: str | list[int]) -> tokenizer_pb2.GenerateRequest:
    """`request` with completions' `prompt`: a text as written (no chat
    template, GenerateRequest.prompt_as_written), or token ids as they are."""
    if isinstance(prompt, str):
        request.prompt = prompt
        request.prompt_as_written = True
    else:
        request.ClearField("prompt")
        request.prompt_as_written = request.no_special_tokens = False
        request.prompt_token_ids[:] = prompt
    return request


def _prompt_logprobs(body: dict[str, Any], call: Call, *, echo: bool) -> Call:
    """vLLM's prompt_logprobs and completions' echo: what the requests ask
    of the scheduler (`SamplingParams.prompt_logprobs`, the most top
    tokens either needs) and how the answer shows it."""
    asked = _int(body, "prompt_logprobs")
    if asked is not None:
        if not 0 <= asked <= MAX_TOP_LOGPROBS:
            raise invalid(f"prompt_logprobs must be within [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
        if call.stream:
            raise invalid("prompt_logprobs is not available with stream: true", "prompt_logprobs")
    s = call.request.sampling
    tops = [t for t in (asked, s.top_logprobs if echo and s.logprobs else None) if t is not None]
    if tops:
        s.prompt_logprobs = max(tops)
    return dataclasses.replace(call, echo=echo, prompt_logprobs=asked)


def _object(body: Any) -> dict[str, Any]:
    body = refuse(body, UNHONOURED)
    unknown = sorted(set(body) - KNOWN - UNHONOURED.keys())
    if unknown:
        log.debug("ignored request fields: %s", ", ".join(unknown))
    return body


def refuse(body: Any, unhonoured: dict[str, tuple[tuple[Any, ...], str]]) -> dict[str, Any]:
    """`body`, a JSON object that sets none of the `unhonoured` fields (field
    -> the values asking for nothing, why others are refused) to anything
    else; else INVALID_REQUEST naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    for name, (nothing, why) in unhonoured.items():
        value = body.get(name)
        if value not in nothing:
            raise invalid(f"{name} {_short(value)} is not supported: {why}; leave it out", name)
    return body


def _short(value: Any) -> str:
    """`value` as the client wrote it (JSON), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(m: Any, i: int) -> tokenizer_pb2.ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{where} must be an object with role and content", where)
    role = ROLES.get(m["role"]) if isinstance(m.get("role"), str) else None
    if role is None:
        raise invalid(f"{where}.role must be one of system, developer, user, assistant, tool", f"{where}.role")
    if m.get("function_call"):
        raise invalid(f"{where}.function_call: {_FUNCTIONS}", f"{where}.function_call")
    content = m.get("content")
    out = tokenizer_pb2.ChatMessage(role=role)
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{where}.tool_calls[{k}] must have a function with a name", f"{where}.tool_calls[{k}]")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise invalid(
                f"{where}.tool_calls[{k}].function.arguments must be a string (JSON)",
                f"{where}.tool_calls[{k}].function.arguments",
            )
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_calls[{k}].id must be a string", f"{where}.tool_calls[{k}]")
        out.tool_calls.add(id=call_id, name=function["name"], arguments=arguments)
    # An earlier answer's thinking, under either name it was answered with
    # (--reasoning-parser), goes back to the template; other roles' is ignored as vLLM does.
    thought = next((m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None), None)
    if role == tokenizer_pb2.CHAT_ROLE_ASSISTANT and thought is not None:
        if not isinstance(thought, str):
            raise invalid(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
        out.reasoning = thought
    if role == tokenizer_pb2.CHAT_ROLE_TOOL:
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id must name the call it answers", f"{where}.tool_call_id")
        out.tool_call_id = call_id
    if isinstance(content, str):
        out.content.add(text=content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            _part(out, part, f"{where}.content[{j}]")
    elif content is not None or role != tokenizer_pb2.CHAT_ROLE_ASSISTANT:
        raise invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
    return out


def _part(out: tokenizer_pb2.ChatMessage, part: Any, where: str) -> None:
    if not isinstance(part, dict):
        raise invalid(f"{where} must be an object", where)
    kind = part.get("type") or next((k for k in ("text", "image_url", "video_url") if k in part), None)
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.text must be a string", f"{where}.text")
        out.content.add(text=part["text"])
    elif kind == "refusal" and out.role == tokenizer_pb2.CHAT_ROLE_ASSISTANT:
        # An assistant's refusal, as OpenAI answers one, replayed in a
        # conversation: its text (vLLM reads it so too).
        if not isinstance(part.get("refusal"), str):
            raise invalid(f"{where}.refusal must be a string", f"{where}.refusal")
        out.content.add(text=part["refusal"])
    elif kind in ("image_url", "video_url"):
        value = part.get(kind)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise invalid(f"{where}.{kind}.url must be a non-empty string", f"{where}.{kind}.url")
        if kind == "image_url":
            out.content.add(image=tokenizer_pb2.Image(url=url))
        else:
            out.content.add(video=tokenizer_pb2.Video(url=url))
    else:
        raise invalid(f"{where}: part type {kind!r} is not supported (text, image_url, video_url)", f"{where}.type")


def _finish(body: dict[str, Any], request: tokenizer_pb2.GenerateRequest) -> Call:
    """The sampling fields (checked again, with the model's limits, by the
    service) and how to answer."""
    s = request.sampling
    limits = [v for v in (_int(body, "max_tokens"), _int(body, "max_completion_tokens")) if v is not None]
    if limits:
        if min(limits) < 1:
            raise invalid(
                "max_tokens must be at least 1 (0 only with completions' echo: the prompt alone)", "max_tokens"
            )
        s.max_tokens = min(limits)
    temperature = _number(body, "temperature")
    if temperature is not None:
        s.temperature = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        s.top_p = top_p
    min_p = _number(body, "min_p")
    if min_p is not None:
        s.min_p = min_p
    for name in ("ignore_eos", "include_stop_str_in_output"):
        flag = body.get(name)
        if flag is not None:
            if not isinstance(flag, bool):
                raise invalid(f"{name} must be true or false", name)
            setattr(s, name, flag)
    for name in ("top_k", "min_tokens"):
        value = _int(body, name)
        if value is not None:
            if value < 0 and not (name == "top_k" and value == -1):  # -1: off, as vLLM takes it
                raise invalid(f"{name} must not be negative", name)
            setattr(s, name, max(value, 0))
    seed = _int(body, "seed")
    if seed is not None:
        s.seed = seed & _U63 or 1  # 0 means "derive one": an explicit 0 is a seed too
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise invalid("stop must be a string or a list of strings", "stop")
        s.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not _token_ids(ids, empty=True):
            raise invalid("stop_token_ids must be a list of token ids", "stop_token_ids")
        s.stop_token_ids.extend(ids)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not _token_ids(allowed, empty=True):
            raise invalid("allowed_token_ids must be a list of token ids", "allowed_token_ids")
        s.allowed_token_ids.extend(allowed)
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise invalid("bad_words must be a list of strings", "bad_words")
        s.bad_words.extend(words)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        penalty = _number(body, name)
        if penalty is not None:
            if name == "repetition_penalty" and penalty <= 0:  # 0 would read as unset in the contract
                raise invalid("repetition_penalty must be greater than 0 (1: off)", name)
            setattr(s, name, penalty)
    for token, bias in _logit_bias(body).items():
        s.logit_bias[token] = bias
    s.json_schema = _response_format(body.get("response_format"))
    _structured_outputs(body, s)
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise invalid(f"n must be within [1, {MAX_CHOICES}]", "n")
    request.n = n or 1
    _beam_search(body, request)
    _mm_processor_kwargs(body, request)
    token_ids = body.get("return_token_ids")
    if token_ids is not None and not isinstance(token_ids, bool):
        raise invalid("return_token_ids must be true or false", "return_token_ids")
    request.return_prompt_token_ids = token_ids is True
    skip = body.get("skip_special_tokens")
    if skip is not None and not isinstance(skip, bool):
        raise invalid("skip_special_tokens must be true or false", "skip_special_tokens")
    request.keep_special_tokens = skip is False
    spaces = body.get("spaces_between_special_tokens")
    if spaces is not None and not isinstance(spaces, bool):  # either way: no space is put between them
        raise invalid("spaces_between_special_tokens must be true or false", "spaces_between_special_tokens")
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if not isinstance(keep, int) or isinstance(keep, bool) or not -1 <= keep <= _I31:
            raise invalid("truncate_prompt_tokens must be an integer of at least -1", "truncate_prompt_tokens")
        request.truncate_prompt_tokens = keep
    priority = _int(body, "priority")
    if priority is not None:
        if not -_I31 - 1 <= priority <= _I31:
            raise invalid("priority must be a 32-bit integer", "priority")
        request.priority = priority
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT:
            raise invalid(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", "cache_salt")
        request.cache_salt = salt
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):  # "yes" was answered whole
        raise invalid("stream must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if stream is not True:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = options.get("include_usage", True)  # as vLLM's StreamOptions has it
        continuous = options.get("continuous_usage_stats", False)  # vLLM's
        if not isinstance(include_usage, bool) or not isinstance(continuous, bool):
            raise invalid("stream_options.include_usage and continuous_usage_stats must be true or false",
                          "stream_options")  # fmt: skip
        # The prompt's tokens are counted from its ids, which come first
        # (shown only with return_token_ids).
        continuous = include_usage and continuous
        request.return_prompt_token_ids |= continuous
    as_ids, reasoning = body.get("return_tokens_as_token_ids"), body.get("include_reasoning")
    for name, value in (("return_tokens_as_token_ids", as_ids), ("include_reasoning", reasoning)):
        if value is not None and not isinstance(value, bool):
            raise invalid(f"{name} must be true or false", name)
    return Call(
        request,
        n or 1,
        stream is True,
        include_usage,
        token_ids=token_ids is True,
        tokens_as_ids=as_ids is True,
        continuous_usage=continuous,
        include_reasoning=reasoning is not False,
    )


def _beam_search(body: dict[str, Any], request: tokenizer_pb2.GenerateRequest) -> None:
    """vLLM's use_beam_search (n is the beam width) and length_penalty
    (GenerateRequest.beam_search). A length_penalty without beam search
    would change nothing: refused, not ignored."""
    beams = body.get("use_beam_search")
    if beams is not None and not isinstance(beams, bool):
        raise invalid("use_beam_search must be true or false", "use_beam_search")
    penalty = _number(body, "length_penalty")
    if beams:
        request.beam_search.SetInParent()
        if penalty is not None:
            request.beam_search.length_penalty = penalty
    elif penalty is not None and penalty != 1:
        raise invalid("length_penalty applies to beam search only: set use_beam_search true", "length_penalty")


def _mm_processor_kwargs(body: dict[str, Any], request: tokenizer_pb2.GenerateRequest) -> None:
    """vLLM's `mm_processor_kwargs` as far as this server honours it: a
    Qwen-VL model's `max_pixels` and `min_pixels` per image, an InternVL
    model's `max_dynamic_patch` and `min_dynamic_patch` (its tiles; both
    GenerateRequest.image_budget, which the service checks against the
    model), and the videos' sampling, `fps` and `max_frames`
    (GenerateRequest.video_budget, checked against the server's). The pixel
    bounds apply to images only, so a request with a video is refused
    rather than given its frames at the server's pixel budget unsaid."""
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None or kwargs == {}:
        return
    if not isinstance(kwargs, dict):
        raise invalid("mm_processor_kwargs must be an object", "mm_processor_kwargs")
    budget, video = tokenizer_pb2.ImageBudget(), tokenizer_pb2.VideoBudget()
    for name, value in kwargs.items():
        where = f"mm_processor_kwargs.{name}"
        if name == "fps":
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise invalid(f"{where} must be a number of frames per second", where)
            if not 0 < value <= MAX_VIDEO_FPS:
                raise invalid(f"{where} must be within (0, {MAX_VIDEO_FPS:g}]", where)
            video.fps = value
        elif name == "max_frames":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _U32:
                raise invalid(f"{where} must be a whole number of frames, at least 1", where)
            video.max_frames = value
        elif name in ("max_pixels", "min_pixels"):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PIXELS:
                raise invalid(f"{where} must be a whole number of pixels within [1, {MAX_PIXELS}]", where)
            setattr(budget, name, value)
        elif name in TILE_KWARGS:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _U32:
                raise invalid(f"{where} must be a whole number of tiles, at least 1", where)
            setattr(budget, TILE_KWARGS[name], value)
        else:
            raise invalid(
                f"{where} is not supported: this server takes max_pixels and min_pixels (an image's pixel "
                "budget), max_dynamic_patch and min_dynamic_patch (an InternVL image's tiles), fps and max_frames "
                "(how a video's frames are sampled)",
                where,
            )
    pixels = budget.max_pixels or budget.min_pixels
    if pixels and (request.videos or any(p.HasField("video") for m in request.messages for p in m.content)):
        raise invalid(
            "mm_processor_kwargs' max_pixels and min_pixels apply to images only on this server: leave them out "
            "of a request with a video",
            "mm_processor_kwargs",
        )
    if pixels or budget.max_tiles or budget.min_tiles:
        request.image_budget.CopyFrom(budget)
    if video.fps or video.max_frames:
        request.video_budget.CopyFrom(video)


def _int(body: dict[str, Any], name: str) -> int | None:
    """An integer field. Every one of them lands in an unsigned 32-bit field
    of the contract (seed aside: 64 bits, and reduced), so a larger value is
    refused here as the client's, not left to fail as ours."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer", name)
    if name != "seed" and value > _U32:
        raise invalid(f"{name} {value} is too large", name)
    return value


def _response_format(value: Any) -> str:
    """OpenAI's response_format as the contract's json_schema ("" for
    text; any JSON object for json_object; the schema of json_schema, any
    JSON value when it has none). The service compiles it."""
    if value is None:
        return ""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema must be a JSON Schema object", "response_format")
        return json.dumps(schema)
    raise invalid(
        f"response_format {_short(value)} is not supported: its type must be text, json_object or json_schema",
        "response_format",
    )


def _structured_outputs(body: dict[str, Any], s: common_pb2.SamplingParams) -> None:
    """vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
    `json_object`), and its older `guided_json`, `guided_regex`,
    `guided_choice` and `guided_grammar`, into the contract's json_schema,
    regex, choice and grammar (at most one structure in all, response_format
    included)."""
    spec = body.get("structured_outputs")
    if spec is None:
        spec = {
            k.removeprefix("guided_"): body[k]
            for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if k in body
        }
        where = "guided_" + next(iter(spec), "json")
    else:
        where = "structured_outputs"
        if not isinstance(spec, dict):
            raise invalid("structured_outputs must be an object (json, regex, choice, grammar or json_object)", where)
    known = ("json", "regex", "choice", "grammar", "json_object")
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise invalid(f"{where}: {', '.join(unknown)} not supported ({', '.join(known)})", where)
    given = [k for k, v in spec.items() if v not in (None, False)]
    if len(given) > 1 or (given and s.json_schema):
        raise invalid(f"{where}: one structure at most (response_format included)", where)
    if not given:
        return
    kind, value = given[0], spec[given[0]]
    if kind == "json_object":
        s.json_schema = ANY_OBJECT
    elif kind == "json":
        if isinstance(value, str):
            try:
                value = strict_json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"{where}.json is not JSON ({exc})", where) from None
        if not isinstance(value, dict):
            raise invalid(f"{where}.json must be a JSON Schema object", where)
        s.json_schema = json.dumps(value)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str):
            raise invalid(f"{where}.{kind} must be a string", where)
        setattr(s, kind, value)
    elif not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise invalid(f"{where}.choice must be a list of strings", where)
    else:
        s.choice.extend(value)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token ids (strings, as JSON keys
    are) to numbers; the service checks their ranges and the vocabulary."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    message = "logit_bias must be an object mapping token ids to numbers"
    if not isinstance(bias, dict):
        raise invalid(message, "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= token <= _U32 or not _is_number(value):
            raise invalid(f"{message}: {_short(key)}: {_short(value)}", "logit_bias")
        out[token] = float(value)
    return out


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise invalid(f"{name} must be a number", name)
    return float(value)


def _is_number(value: Any) -> bool:
    """A JSON number a float holds (JSON integers have no bound: 1e400
    written out is an int float() refuses); true and false are not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, float) or abs(value) <= 1 << 1000


def invalid(message: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(message, metadata={"param": param} if param else None)


def param_name(exc: MmsplitError) -> str | None:
    """The field an error names, as the OpenAI request spells it."""
    param = exc.metadata.get("param")
    if not param:
        return None
    name = param.removeprefix("sampling.")
    if name == "prompt_token_ids":
        return "prompt"
    if name.startswith(("image_budget", "video_budget")):
        kwarg = name.removeprefix("image_budget").removeprefix("video_budget")
        return "mm_processor_kwargs" + {f".{v}": f".{k}" for k, v in TILE_KWARGS.items()}.get(kwarg, kwarg)
    structured = {"regex", "choice", "grammar"}
    return "response_format" if name == "json_schema" else "structured_outputs" if name in structured else name


@dataclass(frozen=True)
class Tokenize:
    """A /tokenize request: the request whose prompt ids are wanted, or
    (`text`) a text to tokenize as it is; and whether each id's token text
    is asked for (`return_token_strs`)."""

    request: tokenizer_pb2.GenerateRequest | None
    text: str | None
    strs: bool


def parse_tokenize(body: Any) -> Tokenize:
    """vLLM's /tokenize: a `prompt`, or `messages` (with `tools`,
    `continue_final_message`, `add_generation_prompt` and
    `chat_template_kwargs` as chat completions takes them). The ids are
    those generation uses: a prompt's text as completions reads it (as
    written, with the tokenizer's BOS; without it given
    `add_special_tokens: false`, as vLLM and lm-evaluation-harness's remote
    tokenizer send it). Messages are always templated (the template writes
    the special tokens: `add_special_tokens` may only be false there)."""
    body = _object(body)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise invalid("give either prompt or messages", "prompt")
    special = _special_tokens(body)
    if chat and special:
        raise invalid(
            "add_special_tokens true is not supported with messages: the chat template writes the special tokens",
            "add_special_tokens",
        )
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise invalid("return_token_strs must be true or false", "return_token_strs")
    if chat:
        fields = ("messages", "tools", "continue_final_message", "add_generation_prompt", "chat_template_kwargs",
                  "mm_processor_kwargs", "documents", "chat_template")  # fmt: skip
        request = parse_chat({**{k: body[k] for k in fields if k in body}, "tool_choice": "none"}).request
        return Tokenize(request, None, strs)
    if special is False:
        text = body["prompt"]
        if not isinstance(text, str):
            raise invalid("prompt must be a string (add_special_tokens false tokenizes a text)", "prompt")
        return Tokenize(None, text, strs)
    given = {k: body[k] for k in ("prompt", "mm_processor_kwargs") if k in body}
    return Tokenize(parse_completion(given).request, None, strs)


def parse_detokenize(body: Any, max_ids: int) -> list[int]:
    """vLLM's /detokenize: the `tokens` to decode (ids; the vocabulary is
    the caller's to check), at most `max_ids` of them (a prompt's limit:
    a million ids held the event loop for 0.3 s)."""
    tokens: Any = _object(body).get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_ids:
        raise invalid(f"tokens has {len(tokens)} ids, at most {max_ids}", "tokens")
    if not _token_ids(tokens, empty=True):
        raise invalid("tokens must be a list of token ids", "tokens")
    return list(tokens)
