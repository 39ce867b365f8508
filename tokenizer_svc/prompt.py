"""Prompt text → token ids, with each media marker expanded exactly as the
model's own processor expands it, and the placeholder runs of every item.

Fidelity: the expanded text is tokenized in one call of the tokenizer, the
way transformers' processors do it, so the ids equal the processor's for the
same text and media (tested per family). The expansion rule is the family's
(`mmsplit_server.families`), the same code the scheduler checks items with.

Control tokens: user text may not contain the text of any special or added
token of the tokenizer (``</s>``, ``<|im_start|>``, ...) except the media
markers, which must then match the media sent. Such text would otherwise be
tokenized into the control token itself; it is refused (INVALID_REQUEST)
rather than silently altered.

Chat template (optional): the prompt becomes one user turn whose content is
its text and media parts in order (``{"type": "text"|"image"|"video"}``,
the media first when the prompt has no markers), rendered by the model's
template with the generation prompt, exactly as
``processor.apply_chat_template(messages, add_generation_prompt=True)``
renders it; the template's own special tokens are then real control tokens
(the user's text was checked before it was placed).

Conversations (`build_chat`): every turn's parts go to the template as they
are, so the text equals ``processor.apply_chat_template(messages,
add_generation_prompt=True)`` for the same conversation. Media come only as
parts: a text part may not hold a media marker either.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mmsplit_server import strict_json
from mmsplit_server.families import IMAGE, VIDEO, Family
from tokenizer_svc.errors import InternalError, InvalidRequest


@dataclass(frozen=True)
class Media:
    modality: int
    tokens: int  # placeholders this item fills (the family's rule)
    times: tuple[float, ...] = ()  # a video's seconds per temporal patch (`Family.expand`)


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: its role ("system", "user",
    "assistant", "tool") and its parts in order: ("text", str), ("image",
    ""), ("video", ""); an assistant turn's calls of tools and its
    thinking (the template's reasoning_content), a tool turn's id of the
    call it answers."""

    role: str
    parts: tuple[tuple[str, str], ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    reasoning: str = ""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Rendered:
    """A conversation as the chat template wrote it (`PromptBuilder.render_chat`):
    the text, its media markers in place, and the modality of each marker in order."""

    text: str
    found: list[int]


@dataclass(frozen=True)
class BuiltPrompt:
    input_ids: list[int]
    # Per media item, in request order: its placeholder runs (offset, length).
    runs: list[list[tuple[int, int]]]


def truncated(prompt: BuiltPrompt, keep: int, media: Sequence[str]) -> BuiltPrompt:
    """The prompt's last `keep` tokens (truncate_prompt_tokens), its
    items' runs moved with them; `media` names each item (its place in the
    request). A cut before or inside an item's runs is INVALID_REQUEST."""
    cut = len(prompt.input_ids) - keep
    if cut <= 0:
        return prompt
    for where, runs in zip(media, prompt.runs, strict=True):
        if runs and runs[0][0] < cut:
            raise InvalidRequest(
                f"truncate_prompt_tokens {keep} would cut {where} out of the prompt of {len(prompt.input_ids)} "
                f"tokens (its placeholders start at token {runs[0][0]}): keep at least "
                f"{len(prompt.input_ids) - runs[0][0]} tokens, or send it no more",
                metadata={"param": "truncate_prompt_tokens"},
            )
    return BuiltPrompt(prompt.input_ids[cut:], [[(at - cut, n) for at, n in runs] for runs in prompt.runs])


_NAMES = {1: "image", 2: "video", 3: "audio"}
_KWARGS = {"param": "chat_template_kwargs"}
# What transformers' templates are given besides apply_chat_template's parameters.
_TEMPLATE_OWN = {"messages", "tools", "documents", "raise_exception", "strftime_now", "bos_token", "eos_token"}


def _names(modalities: list[int]) -> str:
    return ", ".join(_NAMES.get(m, "?") for m in modalities) or "none"


class PromptBuilder:
    def __init__(self, family: Family, tokenizer: Any, chat_template: str | None = None) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.holders = family.placeholders
        markers = {p.mark for p in self.holders.values()}
        self._marker_re = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._by_marker = {p.mark: m for m, p in self.holders.items()}
        # Placeholder tokens that are not also a marker (InternVL's image
        # token, where the video's marker is another): text may not hold them.
        tokens = {p.token for p in self.holders.values()} - markers
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        specials |= {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
        specials -= markers
        specials |= tokens
        for p in self.holders.values():
            specials -= {p.before, p.after}
        self._control = sorted((s for s in specials if s), key=len, reverse=True)
        wrapped = {p.before + p.mark + p.after: p.mark for p in self.holders.values() if p.before or p.after}
        self._wrapped = wrapped
        # The vision start/end tokens are allowed only around a marker.
        self._structural = sorted({t for p in self.holders.values() for t in (p.before, p.after) if t})
        # What a prompt of token ids may not hold: the media placeholders and the tokens around them.
        media_ids = tokenizer.convert_tokens_to_ids([*markers, *tokens, *self._structural])
        self._media_ids = frozenset(i for i in media_ids if i is not None and i != tokenizer.unk_token_id)
        # Names chat_template_kwargs may not take: apply_chat_template's own
        # parameters, what it gives the template (the special tokens, by
        # name) and the template's functions.
        self._template_names = {
            *inspect.signature(tokenizer.apply_chat_template).parameters,
            *(getattr(tokenizer, "special_tokens_map", None) or {}),
            *_TEMPLATE_OWN,
        }

    def build(self, prompt: str, media: list[Media], *, as_written: bool = False, special: bool = True) -> BuiltPrompt:
        """`media` in request order (images, then videos); each marker in the
        text takes the next item of its modality. `as_written`: not rendered
        by the chat template (OpenAI's completions), and tokenized with the
        tokenizer's special tokens only where `special`."""
        text = prompt
        for whole, marker in self._wrapped.items():
            text = text.replace(whole, marker)
        self._check_text(self._marker_re.sub("", text), "the prompt")
        found = [self._by_marker[m] for m in self._marker_re.findall(text)]
        sent = sorted(m.modality for m in media)
        if found and sorted(found) != sent:
            raise InvalidRequest(
                f"the prompt's media markers ({_names(found)}) do not match the media sent "
                f"({_names([m.modality for m in media])}); mark each with {' or '.join(sorted(self._by_marker))}, "
                "or use no markers at all"
            )
        if self.chat_template is not None and not as_written:
            # Without markers the media parts come first (images, then videos).
            text = self._render(text, found or sent, media_first=not found)
            found = [self._by_marker[m] for m in self._marker_re.findall(text)]
            if sorted(found) != sent:
                raise InternalError("the chat template did not place every image and video of the request once")
        elif not found and media:
            # No markers: the images first, then the videos, one per line.
            text = "".join(self.holders[m].mark + "\n" for m in sent) + text
            found = sent
        if as_written:
            return self._tokenize(text, found, media, templated=False, special=special)
        return self._tokenize(text, found, media)

    def from_ids(self, ids: tuple[int, ...]) -> BuiltPrompt:
        """A prompt given as token ids (prompt_token_ids): read as they are,
        each inside the vocabulary and none a media placeholder (media come
        with a text prompt or a conversation, where their runs are made)."""
        vocab = len(self.tokenizer)
        for i, token in enumerate(ids):
            if token >= vocab:
                why = f"is outside the vocabulary of {vocab}"
            elif token in self._media_ids:
                why = "is a media placeholder or marker (send media with a text prompt or messages)"
            else:
                continue
            raise InvalidRequest(f"prompt_token_ids[{i}] {token} {why}", metadata={"param": "prompt_token_ids"})
        return BuiltPrompt(list(ids), [])

    def build_chat(self, turns: list[Turn], media: list[Media], *args: Any, **kwargs: Any) -> BuiltPrompt:
        """A conversation rendered (`render_chat`, which takes the same
        arguments) and tokenized."""
        return self.tokenize_chat(self.render_chat(turns, media, *args, **kwargs), media)

    def tokenize_chat(self, rendered: Rendered, media: list[Media]) -> BuiltPrompt:
        """A conversation `render_chat` rendered, tokenized with its `media`
        (on the thread that tokenizes: the tokenizer is not shared between threads)."""
        return self._tokenize(rendered.text, rendered.found, media, templated=True)

    def render_chat(
        self,
        turns: list[Turn],
        media: list[Media],
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final: bool = False,
        generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
        template: str | None = None,
    ) -> Rendered:
        """A conversation rendered by the chat template with the generation
        prompt (or, `continue_final`, with its last turn left open for the
        model to continue, as transformers' `continue_final_message`; or,
        not `generation_prompt`, closed and with no generation prompt).
        `media` are the images of every turn in order, then the
        videos in order; the k-th image part takes the k-th image. `tools`
        go to the template as its `tools` (each {"type": "function",
        "function": {...}}); an assistant turn's calls as its `tool_calls`
        (each {"id", "type": "function", "function": {"name", "arguments":
        a dict}}), a tool turn with its `tool_call_id`, as transformers'
        templates take them; `template_kwargs` as variables of their own;
        `documents` as the template's `documents` (a template that reads
        none leaves them out). `template`: the request's own chat template,
        instead of the server's.
        Every turn's content is its list of parts (what
        these models' templates read; a template may test for a string)."""
        own = template is not None  # the request's, else the server's
        template = template if own else self.chat_template
        if template is None:
            raise InvalidRequest(
                "this model has no chat template, so a conversation (messages) cannot be rendered; "
                "send a prompt instead, or start the tokenizer with --chat-template FILE"
            )
        kinds = {"image": IMAGE, "video": VIDEO}
        conversation: list[dict[str, Any]] = []
        for i, turn in enumerate(turns):
            content: list[dict[str, str]] = []
            for j, (kind, text) in enumerate(turn.parts):
                if kind == "text":
                    self._check_text(text, f"messages[{i}].content[{j}]", markers=True)
                    content.append({"type": "text", "text": text})
                else:
                    content.append({"type": kind})
            message: dict[str, Any] = {"role": turn.role, "content": content}
            if turn.role == "tool":
                self._check_text(turn.tool_call_id, f"messages[{i}].tool_call_id", markers=True)
                message["tool_call_id"] = turn.tool_call_id
            if turn.tool_calls:
                message["tool_calls"] = [self._tool_call(call, f"messages[{i}]") for call in turn.tool_calls]
            if turn.reasoning:
                self._check_text(turn.reasoning, f"messages[{i}].reasoning", markers=True)
                message["reasoning_content"] = turn.reasoning
            conversation.append(message)
        for k, tool in enumerate(tools or []):
            for text in _strings(tool):  # a template may render any of them as it is
                self._check_text(text, f"tools[{k}]", markers=True)
        kwargs = template_kwargs or {}
        taken = sorted(set(kwargs) & self._template_names)
        if taken:
            raise InvalidRequest(
                f"chat_template_kwargs: {', '.join(taken)} is the chat template's own", metadata=_KWARGS
            )
        for text in _strings(kwargs):
            self._check_text(text, "chat_template_kwargs", markers=True)
        for k, document in enumerate(documents or []):
            for text in _strings(document):
                self._check_text(text, f"documents[{k}]", markers=True)
        sent = [kinds[kind] for turn in turns for kind, _ in turn.parts if kind != "text"]
        if sorted(sent) != sorted(m.modality for m in media):
            raise InternalError("the conversation's media parts do not match its media")
        try:
            rendered: str = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **({"tools": tools} if tools else {}),
                **({"documents": documents} if documents else {}),
                **kwargs,
            )
        except Exception as exc:  # a template's raise_exception(): it refuses this conversation's shape
            raise InvalidRequest(
                f"{'the request' if own else 'the model'}'s chat template refused the conversation: {exc}",
                metadata={"param": "chat_template"} if own else {},
            ) from exc
        for whole, marker in self._wrapped.items():
            rendered = rendered.replace(whole, marker)
        found = [self._by_marker[m] for m in self._marker_re.findall(rendered)]
        if sorted(found) != sorted(sent):
            raise InvalidRequest(
                f"the model's chat template placed {_names(found)} for the conversation's {_names(sent)}; "
                "it does not render every image and video part once"
            )
        return Rendered(rendered, found)

    def _tool_call(self, call: ToolCall, where: str) -> dict[str, Any]:
        """A call as templates take it: {"id", "type": "function", "function":
        {"name", "arguments": a dict}} (its text, when not a JSON object)."""
        for text in (call.id, call.name, call.arguments):
            self._check_text(text, f"{where}.tool_calls", markers=True)
        try:
            arguments: Any = strict_json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = call.arguments
        if not isinstance(arguments, dict):
            arguments = call.arguments
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}

    def _check_text(self, text: str, where: str, *, markers: bool = False) -> None:
        """User text may not hold the model's control tokens (nor, with
        `markers`, its media markers): they would be tokenized into the
        tokens themselves."""
        for token in (*self._control, *self._structural, *(self._by_marker if markers else ())):
            if token in text:
                raise InvalidRequest(
                    f"{where} contains {token!r}, a control token of this model; it cannot be sent as text",
                    metadata={"param": "prompt" if where == "the prompt" else where},
                )

    def _tokenize(
        self, text: str, found: list[int], media: list[Media], *, templated: bool | None = None, special: bool = True
    ) -> BuiltPrompt:
        """`text` with each marker expanded into its item's placeholders
        (`found`: the markers' modalities in text order), tokenized in one
        call, with each item's placeholder runs."""
        if templated is None:
            templated = self.chat_template is not None
        # The k-th marker of a modality takes the k-th item of that modality.
        queues = {m: [i for i, item in enumerate(media) if item.modality == m] for m in set(found)}
        pieces = self._marker_re.split(text)
        expanded = [pieces[0]]
        in_text: list[int] = []  # the items (their places in `media`) in the order of their markers
        for modality, piece in zip(found, pieces[1:], strict=True):
            in_text.append(queues[modality].pop(0))
            item = media[in_text[-1]]
            expanded.append(self.family.expand(modality, item.tokens, item.times))
            expanded.append(piece)
        full = "".join(expanded)
        # A template that writes the BOS itself must not get a second one.
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = special and not (templated and bos and full.startswith(bos))
        ids: list[int] = list(self.tokenizer(full, add_special_tokens=add_special)["input_ids"])
        return BuiltPrompt(ids, self._runs(ids, media, in_text))

    def _render(self, text: str, modalities: list[int], *, media_first: bool) -> str:
        """The prompt as one user turn of the chat template: its text and
        media parts in order (markers already normalized), or the media
        parts first when the text has no markers."""
        kinds = {IMAGE: "image", VIDEO: "video"}
        content: list[dict[str, str]] = []
        if media_first:
            content += [{"type": kinds[m]} for m in modalities]
        for i, piece in enumerate(self._marker_re.split(text)):
            if i:
                content.append({"type": kinds[modalities[i - 1]]})
            if piece:
                content.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": content}]
        rendered: str = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )
        for whole, marker in self._wrapped.items():
            rendered = rendered.replace(whole, marker)
        return rendered

    def _runs(self, ids: list[int], media: list[Media], in_text: list[int]) -> list[list[tuple[int, int]]]:
        """Each item's placeholder positions as runs (in the order of
        `media`): the items, in the order of their markers (`in_text`), take
        the positions of their placeholder token in turn (modalities may
        share one: InternVL's video frames are image placeholders)."""
        positions: dict[int, list[int]] = {p.token_id: [] for p in self.holders.values()}
        for i, token in enumerate(ids):
            if token in positions:
                positions[token].append(i)
        taken = dict.fromkeys(positions, 0)
        found: dict[int, list[tuple[int, int]]] = {}
        for k in in_text:
            item = media[k]
            token = self.holders[item.modality].token_id
            start = taken[token]
            mine = positions[token][start : start + item.tokens]
            taken[token] = start + item.tokens
            if len(mine) != item.tokens:
                raise InternalError("the tokenized prompt lost placeholder tokens")
            item_runs: list[tuple[int, int]] = []
            for p in mine:
                if item_runs and item_runs[-1][0] + item_runs[-1][1] == p:
                    item_runs[-1] = (item_runs[-1][0], item_runs[-1][1] + 1)
                else:
                    item_runs.append((p, 1))
            found[k] = item_runs
        if any(taken[t] != len(positions[t]) for t in positions) or len(found) != len(media):
            raise InternalError("the tokenized prompt has more placeholder tokens than its media")
        return [found[k] for k in range(len(media))]


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
