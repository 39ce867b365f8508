"""--reasoning-parser (tokenizer_svc/reasoning.py, and the chat answers of
tokenizer_svc/openai_answers.py that use it): a thinking model's output
split into reasoning and content, whole and streamed, the stream's pieces
adding up to the whole answer's for any chunking."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmsplit.common.v1 import common_pb2
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.openai_answers import Choices, Shape
from tokenizer_svc.reasoning import Stream, Think


class Chars:
    """A stand-in tokenizer whose token ids are characters' code points."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


THINK = Think(Chars())


@pytest.mark.parametrize(
    ("output", "opened", "reasoning", "content"),
    [
        # Qwen3's hybrid template: the model opens its thinking itself.
        ("<think>\nThe sum is 4.\n</think>\n\nIt is 4.", False, "The sum is 4.", "It is 4."),
        # DeepSeek-R1, the Qwen3 Thinking models: the prompt opened it.
        ("The sum is 4.\n</think>\n\nIt is 4.", True, "The sum is 4.", "It is 4."),
        # No thinking: all content, as it came.
        ("  It is 4. <think> is a tag", False, None, "  It is 4. <think> is a tag"),
        # Cut short inside the thinking: all of it reasoning.
        ("<think>\nThe sum is", False, "The sum is", ""),
        ("The sum is\n", True, "The sum is", ""),
        # An empty thinking (enable_thinking false in a template that leaves it to the model).
        ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),
        ("", True, "", ""),
        ("", False, None, ""),
    ],
)
def test_an_output_splits_into_its_reasoning_and_its_content(
    output: str, opened: bool, reasoning: str | None, content: str
) -> None:
    assert THINK.split(output, opened) == (reasoning, content)


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
        ("<｜User｜>Hi<｜Assistant｜><think>", True),  # noqa: RUF001 (DeepSeek-R1's own markers)
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking false
        ("<think>\nan earlier turn's</think>\n<|im_start|>assistant\n", False),
    ],
)
def test_the_prompt_says_whether_the_model_starts_inside_its_thinking(prompt: str, opened: bool) -> None:
    assert THINK.opens(ids(prompt)) is opened


def test_opens_reads_the_tags_in_a_real_tokenizer_s_pieces(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """A tokenizer with no token of its own for the tags (the tiny models'
    writes ``<think>`` as three): the prompt's last tokens decoded hold it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    think = Think(tokenizer)
    assert think.opens(tokenizer.encode("[INST] Hi [/INST] <think>\n"))
    assert not think.opens(tokenizer.encode("[INST] Hi [/INST] <think>\n\n</think>\n\n"))
    assert not think.opens(tokenizer.encode("[INST] Hi [/INST]"))


def test_a_real_tokenizer_with_the_tags_as_tokens_is_read_by_their_ids(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """The tiny tokenizer given ``<think>`` and ``</think>`` as tokens of
    their own (added tokens, as Qwen3's vocabulary has them): the prompt's
    tags and the output's end tag are found by their ids, and say what the
    text says."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens(["<think>", "</think>"])
    think = Think(tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (think._start_id, think._end_id) == (start, end)
    opened = tokenizer.encode("[INST] Hi [/INST] <think>\n", add_special_tokens=False)
    assert start in opened
    assert think.opens(opened)
    assert not think.opens(tokenizer.encode("[INST] Hi [/INST] <think>\n\n</think>\n\n", add_special_tokens=False))
    assert not think.opens(tokenizer.encode("<think>a</think> [INST] Hi [/INST]", add_special_tokens=False))
    # Continued inside its thinking, the tag far back (past the ids looked at one by one).
    assert think.opens(
        tokenizer.encode("[INST] Hi [/INST] <think>\nFirst, " + "the sum " * 40, add_special_tokens=False)
    )
    output = tokenizer.encode("the sum is 4</think>\n\nIt is 4.", add_special_tokens=False)
    assert think.tokens(output, True, tokenizer.decode(output)) == output.index(end) + 1


@pytest.mark.parametrize(
    ("output", "opened", "tokens"),
    [
        ("<think>ab</think>cd", False, len("<think>ab</think>")),
        ("ab</think>\ncd", True, len("ab</think>")),
        ("abc", True, 3),  # cut short inside the thinking
        ("abc</think", False, 0),  # no thinking
        ("", True, 0),
    ],
)
def test_the_thinking_s_tokens_are_those_up_to_the_end_tag(output: str, opened: bool, tokens: int) -> None:
    assert THINK.tokens(ids(output), opened) == tokens


class Tagged(Chars):
    """`Chars` with the end tag a token of its own (id 1), as Qwen3's and DeepSeek-R1's vocabularies have it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("</think>" if i == 1 else chr(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] if text == "</think>" else ids(text)


@pytest.mark.parametrize("opened", [False, True])
def test_an_end_tag_of_its_own_is_counted_by_its_place_and_agrees_with_the_text(opened: bool) -> None:
    """With the tag a token of its own the count is that token's place (no
    decoding); it is the count the text alone gives (the bisection)."""
    tagged = Think(Tagged())
    start = [] if opened else ids("<think>")
    output = [*start, *ids("ab c"), 1, *ids("\n\nd"), 1]
    text = Tagged().decode(output)
    assert tagged.tokens(output, opened, text) == len(start) + 5
    assert THINK.tokens(ids(text), opened) == len(text) - len("\n\nd</think>")  # a character a token here


class BothTagged(Chars):
    """`Chars` with both tags tokens of their own (``<think>`` 2, ``</think>`` 1), as in Qwen3's vocabulary."""

    TAGS = {1: "</think>", 2: "<think>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.TAGS.get(i, chr(i)) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ids(text.replace("</think>", "\x01").replace("<think>", "\x02"))


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
        ("<think>\nan earlier turn's</think>\n<|im_start|>assistant\n", False),
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        # continue_final_message inside the thinking: the model goes on thinking.
        ("<|im_start|>assistant\n<think>\nFirst, the sum", True),
        ("<|im_start|>assistant\n<think>\nThe sum is 4.\n</think>\n\nIt is", False),
        # Tags further back than the last ids looked at one by one.
        ("<|im_start|>assistant\n<think>\nFirst, " + "the sum " * 40, True),
        ("<think>\nan earlier turn's</think>\n" + "<|im_start|>user\nAnd then?<|im_end|>\n" * 5, False),
        ("<|im_start|>user\n" + "Hi " * 100, False),
    ],
)
def test_with_tags_of_their_own_the_prompt_s_last_tag_says_it(prompt: str, opened: bool) -> None:
    tokenizer = BothTagged()
    think = Think(tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    assert think.opens(prompt_ids) is opened
    # The tail alone cannot tell a continued thought (what it read before).
    if "First, the sum" in prompt:
        assert THINK.opens(ids(prompt)) is False


# Outputs made of the pieces a thinking model writes, and every way a stream may cut them.
PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "</th", ">", " ", "\n", "\n\n", "a", "b c", "4.", "é"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), opened=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_stream_shows_prefixes_of_the_whole_split(pieces: list[str], opened: bool, cuts: list[int]) -> None:
    """What a stream may show at each point is a prefix of what it may
    show later, and at the end it is the whole output's split."""
    output = "".join(pieces)
    shown: tuple[str, str] = ("", "")
    for cut in [*sorted(c for c in cuts if c < len(output)), len(output)]:
        final = cut == len(output)
        reasoning, content = THINK.split(output[:cut], opened, final)
        now = (reasoning or "", content)
        assert now[0].startswith(shown[0]), (output, cut)
        assert now[1].startswith(shown[1]), (output, cut)
        shown = now
    whole = THINK.split(output, opened)
    assert shown == (whole[0] or "", whole[1])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), opened=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_stream_s_deltas_add_up_to_the_split_at_every_point(pieces: list[str], opened: bool, cuts: list[int]) -> None:
    """`Stream` (what a chat stream uses: linear in the output) gives, fed
    the output so far, exactly what `split` shows of it at that point."""
    output = "".join(pieces)
    stream = Stream(opened)
    added = ["", ""]
    for cut in [*sorted(c for c in cuts if c < len(output)), len(output)]:
        final = cut == len(output)
        reasoning, content = stream.feed(output[:cut], final)
        added = [added[0] + reasoning, added[1] + content]
        shown = THINK.split(output[:cut], opened, final)
        assert added == [shown[0] or "", shown[1]], (output, cut)
        if stream.thinking is not None:
            assert stream.thinking == (shown[0] is not None), (output, cut)
    assert stream.thinking == (THINK.split(output, opened)[0] is not None), output


def _events(output: str, cuts: list[int], prompt: str) -> list[tokenizer_pb2.GenerateResponse]:
    events = [tokenizer_pb2.GenerateResponse(prompt_tokens=tokenizer_pb2.PromptTokens(token_ids=ids(prompt)))]
    at = 0
    for cut in [*sorted({c for c in cuts if 0 < c < len(output)}), len(output)]:
        events.append(tokenizer_pb2.GenerateResponse(delta=tokenizer_pb2.TextDelta(text=output[at:cut])))
        at = cut
    finished = tokenizer_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP, completion_tokens=len(output))
    events.append(tokenizer_pb2.GenerateResponse(finished=finished))
    return events


def _answer(events: list[tokenizer_pb2.GenerateResponse], stream: bool, **shape: Any) -> dict[str, Any]:
    """The chat answer's message, whole, or its stream's deltas added up."""
    out = Shape.of(True, "r", "m", reasoning=THINK, **shape)
    choices = Choices(1, Chars())
    added: dict[str, Any] = {}
    for event in events:
        if event.WhichOneof("event") == "prompt_tokens":  # as tokenizer_svc/http_api.py does
            out.prompted(0, list(event.prompt_tokens.token_ids))
        shown = choices.add(0, event)
        if shown is None or not stream:
            continue
        for chunk in out.step(0, shown, choices.text[0]):
            for key, value in chunk["choices"][0]["delta"].items():
                added[key] = added.get(key, "") + value if isinstance(value, str) else value
            if chunk["choices"][0]["finish_reason"]:
                added["finish_reason"] = chunk["choices"][0]["finish_reason"]
    if not stream:
        answer = out.complete(choices)["choices"][0]
        return {**answer["message"], "finish_reason": answer["finish_reason"]}
    return added


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), opened=st.booleans(), cuts=st.lists(st.integers(1, 60), max_size=8))
def test_a_streamed_chat_answer_adds_up_to_the_whole_one(pieces: list[str], opened: bool, cuts: list[int]) -> None:
    output = "".join(pieces)
    prompt = "assistant\n<think>\n" if opened else "assistant\n"
    whole = _answer(_events(output, cuts, prompt), stream=False)
    streamed = _answer(_events(output, cuts, prompt), stream=True)
    reasoning, content = THINK.split(output, opened)
    assert whole["reasoning"] == whole["reasoning_content"] == (reasoning or None)
    assert whole["content"] == (content or None if reasoning is not None else content)
    assert streamed.get("reasoning", "") == streamed.get("reasoning_content", "") == (reasoning or "")
    assert streamed.get("content", "") == content
    assert streamed["finish_reason"] == whole["finish_reason"] == "stop"


def test_include_reasoning_false_leaves_the_thinking_out_and_the_content_as_it_was() -> None:
    """vLLM's include_reasoning: false: no reasoning in the answer, whole
    or streamed; the content is what it is with the thinking shown."""
    output, prompt = "<think>\nFirst a.\n</think>\n\nThen b.", "assistant\n"
    shown = _answer(_events(output, [4, 20], prompt), stream=False)
    for stream in (False, True):
        hidden = _answer(_events(output, [4, 20], prompt), stream=stream, shows_reasoning=False)
        assert hidden.get("reasoning") is None, hidden
        assert hidden.get("reasoning_content") is None, hidden
        assert hidden["content"] == shown["content"] == "Then b."


def test_structured_output_is_refused_where_the_prompt_opens_the_thinking() -> None:
    """A grammar holds from the first token, where such a model thinks:
    INVALID_REQUEST; where the prompt closed the thinking it is taken."""
    refused = _events("x", [], "assistant\n<think>\n")
    with pytest.raises(InvalidRequest, match="enable_thinking"):
        _answer(refused, stream=True, constrained=True)
    with pytest.raises(InvalidRequest, match="enable_thinking"):
        _answer(refused, stream=False, constrained=True)
    taken = _answer(_events('{"a": 1}', [3], "assistant\n<think>\n\n</think>\n\n"), stream=False, constrained=True)
    assert (taken["content"], taken["reasoning"]) == ('{"a": 1}', None)


def test_responses_reasoning_items_go_back_to_the_template_with_their_turn() -> None:
    """A Responses input that sends an earlier output back (a reasoning
    item, the message, a call) is one assistant turn with its thinking as
    reasoning_content; a stored answer's conversation keeps it, and lists
    it again as a reasoning item."""
    from tokenizer_svc import openai_api, response_store
    from tokenizer_svc.openai_responses import to_chat

    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Add them."}]}  # fmt: skip
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 4."}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    chat, _ = to_chat({"model": "m", "input": [
        {"role": "user", "content": "2+2?"}, thought, said, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
    ]})  # fmt: skip
    turn = chat["messages"][1]
    assert (turn["role"], turn["reasoning_content"], len(chat["messages"])) == ("assistant", "Add them.", 3)
    assert turn["content"] == [{"type": "text", "text": "It is 4."}]
    assert turn["tool_calls"][0]["id"] == "call_1"
    assert openai_api.parse_chat(chat).request.messages[1].reasoning == "Add them."
    with pytest.raises(InvalidRequest, match="reasoning_text"):
        to_chat({"model": "m", "input": [{"type": "reasoning", "content": "not a list"}]})

    output = [{**thought, "status": "completed"}, {**said, "id": "msg_1", "status": "completed"}]
    turns = response_store.output_messages({"output": output})
    assert turns == [{"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."}]
    items = response_store._items_of(turns[0], "x")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "Add them."
