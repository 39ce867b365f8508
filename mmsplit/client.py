"""A client library for the tokenizer service: `Client` (blocking) and
`AsyncClient` (asyncio), with the same methods.

    from mmsplit.client import Client, RequestFailed

    with Client("127.0.0.1:50052") as client:
        for event in client.generate("What is this?", images=[open("cat.jpg", "rb").read()], max_tokens=16):
            print(event.text, end="", flush=True)

A conversation goes as `messages` instead of a prompt: (role, content)
pairs, the content a string or a list of strings, `ImagePart`s and
`VideoPart`s in order; the server renders it with the model's chat template.

    client.complete(messages=[
        ("system", "Answer in one word."),
        ("user", ["What is this?", ImagePart(open("cat.jpg", "rb").read())]),
    ])

Failures raise `RequestFailed` subclasses decoded from the status's
ErrorInfo: `reason` (the ErrorCode name), `retriable`, `request_id`, the gRPC
code and the message. Retriable failures that end a call before any response
(UNAVAILABLE, RESOURCE_EXHAUSTED) are retried by gRPC itself, through the
channel's service config (`retries`, exponential backoff with gRPC's
jitter); a stream that already produced text is never retried.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import error_info_of
from mmsplit.keepalive import keepalive_options
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
RETRY_BUFFER_BYTES = 64 * 1024 * 1024  # requests up to this size can be retried


# ---- errors ----
def read_secret(path: str) -> str:
    """The secret a client presents from a token file (a bearer token, an
    API key): its first line, surrounding whitespace removed, blank lines and
    lines starting with # aside (the services' files hold one secret per
    line); a file with none is an error. The conformance kit reads its
    files with this."""
    secrets = secrets_in(Path(path).read_text())
    if not secrets:
        raise ValueError(f"{path} holds no secret")
    return secrets[0]


def secrets_in(text: str) -> tuple[str, ...]:
    """The secrets of a token file's text: one per line, surrounding
    whitespace removed, blank lines and lines starting with # aside."""
    lines = (line.strip() for line in text.splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


class RequestFailed(Exception):
    """A failed call: the server's ErrorCode name, whether retrying can help,
    the request id it echoed, the gRPC status code and message."""

    def __init__(self, reason: str, message: str, *, grpc_code: str, retriable: bool, request_id: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.grpc_code = reason, message, grpc_code
        self.retriable, self.request_id = retriable, request_id


class InvalidRequest(RequestFailed):
    """The request itself was refused (prompt, sampling, markers, items)."""


class MediaError(RequestFailed):
    """An image or video could not be fetched, read or used."""


class Overloaded(RequestFailed):
    """The server is at a limit; retriable."""


class Unavailable(RequestFailed):
    """The server or what it depends on is not there now; retriable."""


class TimedOut(RequestFailed):
    """A deadline passed (the call's, or the server's preprocessing budget)."""


class Cancelled(RequestFailed):
    """The call was cancelled."""


class InternalError(RequestFailed):
    """A bug on the server (the message carries an incident id), or a server
    that did not say what went wrong."""


_KINDS: dict[str, type[RequestFailed]] = {
    "INVALID_REQUEST": InvalidRequest,
    "MEDIA_DECODE_FAILED": MediaError,
    "MEDIA_UNSUPPORTED": MediaError,
    "MEDIA_TOO_LARGE": MediaError,
    "MEDIA_NOT_FOUND": MediaError,
    "MEDIA_SOURCE_FORBIDDEN": MediaError,
    "MEDIA_FETCH_FAILED": MediaError,
    "OVERLOADED": Overloaded,
    "SCHEDULER_UNAVAILABLE": Unavailable,
    "SHUTTING_DOWN": Unavailable,
    "PREPROCESS_WORKER_CRASHED": Unavailable,
    "PREPROCESS_TIMEOUT": TimedOut,
    "DEADLINE_EXCEEDED": TimedOut,
    "CANCELLED": Cancelled,
}


def transport_hint(details: str) -> str:
    """What a failed connection's details most likely mean, for a person
    ("" when nothing more can be said): an HTTP/1 server answered (the
    OpenAI API's port given for the gRPC one), or nothing listens."""
    if "http1.x server" in details or "Failed parsing HTTP/2" in details:
        return (
            " (a server that does not speak gRPC's HTTP/2 answered there, such as the OpenAI API's port: "
            "give the gRPC port, 50052 by default)"
        )
    if "errors resolving" in details and "://" in details:
        return " (give HOST:PORT, without a URL's scheme)"
    if "Connection refused" in details:
        return " (nothing listens there: is the service running, and is this its gRPC port?)"
    return ""


def decode_error(exc: grpc.RpcError) -> RequestFailed:
    """The typed error of a failed call (its ErrorInfo, else its gRPC code)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else None) or str(code)
    info = error_info_of(exc)
    if info is not None and info.domain == "mmsplit":
        reason = info.reason
        retriable = info.metadata.get("retriable") == "true"
        request_id = info.metadata.get("request_id", "")
    else:
        reason = {
            grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE",
            grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
            grpc.StatusCode.CANCELLED: "CANCELLED",
            grpc.StatusCode.RESOURCE_EXHAUSTED: "OVERLOADED",
        }.get(code, "INTERNAL")
        retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        request_id = ""
    kind = _KINDS.get(reason, Unavailable if reason == "UNAVAILABLE" else InternalError)
    return kind(reason, message, grpc_code=code.name, retriable=retriable, request_id=request_id)


# ---- events ----
@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    request_id: str = ""  # the server's id of the request (made up by it when the request had none)


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "STOP" or "LENGTH"
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # always empty: lets a loop print every event's text
    request_id: str = ""
    cached_tokens: int = 0  # of prompt_tokens, those taken from the scheduler's prefix cache
    # With tool_choice: the calls found in the output (ids, names, arguments
    # as JSON text) and the output's text outside them.
    tool_calls: tuple[ToolCall, ...] = ()
    content: str = ""
    # With split_reasoning: the output's thinking (content is then the rest).
    reasoning: str = ""


@dataclass(frozen=True)
class PromptScores:
    """The prompt's tokens and their log probabilities (`prompt_logprobs=`),
    before the first delta: per token given those before it (the first has
    none: None), its rank, and its position's most likely tokens."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    ranks: tuple[int | None, ...]
    top: tuple[dict[int, float], ...]
    text: str = ""  # always empty: lets a loop print every event's text
    request_id: str = ""


@dataclass(frozen=True)
class PromptIds:
    """The prompt's token ids as the model reads them (chat template and
    placeholders included), before anything else of a choice, when asked
    (`return_prompt_token_ids=True`)."""

    token_ids: tuple[int, ...]
    text: str = ""  # always empty: lets a loop print every event's text
    request_id: str = ""


# What a request's stream yields.
Event = Delta | Finished | PromptScores | PromptIds


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: tuple[ToolCall, ...] = ()  # with tool_choice (Finished.tool_calls)
    content: str = ""
    reasoning: str = ""  # with split_reasoning (Finished.reasoning)
    prompt: PromptScores | None = None  # with prompt_logprobs
    prompt_token_ids: list[int] = field(default_factory=list)  # with return_prompt_token_ids


@dataclass(frozen=True)
class Tokens:
    """`tokenize`'s answer: the ids generation would start from, and the
    context (prompt and output, tokens; 0 when no scheduler is connected)."""

    ids: list[int]
    max_context_tokens: int


def service_config(retries: int, initial_backoff_s: float, max_backoff_s: float) -> str:
    """gRPC's retry policy for the tokenizer service (at most 5 attempts: gRPC's cap)."""
    policy = {
        "maxAttempts": max(2, min(5, retries + 1)),
        "initialBackoff": f"{initial_backoff_s}s",
        "maxBackoff": f"{max_backoff_s}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    }
    config: dict[str, Any] = {"methodConfig": [{"name": [{"service": SERVICE}]}]}
    if retries > 0:
        config["methodConfig"][0]["retryPolicy"] = policy
    return json.dumps(config)


@dataclass(frozen=True)
class ImagePart:
    """An image in a conversation turn: bytes (sent inline) or a URL
    (data:, http(s), or a path under the server's allowed directory)."""

    source: bytes | str


@dataclass(frozen=True)
class VideoPart:
    """A video in a conversation turn (models that take video)."""

    source: bytes | str


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool, in an assistant turn's parts (the contract's
    ChatMessage.tool_calls); `arguments` a dict or JSON text."""

    name: str
    arguments: Mapping[str, Any] | str = "{}"
    id: str = ""


@dataclass(frozen=True)
class Reasoning:
    """An assistant turn's thinking, in its parts (the contract's
    ChatMessage.reasoning: what a split_reasoning answer's `reasoning` was),
    which the chat template gets as the turn's reasoning_content."""

    text: str


@dataclass(frozen=True)
class ToolResult:
    """A tool turn's content: what the call `call_id` returned."""

    call_id: str
    content: str


@dataclass(frozen=True)
class Tool:
    """A function the model may call (GenerateRequest.tools); `parameters`
    its arguments' JSON Schema (a dict or JSON text; empty: none)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | str = ""


# (role, content): role "system", "user", "assistant" or "tool"; content
# text, or parts in order (an assistant's may include ToolCalls and its
# Reasoning; a tool turn's is a ToolResult).
Part = str | ImagePart | VideoPart | ToolCall | Reasoning
Message = tuple[str, "Part | ToolResult | Sequence[Part]"]
_ROLES = {
    "system": tokenizer_pb2.CHAT_ROLE_SYSTEM,
    "user": tokenizer_pb2.CHAT_ROLE_USER,
    "assistant": tokenizer_pb2.CHAT_ROLE_ASSISTANT,
    "tool": tokenizer_pb2.CHAT_ROLE_TOOL,
}


def chat_messages(messages: Sequence[Message]) -> list[tokenizer_pb2.ChatMessage]:
    """`messages` as the contract's ChatMessages."""
    out = []
    for role, content in messages:
        if role not in _ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(_ROLES)}")
        message = tokenizer_pb2.ChatMessage(role=_ROLES[role])
        if isinstance(content, ToolResult):
            message.tool_call_id = content.call_id
            content = content.content
        for part in [content] if isinstance(content, str | ImagePart | VideoPart | ToolCall | Reasoning) else content:
            if isinstance(part, str):
                message.content.add(text=part)
            elif isinstance(part, ImagePart):
                message.content.add(image=_source(tokenizer_pb2.Image, part.source))
            elif isinstance(part, VideoPart):
                message.content.add(video=_source(tokenizer_pb2.Video, part.source))
            elif isinstance(part, ToolCall):
                message.tool_calls.add(id=part.id, name=part.name, arguments=_json(part.arguments))
            elif isinstance(part, Reasoning):
                message.reasoning += part.text
            else:
                raise TypeError(
                    f"a content part is text, ImagePart, VideoPart, ToolCall or Reasoning, not {type(part).__name__}"
                )
        out.append(message)
    return out


def _json(value: Mapping[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _source(cls: Any, source: bytes | str) -> Any:
    return cls(url=source) if isinstance(source, str) else cls(data=source)


def build_request(
    prompt: str = "",
    *,
    messages: Sequence[Message] = (),
    images: Sequence[bytes | str] = (),
    videos: Sequence[bytes | str] = (),
    request_id: str = "",
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int = 0,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    stop_token_ids: Sequence[int] = (),
    cache_salt: str = "",
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Sequence[int] = (),
    bad_words: Sequence[str] = (),
    json_schema: str | Mapping[str, Any] = "",
    regex: str = "",
    choice: Sequence[str] = (),
    grammar: str = "",
    tools: Sequence[Tool] = (),
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    prompt_token_ids: Sequence[int] = (),
    prompt_logprobs: int | None = None,
    tool_choice: str = "",
    call_tool: str = "",
    single_call: bool = False,
    min_pixels: int = 0,
    max_pixels: int = 0,
    min_tiles: int = 0,
    max_tiles: int = 0,
    return_prompt_token_ids: bool = False,
    truncate_prompt_tokens: int = 0,
    priority: int = 0,
    video_fps: float = 0.0,
    video_max_frames: int = 0,
    n: int = 0,
    beam_width: int = 0,
    length_penalty: float | None = None,
    prompt_as_written: bool = False,
    no_special_tokens: bool = False,
    split_reasoning: bool = False,
    chat_template: str = "",
) -> tokenizer_pb2.GenerateRequest:
    """A GenerateRequest of a prompt (with `images` and `videos`) or of a
    conversation (`messages`); media given as bytes are sent inline, as str
    by URL (data:, http(s), or a path under the server's allowed directory).
    Requests share the scheduler's cached prompt blocks only when their
    `cache_salt` is the same. The sampling fields are `SamplingParams`'
    (protos/mmsplit/common/v1/common.proto); `json_schema` may be given as
    a dict. `tools` go to the chat template (a conversation's); to have the
    model call one, pass its parameters as `json_schema` and read the
    answer as the call's arguments. `continue_final_message`: the model
    continues the conversation's last (assistant) message;
    `chat_template_kwargs`: the chat template's extra variables.
    `prompt_token_ids`: the prompt as token ids, instead of `prompt`, media
    and `messages`; `prompt_logprobs`: the prompt tokens' log probabilities
    with this many top tokens each (a `PromptLogprobs` response before each
    choice's first delta; raw `Generate` responses carry it). `tool_choice`
    "auto" or "required", or `call_tool` a tool's name: how the model may
    call `tools` (`single_call`: at most one); the last event's
    `tool_calls` and `content` then hold the calls found and the rest.
    `min_pixels`, `max_pixels`: a Qwen-VL model's images resized within
    these bounds instead of the checkpoint's (within them only; 0 leaves a
    bound as the checkpoint's: `GenerateRequest.image_budget`);
    `min_tiles`, `max_tiles`: an InternVL model's images cut into that
    many tiles (likewise).
    `return_prompt_token_ids`: a `PromptIds` event first, the ids the
    model reads. `truncate_prompt_tokens`: the model reads only the
    prompt's last N tokens (-1: as many as the context holds). `priority`:
    the scheduler's admission order, lower first (its --scheduling-policy
    priority; elsewhere only 0). `video_fps`, `video_max_frames`: how the
    request's videos are sampled, within the server's rule (0 leaves the
    server's: `GenerateRequest.video_budget`). `n`: that many independent
    choices (`Client.choices` answers each). `beam_width`: beam search of
    that many beams instead of sampling (`GenerateRequest.beam_search`
    with `n`; `length_penalty`, 1 unset); `Client.beam_search` answers
    each beam. `prompt_as_written`: `prompt` is the model's text as it is
    (OpenAI's completions), not a user turn of the chat template;
    `no_special_tokens`: tokenized without the tokenizer's BOS.
    `split_reasoning`: the last event's `reasoning` holds a reasoning
    model's thinking and `content` the rest (a tokenizer with a
    --reasoning-parser); an assistant turn's `Reasoning` part sends an
    earlier answer's thinking back. `chat_template`: the conversation
    rendered with this Jinja template instead of the server's (a tokenizer
    started with --trust-request-chat-template; others refuse it)."""
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop=list(stop),
        include_stop_str_in_output=include_stop_str_in_output,
        stop_token_ids=list(stop_token_ids),
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=dict(logit_bias or {}),
        allowed_token_ids=list(allowed_token_ids),
        bad_words=list(bad_words),
        json_schema=_json(json_schema),
        regex=regex,
        choice=list(choice),
        grammar=grammar,
    )
    if top_p is not None:
        sampling.top_p = top_p
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    choose = None
    if tool_choice or call_tool:
        if tool_choice not in ("", "auto", "required") or (tool_choice and call_tool):
            raise ValueError('tool_choice is "auto" or "required"; or name a tool with call_tool instead')
        choose = tokenizer_pb2.ToolChoice(single_call=single_call)
        if call_tool:
            choose.function = call_tool
        else:
            setattr(choose, tool_choice, True)
    if length_penalty is not None and not beam_width:
        raise ValueError("length_penalty applies to beam search only: give beam_width")
    if n and beam_width:
        raise ValueError("give n (sampled choices) or beam_width (beams), not both")
    return tokenizer_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        n=beam_width or n,
        prompt_as_written=prompt_as_written,
        no_special_tokens=no_special_tokens,
        split_reasoning=split_reasoning,
        chat_template=chat_template,
        beam_search=(
            tokenizer_pb2.BeamSearch(length_penalty=length_penalty)
            if length_penalty is not None
            else tokenizer_pb2.BeamSearch()
            if beam_width
            else None
        ),
        images=[_source(tokenizer_pb2.Image, m) for m in images],
        videos=[_source(tokenizer_pb2.Video, m) for m in videos],
        sampling=sampling,
        messages=chat_messages(messages),
        cache_salt=cache_salt,
        tools=[
            tokenizer_pb2.Tool(name=t.name, description=t.description, parameters=_json(t.parameters)) for t in tools
        ],
        continue_final_message=continue_final_message,
        chat_template_kwargs=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "",
        prompt_token_ids=list(prompt_token_ids),
        tool_choice=choose,
        image_budget=(
            tokenizer_pb2.ImageBudget(
                min_pixels=min_pixels, max_pixels=max_pixels, min_tiles=min_tiles, max_tiles=max_tiles
            )
            if min_pixels or max_pixels or min_tiles or max_tiles
            else None
        ),
        return_prompt_token_ids=return_prompt_token_ids,
        truncate_prompt_tokens=truncate_prompt_tokens,
        priority=priority,
        video_budget=tokenizer_pb2.VideoBudget(fps=video_fps, max_frames=video_max_frames)
        if video_fps or video_max_frames
        else None,
    )


def _event(response: tokenizer_pb2.GenerateResponse) -> Event | None:
    kind = response.WhichOneof("event")
    if kind == "prompt_tokens":
        return PromptIds(tuple(response.prompt_tokens.token_ids), request_id=response.request_id)
    if kind == "prompt_logprobs":
        scored = response.prompt_logprobs
        entries = list(scored.logprobs)
        return PromptScores(
            tuple(scored.token_ids),
            (None, *(e.logprob for e in entries)),
            (None, *(e.rank for e in entries)),
            ({}, *(dict(zip(e.top_token_ids, e.top_logprobs, strict=True)) for e in entries)),
            request_id=response.request_id,
        )
    if kind == "delta":
        return Delta(response.delta.text, tuple(response.delta.token_ids), response.request_id)
    if kind == "finished":
        f = response.finished
        reason = common_pb2.FinishReason.Name(f.finish_reason).removeprefix("FINISH_REASON_")
        calls = tuple(ToolCall(c.name, c.arguments, c.id) for c in f.tool_calls)
        return Finished(
            reason, f.prompt_tokens, f.completion_tokens, request_id=response.request_id,
            cached_tokens=f.cached_tokens, tool_calls=calls, content=f.content, reasoning=f.reasoning,
        )  # fmt: skip
    return None


def _add_choice(each: dict[int, Completion], response: tokenizer_pb2.GenerateResponse) -> None:
    """A response, added to its choice's Completion."""
    event = _event(response)
    if event is not None:
        _add(each.setdefault(response.index, Completion()), event)


def _add(done: Completion, event: Event) -> None:
    if isinstance(event, PromptIds):
        done.prompt_token_ids = list(event.token_ids)
    elif isinstance(event, PromptScores):
        done.prompt = event
    elif isinstance(event, Delta):
        done.text += event.text
        done.token_ids.extend(event.token_ids)
    else:
        done.finish_reason = event.finish_reason
        done.prompt_tokens, done.completion_tokens = event.prompt_tokens, event.completion_tokens
        done.tool_calls, done.content, done.reasoning = event.tool_calls, event.content, event.reasoning


def _options(
    retries: int,
    initial_backoff_s: float,
    max_backoff_s: float,
    server_name: str,
    retry_buffer_bytes: int,
    keepalive_s: float,
    keepalive_timeout_s: float,
) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", service_config(retries, initial_backoff_s, max_backoff_s)),
        ("grpc.enable_retries", 1 if retries > 0 else 0),
        # gRPC keeps a copy of a request to send it again, up to this size
        # (its default, 256 KiB, is less than one photo): a larger request
        # is never retried.
        ("grpc.per_rpc_retry_buffer_size", retry_buffer_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # A tokenizer that vanishes mid-stream (its node lost) is found
        # within keepalive_s + keepalive_timeout_s, not at the call's deadline.
        *keepalive_options(keepalive_s, keepalive_timeout_s),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


class _Connection:
    """What both clients set up: the channel's options (the retry policy)
    and credentials. TLS when `root_certificates` is given (and a client
    certificate with `certificate_chain` and `private_key`)."""

    def __init__(
        self,
        address: str,
        *,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        server_name: str = "",
        retries: int = 3,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        retry_buffer_bytes: int = RETRY_BUFFER_BYTES,
        keepalive_s: float = 20.0,
        keepalive_timeout_s: float = 10.0,
    ) -> None:
        options = _options(
            retries, initial_backoff_s, max_backoff_s, server_name, retry_buffer_bytes, keepalive_s, keepalive_timeout_s
        )
        credentials = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            if root_certificates is not None
            else None
        )
        self._channel = self._open(address, credentials, options)
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel)

    def _open(self, address: str, credentials: Any, options: list[tuple[str, Any]]) -> Any:
        raise NotImplementedError


class Client(_Connection):
    """A blocking client (constructor arguments: see `_Connection`)."""

    def _open(self, address: str, credentials: Any, options: list[tuple[str, Any]]) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)

    def generate(self, prompt: str = "", *, timeout: float | None = None, **kwargs: Any) -> Iterator[Event]:
        """The stream: deltas, then one Finished (first a PromptScores with
        `prompt_logprobs=`). Raises RequestFailed. `kwargs` are
        `build_request`'s (messages, images, videos, sampling, request_id)."""
        return self.send(build_request(prompt, **kwargs), timeout=timeout)

    def send(self, request: tokenizer_pb2.GenerateRequest, *, timeout: float | None = None) -> Iterator[Event]:
        """`generate` for a request already built."""
        try:
            for response in self._stub.Generate(request, timeout=timeout):
                event = _event(response)
                if event is not None:
                    yield event
        except grpc.RpcError as exc:
            raise decode_error(exc) from None

    def complete(self, prompt: str = "", *, timeout: float | None = None, **kwargs: Any) -> Completion:
        done = Completion()
        for event in self.generate(prompt, timeout=timeout, **kwargs):
            _add(done, event)
        return done

    def choices(self, prompt: str = "", *, n: int, timeout: float | None = None, **kwargs: Any) -> list[Completion]:
        """`n` independent generations of the same input (`build_request`'s
        `n`; each its own seed, derived from `seed`), in choice order."""
        return self._each(build_request(prompt, n=n, **kwargs), timeout)

    def beam_search(
        self, prompt: str = "", *, width: int, timeout: float | None = None, **kwargs: Any
    ) -> list[Completion]:
        """The `width` best beams (fewer when fewer hypotheses completed), best
        first: beam search instead of sampling (`build_request`'s
        `beam_width`; `length_penalty` and the other `kwargs` are its)."""
        return self._each(build_request(prompt, beam_width=width, **kwargs), timeout)

    def _each(self, request: tokenizer_pb2.GenerateRequest, timeout: float | None) -> list[Completion]:
        """Each choice of `request`'s answer, in choice order."""
        each: dict[int, Completion] = {}
        try:
            for response in self._stub.Generate(request, timeout=timeout):
                _add_choice(each, response)
        except grpc.RpcError as exc:
            raise decode_error(exc) from None
        return [each[i] for i in sorted(each)]

    def server_info(self, timeout: float = 10.0) -> tokenizer_pb2.GetServerInfoResponse:
        try:
            return self._stub.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise decode_error(exc) from None

    def tokenize(self, prompt: str = "", *, timeout: float | None = None, **kwargs: Any) -> Tokens:
        """The token ids `generate` with the same arguments would start
        from (chat template and media included), without generating."""
        request = tokenizer_pb2.TokenizeRequest(request=build_request(prompt, **kwargs))
        try:
            reply = self._stub.Tokenize(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise decode_error(exc) from None
        return Tokens(list(reply.token_ids), reply.max_context_tokens)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """The asyncio client: the same arguments and methods, awaited."""

    def _open(self, address: str, credentials: Any, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, credentials, options=options)

    async def generate(
        self,
        prompt: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the call's gRPC deadline, which the server sees)
        **kwargs: Any,
    ) -> AsyncIterator[Event]:
        request = build_request(prompt, **kwargs)
        try:
            async for response in self._stub.Generate(request, timeout=timeout):
                event = _event(response)
                if event is not None:
                    yield event
        except grpc.RpcError as exc:
            raise decode_error(exc) from None

    async def complete(
        self,
        prompt: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (as generate)
        **kwargs: Any,
    ) -> Completion:
        done = Completion()
        async for event in self.generate(prompt, timeout=timeout, **kwargs):
            _add(done, event)
        return done

    async def choices(
        self,
        prompt: str = "",
        *,
        n: int,
        timeout: float | None = None,  # noqa: ASYNC109 (as generate)
        **kwargs: Any,
    ) -> list[Completion]:
        return await self._each(build_request(prompt, n=n, **kwargs), timeout)

    async def beam_search(
        self,
        prompt: str = "",
        *,
        width: int,
        timeout: float | None = None,  # noqa: ASYNC109 (as generate)
        **kwargs: Any,
    ) -> list[Completion]:
        return await self._each(build_request(prompt, beam_width=width, **kwargs), timeout)

    async def _each(
        self,
        request: tokenizer_pb2.GenerateRequest,
        timeout: float | None,  # noqa: ASYNC109 (as generate)
    ) -> list[Completion]:
        each: dict[int, Completion] = {}
        try:
            async for response in self._stub.Generate(request, timeout=timeout):
                _add_choice(each, response)
        except grpc.RpcError as exc:
            raise decode_error(exc) from None
        return [each[i] for i in sorted(each)]

    async def tokenize(
        self,
        prompt: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (as generate)
        **kwargs: Any,
    ) -> Tokens:
        request = tokenizer_pb2.TokenizeRequest(request=build_request(prompt, **kwargs))
        try:
            reply = await self._stub.Tokenize(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise decode_error(exc) from None
        return Tokens(list(reply.token_ids), reply.max_context_tokens)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
