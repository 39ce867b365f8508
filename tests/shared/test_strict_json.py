"""JSON that holds only text (`mmsplit_server.strict_json`)."""

from __future__ import annotations

import json

import pytest

from mmsplit_server import strict_json


@pytest.mark.parametrize(
    ("document", "where", "param"),
    [
        ('"\\ud800"', "the document", ""),
        ('{"a": [1, {"b": "x\\uDFFF"}]}', "a[1].b", "a[1].b"),
        ('{"a": {"\\udc00": 1}}', "a key of a", "a"),
        ('{"\\ud83d": 1}', "a key", ""),
        ('["ok", "\\ude00\\ud83d"]', "[1]", "[1]"),  # the pair's halves in the wrong order
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_place(document: str, where: str, param: str) -> None:
    for form in (document, document.encode()):
        with pytest.raises(json.JSONDecodeError) as refused:  # what callers already catch
            strict_json.loads(form)
        assert isinstance(refused.value, strict_json.LoneSurrogate)
        assert (refused.value.where, refused.value.param) == (where, param)
        said = f"{where} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair)"
        assert str(refused.value) == said


@pytest.mark.parametrize(
    "document",
    [
        '{"emoji": "\\ud83d\\ude00"}',  # a pair is one character (ensure_ascii encoders write it so)
        '{"text": "\\\\ud800"}',  # an escaped backslash: the six characters \ud800, not an escape
        '{"a": [1, 2.5, null, true, "\\u00e9"]}',
        "[" * 50 + "]" * 50,
    ],
)
def test_text_parses_as_json_loads_does(document: str) -> None:
    assert strict_json.loads(document) == json.loads(document)
    assert strict_json.loads(document.encode()) == json.loads(document)
