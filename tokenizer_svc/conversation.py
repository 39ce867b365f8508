"""A request's text and media in one shape, whether it came as a prompt
(with `images` and `videos`) or as a conversation (`messages`).

Media keep their order within a modality, which is what pairs a medium
with its placeholder (the k-th image part takes the k-th image marker the
template writes). Each medium also knows where it was in the request
(``images[1]``, ``messages[2].content[0]``): an error about it names that
place (ErrorInfo metadata ``param``; the HTTP error body's ``param``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server import strict_json
from mmsplit_server.families import Family, PixelBudget, TileBudget
from tokenizer_svc.errors import InvalidRequest, MediaUnsupported
from tokenizer_svc.prompt import ToolCall, Turn
from tokenizer_svc.settings import TokenizerSettings
from tokenizer_svc.tool_calls import Auto, Forced, choose

ROLES = {
    tokenizer_pb2.CHAT_ROLE_SYSTEM: "system",
    tokenizer_pb2.CHAT_ROLE_USER: "user",
    tokenizer_pb2.CHAT_ROLE_ASSISTANT: "assistant",
    tokenizer_pb2.CHAT_ROLE_TOOL: "tool",
}
# A conversation's messages, its content parts (all messages together) and
# one message's tool calls. Rendering and tokenizing run on the event loop,
# per message: 100,000 one-character messages (within --max-prompt-chars)
# held every stream of the tokenizer for 3.3 s. 2,048 messages and 128 calls
# a message are OpenAI's own limits.
MAX_MESSAGES = 2048
MAX_PARTS = 8192
MAX_TOOL_CALLS = 128
# Tools one request may give (GenerateRequest.tools), and their names.
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# GenerateRequest.chat_template_kwargs: its size and its names.
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
TEMPLATE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")

Medium = tokenizer_pb2.Image | tokenizer_pb2.Video
# Choices one request may ask for (GenerateRequest.n).
MAX_CHOICES = 8
# Characters of GenerateRequest.cache_salt.
MAX_CACHE_SALT = 256
# Characters of a client's request id (GenerateRequest.request_id, HTTP's X-Request-Id).
MAX_REQUEST_ID = 128


def check_sizes(messages: int, parts: Iterable[int], calls: Iterable[int]) -> None:
    """A conversation's counts within MAX_MESSAGES, MAX_PARTS (`parts`: each
    message's) and MAX_TOOL_CALLS (`calls`: each message's), checked before
    any message is read."""
    if messages > MAX_MESSAGES:
        raise InvalidRequest(f"{messages} messages, at most {MAX_MESSAGES}", metadata={"param": "messages"})
    total = sum(parts)
    if total > MAX_PARTS:
        raise InvalidRequest(
            f"{total} content parts in all messages, at most {MAX_PARTS}", metadata={"param": "messages"}
        )
    for i, n in enumerate(calls):
        if n > MAX_TOOL_CALLS:
            raise InvalidRequest(
                f"messages[{i}] has {n} tool calls, at most {MAX_TOOL_CALLS}",
                metadata={"param": f"messages[{i}].tool_calls"},
            )


def valid_request_id(rid: str) -> bool:
    return 0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable()


# Choice i of a request seeded s samples with s + i * SEED_STRIDE (mod 2^63,
# never 0, which means "derived from the downstream request id").
SEED_STRIDE = 0x9E3779B97F4A7C15
_U63 = (1 << 63) - 1


@dataclass(frozen=True)
class Located:
    medium: Medium
    where: str  # the field path naming it in the request


@dataclass(frozen=True)
class VideoSampling:
    """A request's own rule for its videos' frames (GenerateRequest.video_budget); 0 leaves the server's."""

    fps: float = 0.0
    max_frames: int = 0


# The most frames per second of video a request may ask to be sampled.
MAX_VIDEO_FPS = 60.0


@dataclass(frozen=True)
class Parsed:
    prompt: str
    turns: list[Turn] | None  # None: a prompt request
    # In the order the service prepares them: the images, then the videos.
    media: list[Located]
    # As the chat template takes them ({"type": "function", "function": {...}}).
    tools: list[dict[str, Any]] = field(default_factory=list)
    # The last (assistant) turn is continued, not closed (continue_final_message).
    continue_final: bool = False
    # The template's generation prompt ends the conversation (not no_generation_prompt).
    generation_prompt: bool = True
    # The chat template's extra variables (chat_template_kwargs).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The chat template's documents (GenerateRequest.documents).
    documents: list[dict[str, str]] = field(default_factory=list)
    # The request's own chat template (GenerateRequest.chat_template); None: the server's.
    chat_template: str | None = None
    # The prompt as token ids (prompt_token_ids), instead of text and media.
    token_ids: tuple[int, ...] | None = None
    # tool_choice: how the output answers with calls, and the JSON Schema
    # that constrains it ("required" and a named function; empty for "auto").
    calls: Forced | Auto | None = None
    tool_schema: str = ""
    # What rendering and tokenizing the prompt will take, roughly in
    # characters: its texts (with a conversation's calls and tools, and
    # PER_MESSAGE for each message's template), or its ids.
    size: int = 0
    # The images' own pixel budget (image_budget); None: the checkpoint's.
    image_pixels: PixelBudget | None = None
    # Their own bounds on the tiles of each (image_budget's min_tiles, max_tiles); None: the checkpoint's.
    image_tiles: TileBudget | None = None
    # The videos' own sampling (video_budget); None: the server's.
    video_sampling: VideoSampling | None = None
    # SamplingParams.bad_words as token sequences (tokenizer_svc.bad_words).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # A prompt as written, no chat template (GenerateRequest.prompt_as_written),
    # with the tokenizer's special tokens unless GenerateRequest.no_special_tokens.
    as_written: bool = False
    special_tokens: bool = True


# What the template adds per message, counted in `Parsed.size`.
PER_MESSAGE = 64
# Documents one conversation may give its chat template.
MAX_DOCUMENTS = 64
# A request's own chat template.
MAX_TEMPLATE_BYTES = 64 * 1024


def parse(request: tokenizer_pb2.GenerateRequest, settings: TokenizerSettings, family: Family) -> Parsed:
    """The request's shape, checked against the per-request limits."""
    pixels = image_budget(request, family)
    tiles = tile_budget(request, family)
    sampling = video_budget(request, settings)
    if request.split_reasoning and settings.reasoning_parser == "none":
        raise InvalidRequest(
            "split_reasoning needs a tokenizer started with --reasoning-parser (this one has none)",
            metadata={"param": "split_reasoning"},
        )
    if request.no_special_tokens and not request.prompt_as_written:
        raise InvalidRequest(
            "no_special_tokens goes with prompt_as_written (a prompt's text tokenized as written)",
            metadata={"param": "no_special_tokens"},
        )
    if request.prompt_as_written and (request.prompt_token_ids or request.messages):
        raise InvalidRequest(
            "prompt_as_written goes with a prompt's text, not messages or prompt_token_ids",
            metadata={"param": "prompt_as_written"},
        )
    if request.prompt_token_ids:
        return _token_prompt(request, settings)
    if request.messages:
        if request.prompt or request.images or request.videos:
            raise InvalidRequest("give either messages or prompt (with images and videos), not both")
        check_sizes(len(request.messages), (len(m.content) for m in request.messages),
                    (len(m.tool_calls) for m in request.messages))  # fmt: skip
        parsed = _conversation(request.messages, request.tools)
        calls, schema = _tool_choice(request, parsed.tools, settings.tool_call_parser)
        parsed = dataclasses.replace(
            parsed,
            continue_final=_continued(request, parsed.turns or []),
            generation_prompt=not request.no_generation_prompt,
            template_kwargs=_template_kwargs(request.chat_template_kwargs),
            documents=_documents(request.documents),
            chat_template=_own_template(request.chat_template, settings),
            calls=calls,
            tool_schema=schema,
        )
        chars = sum(len(text) for turn in parsed.turns or [] for kind, text in turn.parts if kind == "text")
        chars += sum(len(call.name) + len(call.arguments) for turn in parsed.turns or [] for call in turn.tool_calls)
        chars += sum(len(t.name) + len(t.description) + len(t.parameters) for t in request.tools)
        chars += sum(len(k) + len(v) for document in parsed.documents for k, v in document.items())
    else:
        for name in (
            "tools",
            "continue_final_message",
            "chat_template_kwargs",
            "tool_choice",
            "documents",
            "no_generation_prompt",
            "chat_template",
        ):
            if _given(request, name):
                raise InvalidRequest(
                    f"{name} go with a conversation (messages), not a prompt", metadata={"param": name}
                )
        images = [Located(m, f"images[{i}]") for i, m in enumerate(request.images)]
        videos = [Located(m, f"videos[{i}]") for i, m in enumerate(request.videos)]
        parsed = Parsed(
            request.prompt,
            None,
            [*images, *videos],
            as_written=request.prompt_as_written,
            special_tokens=not request.no_special_tokens,
        )
        chars = len(request.prompt)
        if not request.prompt and not parsed.media:
            raise InvalidRequest("the request has neither a prompt nor media")
    s = settings
    # The field each bound is over: a conversation's media are in its messages.
    chat = bool(request.messages)
    if chars > s.max_prompt_chars:
        raise InvalidRequest(
            f"prompt has {chars} characters, at most {s.max_prompt_chars}",
            metadata={"param": "messages" if chat else "prompt"},
        )
    n_images = sum(isinstance(m.medium, tokenizer_pb2.Image) for m in parsed.media)
    n_videos = len(parsed.media) - n_images
    if n_images > s.max_images_per_request:
        raise InvalidRequest(
            f"{n_images} images, at most {s.max_images_per_request}",
            metadata={"param": "messages" if chat else "images"},
        )
    if n_videos and not family.takes_video:
        first = next(m for m in parsed.media if isinstance(m.medium, tokenizer_pb2.Video))
        raise MediaUnsupported(f"this model ({family.name}) takes no video", metadata={"param": first.where})
    if n_videos > s.max_videos_per_request:
        raise InvalidRequest(
            f"{n_videos} videos, at most {s.max_videos_per_request}",
            metadata={"param": "messages" if chat else "videos"},
        )
    return dataclasses.replace(
        parsed,
        size=chars + PER_MESSAGE * len(request.messages),
        image_pixels=pixels,
        image_tiles=tiles,
        video_sampling=sampling,
    )


def video_budget(request: tokenizer_pb2.GenerateRequest, settings: TokenizerSettings) -> VideoSampling | None:
    """The rule the request's videos are sampled by, where it asks for one
    within the server's; None where it asks for none."""
    if not request.HasField("video_budget"):
        return None
    asked = request.video_budget
    if not math.isfinite(asked.fps) or not 0.0 <= asked.fps <= MAX_VIDEO_FPS:
        raise InvalidRequest(
            f"fps {asked.fps!r} must be within (0, {MAX_VIDEO_FPS:g}] frames sampled per second of video",
            metadata={"param": "video_budget.fps"},
        )
    if asked.max_frames > settings.video_max_frames:
        raise InvalidRequest(
            f"max_frames {asked.max_frames} is over this server's {settings.video_max_frames} frames a video "
            "(--video-max-frames)",
            metadata={"param": "video_budget.max_frames"},
        )
    if not asked.fps and not asked.max_frames:
        return None
    return VideoSampling(float(asked.fps), int(asked.max_frames))


def image_budget(request: tokenizer_pb2.GenerateRequest, family: Family) -> PixelBudget | None:
    """The pixel budget the request's images are resized to, where it asks
    for one within the checkpoint's (`Family.image_pixels`): a bound left 0
    is the checkpoint's, but a min_pixels left 0 never over the max asked.
    None when it asks for none or for exactly the checkpoint's (the same
    rows, and preprocessing cache entries, as a request without one)."""
    if not request.HasField("image_budget"):
        return None
    asked, own = request.image_budget, family.image_pixels
    if own is None:
        if asked.min_pixels or asked.max_pixels:
            tiles = "; bound its tiles instead (min_tiles, max_tiles)" if family.image_tiles is not None else ""
            raise InvalidRequest(
                f"this model ({family.name}) makes every image one size, or tiles of one size: it takes no pixel "
                f"budget{tiles}",
                metadata={"param": "image_budget"},
            )
        return None
    most = asked.max_pixels or own.most
    budget = PixelBudget(asked.min_pixels, most) if asked.min_pixels else own.at_most(most)
    fewest = family.least_image_pixels
    if most > own.most:
        raise InvalidRequest(
            f"max_pixels {most} is over this model's image budget of {own.most} pixels",
            metadata={"param": "image_budget.max_pixels"},
        )
    if most < fewest:
        raise InvalidRequest(
            f"max_pixels {most} is under one merged patch of this model ({fewest} pixels)",
            metadata={"param": "image_budget.max_pixels"},
        )
    if budget.least > most:
        raise InvalidRequest(
            f"min_pixels {budget.least} is over max_pixels {most}", metadata={"param": "image_budget.min_pixels"}
        )
    return None if budget == own else budget


def tile_budget(request: tokenizer_pb2.GenerateRequest, family: Family) -> TileBudget | None:
    """The bounds on the tiles of each of the request's images, where it
    asks for them within the checkpoint's (`Family.image_tiles`): a bound
    left 0 is the checkpoint's, but a min_tiles left 0 never over the max
    asked. None when it asks for none or for exactly the checkpoint's."""
    asked = request.image_budget
    if not asked.min_tiles and not asked.max_tiles:
        return None
    own = family.image_tiles
    where = "image_budget.max_tiles" if asked.max_tiles else "image_budget.min_tiles"
    if own is None:
        raise InvalidRequest(
            f"this model ({family.name}) does not cut images into tiles: min_tiles and max_tiles apply to a model "
            "that does (InternVL)",
            metadata={"param": where},
        )
    most = asked.max_tiles or own.most
    if most > own.most:
        raise InvalidRequest(
            f"max_tiles {most} is over this model's {own.most} (its image processor's max_patches)",
            metadata={"param": "image_budget.max_tiles"},
        )
    least = asked.min_tiles or min(own.least, most)
    if least > most:
        raise InvalidRequest(
            f"min_tiles {least} is over max_tiles {most}", metadata={"param": "image_budget.min_tiles"}
        )
    budget = TileBudget(least, most)
    return None if budget == own else budget


def _given(request: tokenizer_pb2.GenerateRequest, name: str) -> bool:
    """Whether the request sets field `name` (a message field: present at all)."""
    return request.HasField(name) if name == "tool_choice" else bool(getattr(request, name))


def _token_prompt(request: tokenizer_pb2.GenerateRequest, settings: TokenizerSettings) -> Parsed:
    """A prompt of token ids: nothing else says what the model reads (their
    vocabulary and media placeholders are checked as the prompt is built)."""
    others = ("prompt", "images", "videos", "messages", "tools", "continue_final_message", "chat_template_kwargs")
    for name in (*others, "tool_choice"):
        if _given(request, name):
            raise InvalidRequest(f"prompt_token_ids cannot go with {name}", metadata={"param": name})
    if len(request.prompt_token_ids) > settings.max_prompt_chars:
        raise InvalidRequest(
            f"prompt_token_ids has {len(request.prompt_token_ids)} ids, at most {settings.max_prompt_chars}",
            metadata={"param": "prompt_token_ids"},
        )
    return Parsed("", None, [], token_ids=tuple(request.prompt_token_ids), size=len(request.prompt_token_ids))


def _conversation(messages: list[tokenizer_pb2.ChatMessage], tools: list[tokenizer_pb2.Tool]) -> Parsed:
    turns: list[Turn] = []
    images: list[Located] = []
    videos: list[Located] = []
    for i, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise InvalidRequest(f"messages[{i}] has no role (system, user, assistant or tool)", metadata=_at(i))
        if role == "system" and i:
            raise InvalidRequest("only the first message may be a system message", metadata=_at(i))
        if message.tool_calls and role != "assistant":
            raise InvalidRequest(f"messages[{i}]: only assistant messages may call tools", metadata=_at(i))
        if (role == "tool") != bool(message.tool_call_id):
            why = "a tool message needs" if role == "tool" else "only tool messages may have"
            raise InvalidRequest(f"messages[{i}]: {why} a tool_call_id", metadata=_at(i))
        parts: list[tuple[str, str]] = []
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            where = f"messages[{i}].content[{j}]"
            if kind is None:
                raise InvalidRequest(f"{where} is empty (text, image or video)", metadata={"param": where})
            if kind != "text" and role != "user":
                raise InvalidRequest(f"{where}: only user messages may carry media", metadata={"param": where})
            if kind == "image":
                images.append(Located(part.image, where))
            elif kind == "video":
                videos.append(Located(part.video, where))
            parts.append((kind, part.text if kind == "text" else ""))
        if message.reasoning and role != "assistant":
            raise InvalidRequest(f"messages[{i}]: only assistant messages may carry reasoning", metadata=_at(i))
        calls = tuple(_tool_call(call, f"messages[{i}].tool_calls[{k}]") for k, call in enumerate(message.tool_calls))
        turns.append(Turn(role, tuple(parts), calls, message.tool_call_id, message.reasoning))
    return Parsed("", turns, [*images, *videos], _tools(tools))


def _tool_call(call: tokenizer_pb2.ToolCall, where: str) -> ToolCall:
    if not TOOL_NAME.fullmatch(call.name):
        raise InvalidRequest(f"{where}.name must be 1-64 of a-z, A-Z, 0-9, _ and -", metadata={"param": where})
    return ToolCall(call.id, call.name, call.arguments)


def _tools(tools: list[tokenizer_pb2.Tool]) -> list[dict[str, Any]]:
    """The request's tools as the chat template takes them."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools, at most {MAX_TOOLS}", metadata={"param": "tools"})
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for k, tool in enumerate(tools):
        where = {"param": f"tools[{k}]"}
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidRequest(f"tools[{k}].name must be 1-64 of a-z, A-Z, 0-9, _ and -", metadata=where)
        if tool.name in names:
            raise InvalidRequest(f"tools[{k}]: two tools are named {tool.name!r}", metadata=where)
        names.add(tool.name)
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                parameters = strict_json.loads(tool.parameters)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"tools[{k}].parameters is not JSON ({exc})", metadata=where) from None
            if not isinstance(parameters, dict):
                raise InvalidRequest(f"tools[{k}].parameters must be a JSON Schema object", metadata=where)
            function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(
    request: tokenizer_pb2.GenerateRequest, tools: list[dict[str, Any]], parser: str
) -> tuple[Forced | Auto | None, str]:
    """tool_choice over the request's tools (`_tools`' form): how the output
    answers with calls and the schema that constrains it (None, "": unset)."""
    if not request.HasField("tool_choice"):
        return None, ""
    where = {"param": "tool_choice"}
    chosen = request.tool_choice
    kind = chosen.WhichOneof("choice")
    if kind is None:
        raise InvalidRequest("tool_choice must say auto, required or a function", metadata=where)
    if not tools:
        raise InvalidRequest("tool_choice needs tools", metadata=where)
    s = request.sampling
    if kind != "auto" and (s.json_schema or s.regex or s.choice or s.grammar):
        raise InvalidRequest(f"tool_choice {kind} constrains the output: not with a structured output", metadata=where)
    empty = {"type": "object", "properties": {}}
    schemas = {t["function"]["name"]: t["function"].get("parameters", empty) for t in tools}
    name = chosen.function if kind == "function" else kind
    return choose(name, schemas, parser, single=chosen.single_call)


def _continued(request: tokenizer_pb2.GenerateRequest, turns: list[Turn]) -> bool:
    """continue_final_message: the last turn must be the assistant's, with text."""
    if not request.continue_final_message:
        return False
    last = turns[-1]
    if last.role != "assistant" or not any(kind == "text" and text for kind, text in last.parts):
        raise InvalidRequest(
            "continue_final_message needs the last message to be an assistant message with text to continue",
            metadata={"param": "continue_final_message"},
        )
    return True


def _template_kwargs(text: str) -> dict[str, Any]:
    """chat_template_kwargs: a JSON object of named values (the names the
    template reserves are the prompt builder's to refuse)."""
    where = {"param": "chat_template_kwargs"}
    if not text:
        return {}
    if len(text.encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes", metadata=where)
    try:
        kwargs = strict_json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"chat_template_kwargs is not JSON ({exc})", metadata=where) from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object", metadata=where)
    for name in kwargs:
        if not TEMPLATE_NAME.fullmatch(name):
            raise InvalidRequest(
                f"chat_template_kwargs: {name[:80]!r} is not a name (1-64 of a-z, A-Z, 0-9 and _, a letter first)",
                metadata=where,
            )
    return kwargs


def _own_template(template: str, settings: TokenizerSettings) -> str | None:
    """A request's own chat template, where the server trusts them."""
    where = {"param": "chat_template"}
    if not template:
        return None
    if not settings.trust_request_chat_template:
        raise InvalidRequest(
            "a request's own chat_template is not rendered here: this server renders every conversation with "
            "its --chat-template (start the tokenizer with --trust-request-chat-template to take them)",
            metadata=where,
        )
    if len(template.encode()) > MAX_TEMPLATE_BYTES:
        raise InvalidRequest(f"chat_template is over {MAX_TEMPLATE_BYTES} bytes", metadata=where)
    return template


def _documents(text: str) -> list[dict[str, str]]:
    """documents: a JSON list of objects of strings (the prompt builder
    checks their text as it checks the messages')."""
    where = {"param": "documents"}
    if not text:
        return []
    try:
        documents = strict_json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"documents is not JSON ({exc})", metadata=where) from None
    if not isinstance(documents, list) or len(documents) > MAX_DOCUMENTS:
        raise InvalidRequest(f"documents must be a list of at most {MAX_DOCUMENTS} objects", metadata=where)
    for i, document in enumerate(documents):
        if not isinstance(document, dict) or not all(isinstance(v, str) for v in document.values()):
            raise InvalidRequest(f"documents[{i}] must be an object whose values are strings", metadata=where)
    return documents


def _at(i: int) -> dict[str, str]:
    return {"param": f"messages[{i}]"}


# What a request is without once its media are prepared and its prompt
# built (the service keeps it so while its answer streams; a choice's own
# request is so: they are made once for every choice before any is sent,
# `TokenizerService._media_once`).
PREPARED_ONCE = frozenset({"prompt", "images", "videos", "messages", "prompt_token_ids", "documents"})
# The fields that carry media (an HTTP call keeps its request without them
# while its answer streams: its prompt's text stays, for echo).
MEDIA = frozenset({"images", "videos", "messages"})


# A scheduler request's items (inline: the tensors' bytes).
ITEMS = frozenset({"items"})

M = TypeVar("M", tokenizer_pb2.GenerateRequest, scheduler_pb2.GenerateRequest)


def without(request: M, fields: frozenset[str]) -> M:
    """A new request of `request`'s fields but `fields`: a message's strings
    are freed only with the whole message, so clearing its media would
    free nothing; once the last reference to `request` goes, they do."""
    out = type(request)()
    for described, value in request.ListFields():
        if described.name in fields:
            continue
        if described.is_repeated:
            getattr(out, described.name).extend(value)
        elif described.message_type is not None:
            getattr(out, described.name).CopyFrom(value)
        else:
            setattr(out, described.name, value)
    return out


def choice_request(request: tokenizer_pb2.GenerateRequest, i: int) -> tokenizer_pb2.GenerateRequest:
    """The request of choice `i`: one choice, its own seed (none stays none:
    each choice then derives one from its own downstream id), and none of
    PREPARED_ONCE (each choice's request lives as long as the choice runs:
    a copy of its media would be n more copies of a data: URL's megabytes)."""
    out = without(request, PREPARED_ONCE)
    out.n = 1
    if request.sampling.seed and i:
        out.sampling.seed = ((request.sampling.seed + i * SEED_STRIDE) & _U63) or 1
    return out
