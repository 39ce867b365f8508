"""The client library refuses, before anything is sent, the arguments it
cannot turn into a request: each a ValueError or TypeError saying what
to give instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mmsplit.client import build_request, read_secret


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"messages": [("robot", "hi")]}, ValueError, "role 'robot' is not one of"),
        ({"messages": [("user", ["hi", 5])]}, TypeError, "not int"),
        ({"prompt": "x", "tool_choice": "sometimes"}, ValueError, 'tool_choice is "auto" or "required"'),
        ({"prompt": "x", "tool_choice": "auto", "call_tool": "f"}, ValueError, "name a tool with call_tool"),
        ({"prompt": "x", "length_penalty": 1.5}, ValueError, "give beam_width"),
        ({"prompt": "x", "n": 2, "beam_width": 2}, ValueError, "not both"),
    ],
)
def test_arguments_that_make_no_request_are_refused_saying_why(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build_request(**kwargs)


def test_the_arguments_beside_those_make_their_request() -> None:
    assert build_request("x", tool_choice="required").tool_choice.required
    assert build_request("x", call_tool="f").tool_choice.function == "f"
    assert build_request("x", beam_width=2, length_penalty=1.5).beam_search.length_penalty == 1.5


def test_a_secret_file_gives_its_first_secret_and_one_with_none_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("# the API key\n\n  sk-first  \nsk-second\n")
    assert read_secret(str(tmp_path / "key")) == "sk-first"
    (tmp_path / "empty").write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="holds no secret"):
        read_secret(str(tmp_path / "empty"))
