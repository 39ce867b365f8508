"""The Responses API's stored responses (`--responses-store-bytes`): what
`previous_response_id`, `GET /v1/responses/{id}` and `DELETE` read.

Each entry is a Response object as it was answered and the conversation
that led to it, its output included, as chat messages (without the
request's `instructions`, which OpenAI does not carry over either), so a
request naming it as `previous_response_id` continues that conversation.
Entries live in this tokenizer's memory and are lost on restart; once the
store is over its bytes, the owner holding the most bytes loses its least
recently used entry first, so one API key's flood of stored responses
pushes out its own before another's (an entry larger than the whole store
is not kept): with several tokenizer replicas a
client must come back to the same one (session affinity) or send the
whole conversation. With API keys an entry belongs to the key that made
it: another key finds nothing (the same 404 as an unknown id).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, its output's last
    owner: bytes  # a digest of the API key that made it (empty without keys)
    nbytes: int
    inputs: int = 0  # the conversation's messages before the output (what made the response)

    def input_items(self) -> list[dict[str, Any]]:
        """The Responses API's items that made the response, oldest first:
        its input and its predecessors' turns, each with a stable id."""
        items: list[dict[str, Any]] = []
        stem = self.response["id"].removeprefix("resp_")
        for k, message in enumerate(self.conversation[: self.inputs]):
            items += _items_of(message, f"{stem}_{k}")
        return items


def _items_of(message: dict[str, Any], stem: str) -> list[dict[str, Any]]:
    """A chat message as Responses items (`openai_responses.to_chat`, back)."""
    role = message["role"]
    if role == "tool":
        return [{"type": "function_call_output", "id": f"fco_{stem}", "call_id": message.get("tool_call_id"),
                 "output": message.get("content"), "status": "completed"}]  # fmt: skip
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        items.append({"type": "reasoning", "id": f"rs_{stem}", "status": "completed", "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})  # fmt: skip
    content = message.get("content")
    if content is not None:
        kind = "output_text" if role == "assistant" else "input_text"
        parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if isinstance(content, str) else content
        shown: list[dict[str, Any]] = []
        for part in parts:
            if part.get("type") == "text":
                shown.append(
                    {"type": kind, "text": part.get("text"), **({"annotations": []} if role == "assistant" else {})}
                )
            else:
                image = part.get("image_url") or {}
                shown.append({"type": "input_image", "image_url": image.get("url"), "detail": "auto"})
        items.append({"type": "message", "id": f"msg_{stem}", "role": role, "status": "completed", "content": shown})
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        items.append({"type": "function_call", "id": f"fc_{stem}_{j}", "call_id": call.get("id"), "name": name,
                      "arguments": arguments, "status": "completed"})  # fmt: skip
    return items


def owner_of(key: str | None) -> bytes:
    """What an entry is filed under for a client presenting `key` (None: no keys)."""
    return b"" if key is None else hashlib.sha256(key.encode()).digest()


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A Response's output as chat messages: one assistant turn of its
    thinking (--reasoning-parser), its text and its function calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    for item in response.get("output") or []:
        if item.get("type") == "reasoning":
            turn["reasoning_content"] = "".join(part.get("text", "") for part in item.get("content") or [])
        elif item.get("type") == "message":
            turn["content"] = "".join(part.get("text", "") for part in item.get("content") or [])
        elif item.get("type") == "function_call":
            call = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
    return [turn] if turn["content"] is not None or "tool_calls" in turn or "reasoning_content" in turn else []


def json_size(value: Any) -> int:
    """About the bytes `value` takes as JSON (strings by their length: no
    copy of a conversation's data: URLs is made to count them)."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, dict):
        return 2 + sum(len(k) + 4 + json_size(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return 2 + sum(1 + json_size(v) for v in value)
    return 8


class ResponseStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        # Each owner's entries, least recently used first, and the bytes they hold.
        self._owners: dict[bytes, OrderedDict[str, Stored]] = {}
        self._held: dict[bytes, int] = {}
        self._entries: dict[str, Stored] = {}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: bytes) -> bool:
        """Keep `response` (under its id) and `conversation` (the messages up
        to it, its output included); False when it alone is over the store,
        or its id is another owner's entry (a client's X-Request-Id names
        the response: it may not replace another's)."""
        size = json_size(response) + json_size(conversation)
        if not self.enabled or size > self.capacity:
            if self.enabled:
                log.warning("response %s (%d bytes) is larger than the whole store: not kept", response["id"], size)
            return False
        rid = response["id"]
        if rid in self._entries and not self.delete(rid, owner):
            log.warning("response %s: the id is another client's stored response: not kept", rid)
            return False
        outputs = len(output_messages(response))
        entry = self._entries[rid] = Stored(response, conversation, owner, size, len(conversation) - outputs)
        self._owners.setdefault(owner, OrderedDict())[rid] = entry
        self._held[owner] = self._held.get(owner, 0) + size
        self.nbytes += size
        while self.nbytes > self.capacity:
            heaviest = max(self._held, key=self._held.__getitem__)
            oldest = next(iter(self._owners[heaviest]))
            self.delete(oldest, heaviest)
        return True

    def get(self, rid: str, owner: bytes) -> Stored | None:
        """The entry `rid` of `owner` (now the most recently used), or None."""
        entry = self._entries.get(rid)
        if entry is None or entry.owner != owner:
            return None
        self._owners[owner].move_to_end(rid)
        return entry

    def delete(self, rid: str, owner: bytes) -> bool:
        entry = self._entries.get(rid)
        if entry is None or entry.owner != owner:
            return False
        del self._entries[rid]
        del self._owners[owner][rid]
        self._held[owner] -= entry.nbytes
        if not self._owners[owner]:
            del self._owners[owner], self._held[owner]
        self.nbytes -= entry.nbytes
        return True
