"""The Responses API's store (`tokenizer_svc/response_store.py`): least
recently used out first within its bytes, the heaviest owner's first, an
entry over the whole store not kept, each entry its owner's alone (another key reads, deletes and
replaces nothing of it), and a response's output as the chat turn that
carries its conversation on."""

from __future__ import annotations

import json
from typing import Any

from tokenizer_svc.response_store import ResponseStore, json_size, output_messages, owner_of

ALICE, BOB = owner_of("sk-alice"), owner_of("sk-bob")


def response(rid: str, text: str = "hi") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": rid, "object": "response", "output": [{"type": "message", "role": "assistant", "content": [part]}]}


def size(rid: str, conversation: list[dict[str, Any]], text: str = "hi") -> int:
    return json_size(response(rid, text)) + json_size(conversation)


def test_an_entry_is_counted_about_as_its_json() -> None:
    """Without serializing it (a conversation's images are data: URLs of megabytes)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    conversation = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "f", "arguments": '{"a": 1}'}}]}]  # fmt: skip
    for value in (conversation, response("resp_1", "x" * 5000)):
        assert 0.95 <= json_size(value) / len(json.dumps(value)) <= 1.2


def test_the_least_recently_used_go_first_and_the_store_stays_within_its_bytes() -> None:
    turn = [{"role": "user", "content": "x" * 100}]
    one = size("resp_0", turn)
    store = ResponseStore(3 * one + one // 2)
    for k in range(3):
        assert store.put(response(f"resp_{k}"), turn, ALICE)
    assert store.get("resp_0", ALICE) is not None  # now the most recently used
    assert store.put(response("resp_3"), turn, ALICE)
    assert store.get("resp_1", ALICE) is None  # the least recently used went
    assert [store.get(f"resp_{k}", ALICE) is not None for k in (0, 2, 3)] == [True, True, True]
    assert store.nbytes == 3 * one <= store.capacity
    assert not store.put(response("resp_big", "y" * store.capacity), turn, ALICE)  # over the whole store
    assert len(store) == 3
    assert store.delete("resp_2", ALICE)
    assert store.nbytes == 2 * one


def test_an_entry_is_its_owner_s_alone() -> None:
    store = ResponseStore(1 << 20)
    assert store.put(response("resp_a"), [], ALICE)
    assert store.get("resp_a", BOB) is None
    assert not store.delete("resp_a", BOB)
    assert not store.put(response("resp_a", "bob's"), [], BOB)  # a chosen id does not replace another's
    entry = store.get("resp_a", ALICE)
    assert entry is not None
    assert entry.response["output"][0]["content"][0]["text"] == "hi"
    assert store.put(response("resp_a", "again"), [], ALICE)  # its owner's own replaces it
    assert len(store) == 1
    assert store.nbytes == size("resp_a", [], "again")
    assert not ResponseStore(0).put(response("resp_x"), [], ALICE)
    assert owner_of(None) == b""


def test_a_response_s_output_is_one_assistant_turn_of_its_text_and_calls() -> None:
    text = response("resp_t", "Sunny.")
    assert output_messages(text) == [{"role": "assistant", "content": "Sunny."}]
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
    both = {"output": [*text["output"], call]}
    assert output_messages(both) == [{"role": "assistant", "content": "Sunny.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]  # fmt: skip
    assert output_messages({"output": [call]})[0]["content"] is None
    assert output_messages({"output": []}) == []


def test_the_owner_holding_the_most_loses_its_own_first() -> None:
    """One key storing response after response pushes out its own oldest,
    not another key's older ones."""
    turn = [{"role": "user", "content": "x" * 100}]
    one = size("resp_b00", turn)  # every id of the same length
    store = ResponseStore(6 * one)
    for k in range(2):
        assert store.put(response(f"resp_b{k:02d}"), turn, BOB)
    for k in range(20):
        assert store.put(response(f"resp_a{k:02d}"), turn, ALICE)
    assert store.get("resp_b00", BOB) is not None
    assert store.get("resp_b01", BOB) is not None
    assert [k for k in range(20) if store.get(f"resp_a{k:02d}", ALICE) is not None] == [16, 17, 18, 19]
    assert store.nbytes == 6 * one == store.capacity
    assert len(store) == 6


def test_input_items_are_the_turns_that_made_a_response_with_stable_ids() -> None:
    """Everything before the output, as Responses items: messages (text and
    images), an assistant's text and calls, a tool's result; the output not
    among them; the same ids every time."""
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    answer = response("resp_x", "Rain.")
    store = ResponseStore(1 << 20)
    assert store.put(answer, [*conversation, *output_messages(answer)], ALICE)
    entry = store.get("resp_x", ALICE)
    assert entry is not None
    items = entry.input_items()
    assert [(i["type"], i.get("role")) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("function_call", None), ("function_call_output", None),
        ("message", "user"),
    ]  # fmt: skip
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"}
    assert items[0]["content"] == [{"type": "input_text", "text": "Weather?"}, image]
    assert items[1]["content"] == [{"type": "output_text", "text": "Let me see.", "annotations": []}]
    assert (items[2]["call_id"], items[2]["name"], items[3]["output"]) == ("call_1", "w", "sunny")
    assert len({i["id"] for i in items}) == len(items)
    assert entry.input_items() == items
