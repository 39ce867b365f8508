"""A conversation's shape as the tokenizer checks it (tokenizer_svc/
conversation.py): tool calls only in assistant turns, tool turns naming
the call they answer, tools that the template can take; each refusal
names its place in the request."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from tests.support import family_kit
from tokenizer_svc import conversation
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.settings import TokenizerSettings

USER = pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=[pb.ContentPart(text="What is the weather?")])
CALL = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
ASKED = pb.ChatMessage(role=pb.CHAT_ROLE_ASSISTANT, tool_calls=[CALL])
ANSWERED = pb.ChatMessage(role=pb.CHAT_ROLE_TOOL, content=[pb.ContentPart(text="sunny")], tool_call_id="call_1")
TOOL = pb.Tool(name="get_weather", description="The weather.", parameters='{"type": "object"}')


@pytest.fixture(scope="module")
def parse(family_models: Callable[[str], Path]) -> Callable[[pb.GenerateRequest], conversation.Parsed]:
    model_dir = family_models("qwen2-vl")
    settings = TokenizerSettings(model_dir=model_dir)
    family = family_kit.kit(model_dir).family
    return lambda request: conversation.parse(request, settings, family)


def test_continue_final_message_and_chat_template_kwargs_are_parsed(
    parse: Callable[[pb.GenerateRequest], conversation.Parsed],
) -> None:
    begun = pb.ChatMessage(role=pb.CHAT_ROLE_ASSISTANT, content=[pb.ContentPart(text="It is")])
    parsed = parse(
        pb.GenerateRequest(
            messages=[USER, begun], continue_final_message=True, chat_template_kwargs='{"enable_thinking": false}'
        )
    )
    assert (parsed.continue_final, parsed.template_kwargs) == (True, {"enable_thinking": False})
    assert (parse(pb.GenerateRequest(messages=[USER])).continue_final, parsed.turns[-1].parts) == (  # type: ignore[index]
        False,
        (("text", "It is"),),
    )


def test_a_request_s_chat_template_is_taken_only_where_the_server_trusts_them(
    family_models: Callable[[str], Path],
) -> None:
    model_dir = family_models("qwen2-vl")
    family = family_kit.kit(model_dir).family
    trusting = TokenizerSettings(model_dir=model_dir, trust_request_chat_template=True)
    parsed = conversation.parse(pb.GenerateRequest(messages=[USER], chat_template="{{ 1 }}"), trusting, family)
    assert parsed.chat_template == "{{ 1 }}"
    assert conversation.parse(pb.GenerateRequest(messages=[USER]), trusting, family).chat_template is None
    with pytest.raises(InvalidRequest, match="over 65536 bytes") as refused:
        conversation.parse(pb.GenerateRequest(messages=[USER], chat_template="x" * 65537), trusting, family)
    assert refused.value.metadata["param"] == "chat_template"


def test_documents_are_parsed_in_order_and_count_toward_the_prompt_s_size(
    parse: Callable[[pb.GenerateRequest], conversation.Parsed],
) -> None:
    documents = '[{"title": "A", "text": "alpha"}, {"text": "beta", "title": "B"}]'
    parsed = parse(pb.GenerateRequest(messages=[USER], documents=documents))
    assert [list(d.items()) for d in parsed.documents] == [
        [("title", "A"), ("text", "alpha")],
        [("text", "beta"), ("title", "B")],
    ]
    assert parsed.size == parse(pb.GenerateRequest(messages=[USER])).size + len("titleAtextalphatextbetatitleB")


def test_a_tool_conversation_is_parsed_into_turns_and_template_tools(
    parse: Callable[[pb.GenerateRequest], conversation.Parsed],
) -> None:
    parsed = parse(pb.GenerateRequest(messages=[USER, ASKED, ANSWERED], tools=[TOOL]))
    assert parsed.turns is not None
    assert [t.role for t in parsed.turns] == ["user", "assistant", "tool"]
    (call,) = parsed.turns[1].tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Oslo"}')
    assert parsed.turns[2].tool_call_id == "call_1"
    assert parsed.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                          "parameters": {"type": "object"}}}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("request_", "param", "match"),
    [
        (pb.GenerateRequest(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, tool_calls=[CALL])]),
         "messages[0]", "only assistant messages may call tools"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=USER.content, reasoning="x")]),
         "messages[0]", "only assistant messages may carry reasoning"),
        (pb.GenerateRequest(messages=[USER], split_reasoning=True), "split_reasoning", "needs a tokenizer"),
        (pb.GenerateRequest(messages=[USER, pb.ChatMessage(role=pb.CHAT_ROLE_TOOL, content=ANSWERED.content)]),
         "messages[1]", "a tool message needs a tool_call_id"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=USER.content,
                                                     tool_call_id="x")]),
         "messages[0]", "only tool messages may have a tool_call_id"),
        (pb.GenerateRequest(messages=[USER, pb.ChatMessage(role=pb.CHAT_ROLE_ASSISTANT,
                                                           tool_calls=[pb.ToolCall(name="no spaces")])]),
         "messages[1].tool_calls[0]", "1-64 of"),
        (pb.GenerateRequest(messages=[USER], tools=[TOOL, TOOL]), "tools[1]", "two tools are named"),
        (pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters="[1]")]), "tools[0]", "JSON Schema"),
        (pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters="{")]), "tools[0]", "not JSON"),
        # Counted before any message is read.
        (pb.GenerateRequest(messages=[USER] * 2049), "messages", "2049 messages, at most 2048"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=list(USER.content) * 4097)] * 2),
         "messages", "8194 content parts in all messages, at most 8192"),
        (pb.GenerateRequest(messages=[USER, pb.ChatMessage(role=pb.CHAT_ROLE_ASSISTANT, tool_calls=[CALL] * 129)]),
         "messages[1].tool_calls", "129 tool calls, at most 128"),
        (pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f")] * 129), "tools", "at most 128"),
        (pb.GenerateRequest(prompt="hi", tools=[TOOL]), "tools", "conversation"),
        (pb.GenerateRequest(messages=[USER], continue_final_message=True), "continue_final_message", "assistant"),
        (pb.GenerateRequest(messages=[USER, ASKED], continue_final_message=True), "continue_final_message",
         "with text"),
        (pb.GenerateRequest(prompt="hi", continue_final_message=True), "continue_final_message", "conversation"),
        (pb.GenerateRequest(prompt="hi", chat_template_kwargs='{"a": 1}'), "chat_template_kwargs", "conversation"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs="{"), "chat_template_kwargs", "not JSON"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs='{"a": "\\ud800"}'), "chat_template_kwargs",
         "a holds a lone UTF-16 surrogate"),
        (pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters='{"\\udc00": 1}')]), "tools[0]",
         "a key holds a lone UTF-16 surrogate"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs="[1]"), "chat_template_kwargs", "JSON object"),
        (pb.GenerateRequest(prompt="hi", documents='[{"text": "a"}]'), "documents", "conversation"),
        (pb.GenerateRequest(messages=[USER], chat_template="{{ 1 }}"), "chat_template", "trust-request-chat-template"),
        (pb.GenerateRequest(prompt="hi", chat_template="{{ 1 }}"), "chat_template", "conversation"),
        (pb.GenerateRequest(messages=[USER], documents="[{"), "documents", "not JSON"),
        (pb.GenerateRequest(messages=[USER], documents='{"text": "a"}'), "documents", "a list of at most 64"),
        (pb.GenerateRequest(messages=[USER], documents="[" + ",".join(['{"t": "a"}'] * 65) + "]"), "documents",
         "a list of at most 64"),
        (pb.GenerateRequest(messages=[USER], documents='[{"text": "a"}, {"page": 3}]'), "documents",
         r"documents\[1\] must be an object whose values are strings"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs='{"two words": 1}'), "chat_template_kwargs",
         "not a name"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs='{"_private": 1}'), "chat_template_kwargs",
         "not a name"),
        (pb.GenerateRequest(messages=[USER], chat_template_kwargs='{"a": "' + "x" * 70_000 + '"}'),
         "chat_template_kwargs", "over 65536 bytes"),
    ],
)  # fmt: skip
def test_tool_shapes_the_template_cannot_take_are_refused_naming_their_place(
    parse: Callable[[pb.GenerateRequest], conversation.Parsed], request_: pb.GenerateRequest, param: str, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        parse(request_)
    assert info.value.metadata["param"] == param


def test_a_prompt_as_written_goes_with_a_prompt_s_text_alone(
    parse: Callable[[pb.GenerateRequest], conversation.Parsed],
) -> None:
    written = parse(pb.GenerateRequest(prompt="Once", prompt_as_written=True, no_special_tokens=True))
    assert (written.as_written, written.special_tokens) == (True, False)
    for request, param in (
        (pb.GenerateRequest(prompt="Once", no_special_tokens=True), "no_special_tokens"),
        (pb.GenerateRequest(messages=[USER], prompt_as_written=True), "prompt_as_written"),
        (pb.GenerateRequest(prompt_token_ids=[5, 6], prompt_as_written=True), "prompt_as_written"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            parse(request)
        assert refused.value.metadata["param"] == param


def test_grpc_tool_choice_auto_reads_calls_with_the_tools_schemas(family_models: Callable[[str], Path]) -> None:
    """ToolChoice.auto over gRPC with --tool-call-parser qwen3_coder: the
    parser gets the request's tools' parameters, so a value takes its
    parameter's type (as the HTTP API's does)."""
    model_dir = family_models("qwen2-vl")
    settings = TokenizerSettings(model_dir=model_dir, tool_call_parser="qwen3_coder")
    family = family_kit.kit(model_dir).family
    days = '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}'
    tool = pb.Tool(name="get_weather", description="The weather.", parameters=days)
    request = pb.GenerateRequest(messages=[USER], tools=[tool], tool_choice=pb.ToolChoice(auto=True))
    parsed = conversation.parse(request, settings, family)
    values = "<parameter=city>7</parameter><parameter=days>7</parameter>"
    text = f"<tool_call><function=get_weather>{values}</function></tool_call>"
    content, calls = parsed.calls.split(text)  # type: ignore[union-attr]
    assert content is None
    assert calls is not None
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "7", "days": 7}
