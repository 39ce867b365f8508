"""JSON that holds only text: `json.loads`, refusing lone UTF-16 surrogates.

JSON lets a string escape any UTF-16 code unit, so `"\\ud800"` parses, in
Python, to a string holding a lone surrogate: not a character, and not
encodable as UTF-8. Such a string breaks wherever text goes next (protobuf
refuses to serialize it, a tokenizer cannot encode it), far from where it
came in. Every JSON a client sends (the HTTP body, and JSON carried inside
a string: tool parameters, chat_template_kwargs, a schema) is read here, so
the request is refused where it is read, naming the place. A surrogate
pair (`"\\ud83d\\ude00"`, how `ensure_ascii` encoders write an emoji) is one
character and is fine.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A document can only hold a surrogate through a \uD800-\uDFFF escape: raw
# UTF-8 cannot encode one. Only a document with such an escape (or what
# looks like one) is walked.
_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_ESCAPE_BYTES = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LONE = re.compile("[\ud800-\udfff]")


class LoneSurrogate(json.JSONDecodeError):
    """A string of the document holds a lone surrogate: `where` names it,
    `param` is its path (the object's, for a key; "" for the document)."""

    def __init__(self, where: str, param: str) -> None:
        super().__init__(f"{where} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair)", "", 0)
        self.where = where
        self.param = param

    def __str__(self) -> str:
        return self.msg


def loads(document: str | bytes | bytearray) -> Any:
    """`json.loads(document)`; LoneSurrogate (a JSONDecodeError) when a key
    or string value holds a lone surrogate."""
    value = json.loads(document)
    escaped = _ESCAPE.search(document) if isinstance(document, str) else _ESCAPE_BYTES.search(document)
    if escaped is not None:
        found = _lone(value, "")
        if found is not None:
            raise LoneSurrogate(*found)
    return value


def _lone(value: Any, path: str) -> tuple[str, str] | None:
    """The first string (key or value) holding a surrogate: how to name it,
    and its path (its object's, for a key)."""
    stack = [(value, path)]
    while stack:  # not recursive: json.loads nests deeper than Python recurses
        node, at = stack.pop()
        if isinstance(node, str):
            if _LONE.search(node):
                return at or "the document", at
        elif isinstance(node, dict):
            for key, item in reversed(node.items()):
                if _LONE.search(key):
                    return (f"a key of {at}" if at else "a key"), at
                stack.append((item, f"{at}.{key}" if at else key))
        elif isinstance(node, list):
            stack.extend((item, f"{at}[{i}]") for i, item in reversed(list(enumerate(node))))
    return None
