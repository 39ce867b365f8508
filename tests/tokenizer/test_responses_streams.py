"""The Responses API's answers over random outputs (`openai_responses.Answer`),
seeded: for every way of finding tool calls (none, a named function,
"required", each --tool-call-parser), with --reasoning-parser or not (the
prompt opening the thinking or not), and outputs cut anywhere, the stream's
events are numbered from 0 without a gap, every output item of the final object
was added once and done once, in its order, its text deltas make the final
message's text (at the message's index), its reasoning deltas the reasoning
item's text, and each call's argument deltas its arguments; and random Responses
bodies end in a chat request or a typed refusal, nothing else (the
throwaway fuzz of stop 58, kept small and seeded)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from mmsplit.errors import MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from tokenizer_svc import openai_api
from tokenizer_svc.openai_answers import Choices
from tokenizer_svc.openai_responses import Answer, to_chat
from tokenizer_svc.reasoning import Think
from tokenizer_svc.tool_calls import Forced, Hermes, Llama3Json, Pythonic


class Chars:
    """A stand-in tokenizer whose token ids are characters' code points."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


THINK = Think(Chars())

OUTPUTS = [
    "",
    "Plain words.",
    '{"a": 1}',
    '[{"name": "f", "parameters": {"a": 2}}]',
    'Let me see. <tool_call>{"name": "f", "arguments": {"a": 3}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"b": 1}}</tool_call>',
    '[f(a=1), g(b="x")]',
    '{"name": "f", "parameters": {"a": 4}}; {"name": "g", "arguments": {}}',
    "<tool_call>{broken",
    "[not python(",
    "<think>\nFirst a.\n</think>\n\nThen b.",
    'Inside already.</think>\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "<think>cut short",
]
WAYS = [None, Forced("f"), Forced(""), Hermes(), Hermes(single=True), Llama3Json(), Pythonic()]


def _pieces(rng: random.Random, text: str) -> list[str]:
    """`text` cut at random places (a stream's deltas), maybe cut short."""
    if rng.random() < 0.3:
        text = text[: rng.randint(0, len(text))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def test_streamed_events_always_make_the_final_response() -> None:
    rng = random.Random(58)
    for _ in range(1500):
        calls = rng.choice(WAYS)
        thinks = rng.random() < 0.5
        answer = Answer("r", "m", {"input": "x"}, calls, reasoning=THINK if thinks else None)
        choices = Choices(1)
        events = answer.opening(1)
        if thinks:
            answer.prompted(0, [ord(c) for c in rng.choice(["assistant\n", "assistant\n<think>\n"])])
        for piece in _pieces(rng, rng.choice(OUTPUTS)):
            shown = choices.add(0, pb.GenerateResponse(delta=pb.TextDelta(text=piece)))
            assert shown is not None
            events += answer.step(0, shown, choices.text[0])
        finished = pb.Finished(finish_reason=rng.choice([1, 2]), prompt_tokens=3, completion_tokens=2)
        choices.add(0, pb.GenerateResponse(finished=finished))
        events += answer.closing(choices, True)
        json.dumps(events)  # every event is JSON
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert events[-1]["type"] == ("response.completed" if final["status"] == "completed" else "response.incomplete")
        texts = "".join(i["content"][0]["text"] for i in final["output"] if i["type"] == "message")
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == texts, (calls, choices.text[0])
        for item in (i for i in final["output"] if i["type"] == "function_call"):
            streamed = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
            assert "".join(e["delta"] for e in streamed if e["item_id"] == item["id"]) == item["arguments"]
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [i["id"] for i in final["output"]], (calls, choices.text[0])
        done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
        assert done == [i["id"] for i in final["output"]], (calls, choices.text[0])
        at = [k for k, i in enumerate(final["output"]) if i["type"] == "message"]
        assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} <= set(at)
        thought = [i["content"][0]["text"] for i in final["output"] if i["type"] == "reasoning"]
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert streamed == "".join(thought), (calls, choices.text[0])
        assert not thought or final["output"][0]["type"] == "reasoning"
        if not thinks:
            assert not thought


ATOMS: list[Any] = [None, True, 0, 2, "", "x", "user", "assistant", "developer", "tool", "message",
                    "function_call", "function_call_output", "input_text", "input_image", "output_text",
                    "json_schema", "auto", "required", "data:image/png;base64,AA", [], {}]  # fmt: skip
KEYS = ["type", "role", "content", "text", "image_url", "file_id", "call_id", "name", "arguments", "output",
        "format", "schema", "parameters"]  # fmt: skip
TOP = ["input", "instructions", "max_output_tokens", "temperature", "text", "tools", "tool_choice", "store",
       "previous_response_id", "include", "top_logprobs", "truncation", "seed", "stop"]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.4:
        return rng.choice(ATOMS)
    if roll < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_random_responses_bodies_map_to_chat_or_a_typed_refusal() -> None:
    rng = random.Random(58)
    mapped = 0
    for _ in range(3000):
        body = {k: _value(rng) for k in rng.sample(TOP, rng.randint(0, 6))}
        if rng.random() < 0.7:
            item = {"role": rng.choice(["user", "assistant", "system"]), "content": rng.choice(["hi", _value(rng)])}
            body["input"] = rng.choice(["hello", [item, _value(rng)], [item]])
        try:
            chat, _ = to_chat(body)
            openai_api.parse_chat(chat, rng.choice(["none", "hermes"]))
            mapped += 1
        except MmsplitError:
            pass  # a typed refusal; anything else fails the test
    assert mapped > 100  # the generator reaches the mapping, not only the refusals
