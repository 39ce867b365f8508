"""The OpenAI request shapes map onto the contract as documented
(tokenizer_svc/openai_api.py), and every refusal names its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmsplit.errors import E
from mmsplit.tokenizer.v1 import tokenizer_pb2
from tokenizer_svc import openai_answers, openai_api
from tokenizer_svc.errors import InvalidRequest, MediaTooLarge, Overloaded
from tokenizer_svc.tool_calls import Hermes, Llama3Json, Pythonic, Qwen3Coder


def test_content_parts_and_shorthands_become_message_parts() -> None:
    call = openai_api.parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look:"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"}},
                        {"image_url": "https://example.invalid/a.png"},
                        {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
                    ],
                },
                {"role": "assistant", "content": None},
            ],
            "some_future_field": {"ignored": True},
        }
    )
    system, user, assistant = call.request.messages
    assert system.role == tokenizer_pb2.CHAT_ROLE_SYSTEM
    assert [p.WhichOneof("part") for p in user.content] == ["text", "image", "image", "video"]
    assert user.content[2].image.url == "https://example.invalid/a.png"
    assert list(assistant.content) == []
    assert (call.n, call.stream, call.include_usage) == (1, False, False)


def test_an_assistant_s_refusal_part_is_its_text_and_only_an_assistant_has_one() -> None:
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]}
    call = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}, refused]})
    assert [p.text for p in call.request.messages[1].content] == ["I cannot help with that."]
    for message, param in (
        ({**refused, "role": "user"}, "messages[0].content[0].type"),
        ({"role": "assistant", "content": [{"type": "refusal"}]}, "messages[0].content[0].refusal"),
    ):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_chat({"messages": [message]})
        assert openai_api.param_name(info.value) == param


def test_sampling_fields_map_and_max_tokens_takes_the_smaller() -> None:
    call = openai_api.parse_chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 30,
            "max_completion_tokens": 20,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [2],
            "min_tokens": 3,
            "n": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    s = call.request.sampling
    assert (s.max_tokens, s.temperature, round(s.top_p, 3), s.top_k, s.seed) == (20, 0.5, 0.9, 0, 7)
    assert (list(s.stop), list(s.stop_token_ids), s.min_tokens) == (["END"], [2], 3)
    assert (call.n, call.stream, call.include_usage) == (3, True, True)
    assert call.request.n == 3
    from tokenizer_svc.conversation import PREPARED_ONCE, choice_request

    seeds = [choice_request(call.request, i).sampling.seed for i in range(3)]
    assert seeds[0] == 7
    assert len(set(seeds)) == 3
    assert all(0 < x < 2**63 for x in seeds)
    # Everything but the media and prompt, made once for every choice: a
    # choice's request keeps no copy of them while it runs.
    expected = type(call.request)()
    expected.CopyFrom(call.request)
    for name in PREPARED_ONCE:
        expected.ClearField(name)
    expected.n = 1
    expected.sampling.seed = seeds[1]
    assert call.request.messages
    assert choice_request(call.request, 1) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].image_url.url"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        # Past the contract's 32 bits: the client's error, not an internal one.
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2**40}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 2**33}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": 2**33}, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": "1"}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 10**400}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 10**400}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": [5, 1]}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-5": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"\uff15": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": True}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {str(2**33): 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": []}, "stream_options"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options"),
        # Counted before any message is read (OpenAI's own limits, and the parts of all messages).
        ({"messages": [{"role": "user", "content": ""}] * 2049}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 4097}] * 2}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 129}]},
         "messages[1].tool_calls"),
        # Each part of a body in a shape the API does not have.
        ({"messages": ["x"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
         "messages[0].function_call"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]},
         "messages[0].reasoning_content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"f": {}}}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "min_tokens": -1}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "spaces_between_special_tokens": "yes"},
         "spaces_between_special_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": "[1]"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_refusals_name_their_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_chat(body)
    assert openai_api.param_name(info.value) == param


def test_a_body_that_is_not_an_object_and_a_tokenize_flag_that_is_not_a_boolean_are_refused() -> None:
    for parse in (openai_api.parse_chat, openai_api.parse_completion):
        with pytest.raises(InvalidRequest, match="must be a JSON object"):
            parse([{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_tokenize({"prompt": "x", "return_token_strs": 1})
    assert openai_api.param_name(info.value) == "return_token_strs"


def test_a_conversation_at_the_limits_is_taken_and_the_responses_api_names_its_input_over_them() -> None:
    """2,048 messages, 8,192 parts in all, 128 calls a message: taken (one
    more of each: the refusals above, and tests/tokenizer/test_conversation.py
    for the contract); over them, the Responses API names its input."""
    from tokenizer_svc import openai_responses

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    at = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 4}] * 2047
    at.append({"role": "assistant", "content": None, "tool_calls": [call] * 128})
    taken = openai_api.parse_chat({"messages": at})
    assert len(taken.request.messages) == 2048
    assert sum(len(m.content) for m in taken.request.messages) == 8188
    chat, places = openai_responses.to_chat({"input": [{"role": "user", "content": "x"}] * 2049})
    with pytest.raises(InvalidRequest) as refused:
        openai_api.parse_chat(chat)
    assert openai_responses.rename(refused.value, places).metadata["param"] == "input"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("suffix", "end"),
        ("best_of", 3),
        ("web_search_options", {}),
        ("logits_processors", ["my.module:Proc"]),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_not_ignored(field: str, value: Any) -> None:
    """A client that asks for JSON or a tool call must not get
    plain text as if it had not asked: each endpoint refuses, naming the field."""
    for parse, body in (
        (openai_api.parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
        (openai_api.parse_completion, {"prompt": "x"}),
    ):
        with pytest.raises(InvalidRequest, match="not supported") as info:
            parse({**body, field: value})
        assert openai_api.param_name(info.value) == field


def test_the_do_nothing_values_of_those_fields_are_accepted() -> None:
    """What SDKs and frameworks send by default asks for nothing: accepted."""
    defaults = {
        "functions": None, "function_call": "none",
        "modalities": ["text"], "audio": None,
        "suffix": "", "best_of": 1, "web_search_options": None,
        "logits_processors": None,
    }  # fmt: skip
    assert defaults.keys() == openai_api.UNHONOURED.keys()
    defaults |= {"tools": [], "tool_choice": "none", "add_generation_prompt": True, "continue_final_message": False,
                 "chat_template_kwargs": {}, "echo": False, "prompt_logprobs": None,
                 "mm_processor_kwargs": {}, "skip_special_tokens": True, "return_token_ids": False,
                 "allowed_token_ids": None, "bad_words": [], "return_tokens_as_token_ids": False,
                 "truncate_prompt_tokens": None, "priority": 0, "documents": None,
                 "spaces_between_special_tokens": True, "chat_template": None,
                 "use_beam_search": False, "length_penalty": 1.0, "add_special_tokens": False}  # fmt: skip
    call = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], **defaults})
    assert call.request.messages[0].content[0].text == "x"
    assert openai_api.parse_completion({"prompt": "x", **defaults}).request.prompt == "x"


def test_allowed_token_ids_bad_words_and_priority_reach_the_contract() -> None:
    """vLLM's extensions, on both endpoints; malformed ones are refused naming the field."""
    knobs = {"allowed_token_ids": [7, 3, 7], "bad_words": ["Paris", " the end"], "priority": -3}
    for call in (
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], **knobs}),
        openai_api.parse_completion({"prompt": "x", **knobs}),
    ):
        assert list(call.request.sampling.allowed_token_ids) == [7, 3, 7]
        assert list(call.request.sampling.bad_words) == ["Paris", " the end"]
        assert call.request.priority == -3
    for field, value in (
        ("priority", 1.5),
        ("priority", 1 << 31),
        ("allowed_token_ids", [1, -2]),
        ("allowed_token_ids", [True]),
        ("allowed_token_ids", "1,2"),
        ("bad_words", "Paris"),
        ("bad_words", ["Paris", 3]),
    ):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_completion({"prompt": "x", field: value})
        assert openai_api.param_name(info.value) == field


def test_completions_read_a_text_prompt_as_written() -> None:
    """OpenAI's completions continue the text as it is: a text prompt is
    GenerateRequest.prompt_as_written (no chat template), a token-id one
    is not; vLLM's add_special_tokens false drops the tokenizer's special
    tokens from text prompts only. Chat takes add_special_tokens false
    alone (the template writes them); anything but a boolean is a 400."""
    call = openai_api.parse_completion({"prompt": ["Once", [5, 6]], "add_special_tokens": False})
    text, ids = call.requests
    assert (text.prompt_as_written, text.no_special_tokens) == (True, True)
    assert (ids.prompt_as_written, ids.no_special_tokens, list(ids.prompt_token_ids)) == (False, False, [5, 6])
    plain = openai_api.parse_completion({"prompt": "Once"}).request
    assert (plain.prompt_as_written, plain.no_special_tokens) == (True, False)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert not openai_api.parse_chat({**chat, "add_special_tokens": False}).request.prompt_as_written
    for parse, body in ((openai_api.parse_chat, {**chat, "add_special_tokens": True}),
                        (openai_api.parse_completion, {"prompt": "x", "add_special_tokens": "no"})):  # fmt: skip
        with pytest.raises(InvalidRequest) as info:
            parse(body)
        assert openai_api.param_name(info.value) == "add_special_tokens"


def test_beam_search_reaches_the_contract() -> None:
    """vLLM's use_beam_search and length_penalty on both endpoints (n is the
    width); a length_penalty other than 1 without beam search is refused,
    as is a use_beam_search that is not a boolean."""
    for call in (
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "n": 3}),
        openai_api.parse_completion({"prompt": "x", "use_beam_search": True, "n": 3, "length_penalty": 0.5}),
    ):
        assert call.request.HasField("beam_search")
        assert call.request.n == call.n == 3
    assert call.request.beam_search.length_penalty == 0.5
    chat = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True})
    assert not chat.request.beam_search.HasField("length_penalty")  # the service's 1
    plain = openai_api.parse_completion({"prompt": "x", "use_beam_search": False, "length_penalty": 1})
    assert not plain.request.HasField("beam_search")
    refused: list[tuple[dict[str, Any], str]] = [
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
        ({"use_beam_search": True, "length_penalty": "1"}, "length_penalty"),
    ]
    for body, param in refused:
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_completion({"prompt": "x", **body})
        assert openai_api.param_name(info.value) == param


def test_penalties_and_logit_bias_reach_the_contract() -> None:
    """Both endpoints; JSON's string keys become token ids; the service
    checks the ranges and the vocabulary (tests/shared/test_sampling.py)."""
    knobs = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"5": 100}}
    for call in (
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], **knobs}),
        openai_api.parse_completion({"prompt": "x", **knobs}),
    ):
        s = call.request.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == pytest.approx((0.5, -1.0, 1.2))
        assert dict(s.logit_bias) == {5: 100.0}


def test_response_formats_become_the_contract_s_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases: list[tuple[Any, str]] = [
        (None, ""),
        ({"type": "text"}, ""),
        ({"type": "json_object"}, '{"type": "object"}'),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}, json.dumps(schema)),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "{}"),
    ]
    for given, expected in cases:
        for call in (
            openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "response_format": given}),
            openai_api.parse_completion({"prompt": "x", "response_format": given}),
        ):
            assert call.request.sampling.json_schema == expected, given
    for bad in ({"type": "grammar"}, "json", {"type": "json_schema", "json_schema": {"schema": [1]}}):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "response_format": bad})
        assert openai_api.param_name(info.value) == "response_format"
    # The service's own refusal names the field as the client wrote it.
    from mmsplit_server.sampling import InvalidSampling

    assert openai_api.param_name(InvalidSampling("sampling.json_schema cannot be compiled")) == "response_format"


def test_tool_calls_and_tool_results_reach_the_contract() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    answered = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    body = {"messages": [{"role": "user", "content": "x"}, asked, answered]}
    messages = openai_api.parse_chat(body).request.messages
    assert [m.role for m in messages] == [
        tokenizer_pb2.CHAT_ROLE_USER, tokenizer_pb2.CHAT_ROLE_ASSISTANT, tokenizer_pb2.CHAT_ROLE_TOOL,
    ]  # fmt: skip
    (made,) = messages[1].tool_calls
    assert (made.id, made.name, made.arguments) == ("call_1", "f", '{"a": 1}')
    assert (messages[2].tool_call_id, messages[2].content[0].text) == ("call_1", "42")
    unnamed = {**asked, "tool_calls": [{**call, "id": None}]}  # a call without its id: no id, not "None"
    (made,) = openai_api.parse_chat({"messages": [body["messages"][0], unnamed]}).request.messages[1].tool_calls
    assert made.id == ""
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_chat({"messages": [body["messages"][0], {**asked, "tool_calls": [{**call, "id": 7}]}]})
    assert openai_api.param_name(info.value) == "messages[1].tool_calls[0]"
    del body["messages"][2]["tool_call_id"]  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_chat(body)
    assert openai_api.param_name(info.value) == "messages[2].tool_call_id"


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY},
}


def test_tool_choices_become_the_contract_s_tools_and_json_schema() -> None:
    """A named function: its parameters are the schema; "required": a list
    of {name, parameters} calls; "none" (and no tool_choice without tools)
    constrains nothing; the tools reach the contract either way."""
    base = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}
    named = openai_api.parse_chat({**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.calls == openai_api.Forced("get_weather")
    assert json.loads(named.request.sampling.json_schema) == TOOL["function"]["parameters"]  # type: ignore[index]
    (tool,) = named.request.tools
    assert (tool.name, tool.description) == ("get_weather", "The weather in a city.")
    assert json.loads(tool.parameters) == TOOL["function"]["parameters"]  # type: ignore[index]
    required = openai_api.parse_chat({**base, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(required.request.sampling.json_schema)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    auto = openai_api.parse_chat({**base, "parallel_tool_calls": False}, tool_parser="hermes")
    assert (auto.calls, auto.request.sampling.json_schema) == (Hermes(single=True), "")
    none = openai_api.parse_chat({**base, "tool_choice": "none"})
    assert (none.calls, none.request.sampling.json_schema, len(none.request.tools)) == (None, "", 1)


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({}, "tool_choice", "auto"),  # the default with tools
        ({"tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": {"type": "function", "function": [1]}}, "tool_choice", "must be"),  # was a 500
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0]", "JSON Schema"),
    ],
)
def test_tool_choices_that_cannot_be_served_are_refused(extra: dict[str, Any], param: str, match: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], **extra}
    with pytest.raises(InvalidRequest, match=match) as info:
        openai_api.parse_chat(body)
    assert openai_api.param_name(info.value) == param
    with pytest.raises(InvalidRequest, match="chat completions") as info:
        openai_api.parse_completion({"prompt": "x", "tools": [TOOL]})
    assert openai_api.param_name(info.value) == "tools"


def test_forced_calls_answer_as_tool_calls_whole_and_streamed() -> None:
    """The output of a named function is its arguments; of "required", the
    list of calls; streamed, a named call's arguments go as they come and
    "required"'s calls whole at the end; an output cut short (max_tokens)
    is not parsed: "required" answers it as content."""
    shape = openai_answers.Shape.of(True, "r", "m", openai_api.Forced("get_weather"))
    choices = openai_answers.Choices(1)
    choices.text[0], choices.finish[0] = '{"city": "Oslo"}', "stop"
    (message,) = [c["message"] for c in shape.complete(choices)["choices"]]
    (call,) = message["tool_calls"]
    assert message["content"] is None
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["id"].startswith("call_")
    assert shape.complete(choices)["choices"][0]["finish_reason"] == "tool_calls"
    first = shape.delta(0, openai_answers.Shown('{"ci', None, []), '{"ci')
    rest = shape.delta(0, openai_answers.Shown('ty": "Oslo"}', None, []), '{"city": "Oslo"}')
    end = shape.delta(0, openai_answers.Shown("", "stop", []), '{"city": "Oslo"}')
    assert first
    assert rest
    assert end
    (opened,) = first["choices"][0]["delta"]["tool_calls"]
    assert (opened["index"], opened["function"]) == (0, {"name": "get_weather", "arguments": '{"ci'})
    assert rest["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert end["choices"][0]["finish_reason"] == "tool_calls"

    required = openai_answers.Shape.of(True, "r", "m", openai_api.Forced(""))
    listed = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert required.delta(0, openai_answers.Shown(listed[:5], None, []), listed[:5]) is None
    end = required.delta(0, openai_answers.Shown("", "stop", []), listed)
    assert end is not None
    calls = end["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "a", {"x": 1}), (1, "b", {}),
    ]  # fmt: skip
    cut = required.delta(0, openai_answers.Shown("", "length", []), listed[:20])
    assert cut is not None
    assert cut["choices"][0]["delta"] == {"content": listed[:20]}
    assert cut["choices"][0]["finish_reason"] == "length"


def test_logprobs_are_asked_as_each_api_spells_it() -> None:
    chat = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5})
    assert (chat.request.sampling.logprobs, chat.request.sampling.top_logprobs) == (True, 5)
    legacy = openai_api.parse_completion({"prompt": "x", "logprobs": 3})
    assert (legacy.request.sampling.logprobs, legacy.request.sampling.top_logprobs) == (True, 3)


def test_completions_take_a_prompt_or_a_list_of_them() -> None:
    """A list of prompts is a request each, alike but for the prompt; empty
    prompts and too many choices in all are refused, naming the field."""
    assert openai_api.parse_completion({"prompt": ["once"]}).request.prompt == "once"
    several = openai_api.parse_completion({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 3, "seed": 4})
    assert [r.prompt for r in several.requests] == ["a", "b", "c"]
    assert all(r.sampling == several.request.sampling for r in several.requests)
    assert (several.n, several.choices, several.request.sampling.max_tokens) == (2, 6, 3)
    for body, param in (
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": ["a"] * 17}, "prompt"),
        ({"prompt": ["a"] * 5, "n": 8}, "n"),
    ):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_completion(body)
        assert openai_api.param_name(info.value) == param, body


def test_error_statuses_and_retry_headers() -> None:
    status, body, headers = openai_api.error_body(MediaTooLarge("too big", metadata={"param": "messages[0]"}))
    assert (status, body["error"]["code"], body["error"]["param"]) == (413, "MEDIA_TOO_LARGE", "messages[0]")
    assert headers == {"x-should-retry": "false"}
    status, body, headers = openai_api.error_body(Overloaded("busy", retry_after_ms=2500))
    assert (status, headers) == (429, {"x-should-retry": "true", "Retry-After": "3"})
    # Every ErrorCode has a status; the retriable ones are 429 or 5xx.
    from mmsplit.errors import TABLE

    for code, kind in TABLE.items():
        assert code in openai_api.STATUS, E.Name(code)
        if kind.retriable:
            assert openai_api.STATUS[code][0] in (429, 502, 503, 504), E.Name(code)


def test_a_stream_cancelled_before_its_first_event_closes_the_request() -> None:
    """A client gone while its request is still being prepared (nothing
    sent yet): the handler's cancellation closes the request's work at once
    (the service's cleanup runs), not whenever it would have ended."""
    import asyncio

    from mmsplit_server.serving import RequestSummary
    from tokenizer_svc.http_api import HttpApi

    async def run() -> bool:
        started, closed = asyncio.Event(), asyncio.Event()

        class Preparing:
            tokenizer = None

            async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
                try:
                    started.set()
                    await asyncio.Event().wait()  # media still being prepared
                    yield None
                finally:
                    closed.set()

        api = HttpApi(Preparing(), model="m", ready=lambda: True, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        call = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True})
        shape = openai_answers.Shape.of(True, "r", "m")
        handler = asyncio.create_task(api._stream(None, call, shape, "r", RequestSummary("r"), client=""))  # type: ignore[arg-type]
        await asyncio.wait_for(started.wait(), 10)
        handler.cancel()
        await asyncio.wait([handler])
        return closed.is_set()

    assert asyncio.run(run()), "the request's work outlived its client"


CALLED = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OSLO, ROME = ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})
LLAMA = (
    ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_weather", "arguments": {"city": "Rome"}}'
)
PYTHONIC = '[get_weather(city="Oslo"), get_weather(city="Rome")]'
CODER = (
    "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
)
CODER_ROME = CODER.split("\n", 1)[1].replace("Oslo", "Rome")


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (Hermes, CALLED, "Let me look.", [OSLO]),
        (Hermes, CALLED.split("\n", 1)[1] + CALLED.split("\n", 1)[1].replace("Oslo", "Rome"), None, [OSLO, ROME]),
        (Hermes, "No call here, <tool but no more.", "No call here, <tool but no more.", None),
        (Hermes, "Broken: <tool_call>{not json}</tool_call>", "Broken: <tool_call>{not json}</tool_call>", None),
        (Hermes, "Cut: <tool_call>\n{\"name\": \"get_wea", "Cut: <tool_call>\n{\"name\": \"get_wea", None),
        (Llama3Json, LLAMA, None, [OSLO, ROME]),
        (Llama3Json, "<|python_tag|>" + LLAMA.split(";")[0], None, [OSLO]),
        (Llama3Json, 'It is {"name": "x"}', 'It is {"name": "x"}', None),
        (Llama3Json, LLAMA + " and more", LLAMA + " and more", None),
        (Llama3Json, '{"name": 5}', '{"name": 5}', None),
        (Llama3Json, '{"name": "get_wea', '{"name": "get_wea', None),
        (Llama3Json, '{"city": "Oslo"}', '{"city": "Oslo"}', None),
        (Pythonic, PYTHONIC, None, [OSLO, ROME]),
        (Pythonic, "<|python_start|>" + PYTHONIC + "<|python_end|>", None, [OSLO, ROME]),
        (Pythonic, '[f(a=[1, {"b": None}], c=True, d=-2.5)]', None,
         [("f", {"a": [1, {"b": None}], "c": True, "d": -2.5})]),
        (Pythonic, "[f(a=__import__('os').getpid())]", "[f(a=__import__('os').getpid())]", None),  # never run
        (Pythonic, "[f(1)]", "[f(1)]", None),
        (Pythonic, "[f(**x)]", "[f(**x)]", None),
        (Pythonic, "[f(a={1, 2})]", "[f(a={1, 2})]", None),
        (Pythonic, "[f(a=float('nan'))]", "[f(a=float('nan'))]", None),
        (Pythonic, "[os.system(a=1)]", "[os.system(a=1)]", None),
        (Pythonic, "[1, 2]", "[1, 2]", None),
        (Pythonic, "[]", "[]", None),
        (Pythonic, "[f(a=" + "[" * 300 + "]" * 300 + ")]", "[f(a=" + "[" * 300 + "]" * 300 + ")]", None),
        (Pythonic, "[link](http://x) text", "[link](http://x) text", None),
        (Pythonic, 'Sure: [get_weather(city="Oslo")]', 'Sure: [get_weather(city="Oslo")]', None),
        (Qwen3Coder, CODER, "Let me look.", [OSLO]),
        (Qwen3Coder, CODER.split("\n", 1)[1] + "\n" + CODER_ROME, None, [OSLO, ROME]),
        # A value keeps its own lines and blanks, but for the one line break on each side.
        (Qwen3Coder, "<tool_call><function=f><parameter=city>\n  two\nlines \n</parameter></function></tool_call>",
         None, [("f", {"city": "  two\nlines "})]),
        (Qwen3Coder, "<tool_call><function=f></function></tool_call>", None, [("f", {})]),
        (Qwen3Coder, "No call here, <tool but no more.", "No call here, <tool but no more.", None),
        (Qwen3Coder, "Cut: <tool_call>\n<function=get_weather>\n<parameter=ci",
         "Cut: <tool_call>\n<function=get_weather>\n<parameter=ci", None),
        (Qwen3Coder, "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
         "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>", None),
        (Qwen3Coder, CODER + " and after", CODER + " and after", None),
        (Qwen3Coder, 'Hermes: <tool_call>{"name": "f"}</tool_call>', 'Hermes: <tool_call>{"name": "f"}</tool_call>',
         None),
    ],
)  # fmt: skip
def test_auto_parsers_find_the_calls_a_model_writes_and_lose_nothing_when_they_do_not_parse(
    parser: type[Hermes | Llama3Json | Pythonic | Qwen3Coder],
    text: str,
    content: str | None,
    calls: list[tuple[str, Any]] | None,
) -> None:
    """Each --tool-call-parser on its format's outputs: the content and the
    calls, or the whole text as content when they do not parse (Pythonic's
    calls are read, never run); a stream's content, as `held` lets it go
    delta by delta, is the content `split` finds at the end, and never
    holds a call."""

    def named(found: list[dict[str, Any]] | None) -> list[tuple[str, Any]] | None:
        return (
            None if found is None else [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]
        )

    found_content, found = parser().split(text)
    assert found_content == content
    assert named(found) == calls
    # parallel_tool_calls false: the first call only.
    assert named(parser(single=True).split(text)[1]) == (calls[:1] if calls else None)
    sent = 0
    for end in range(1, len(text) + 1):
        sent = max(sent, parser().held(text[:end], sent))
    streamed = text[:sent]
    assert (content or "").startswith(streamed) if calls else content.startswith(streamed)  # type: ignore[union-attr]


def test_qwen3_coder_values_take_the_types_of_the_tool_s_schema() -> None:
    """As vLLM's qwen3_coder parser reads them: each parameter's text as
    the type its schema names (a union too); what does not read as that
    type, and a parameter the schema does not name, stays text."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
            "tags": {"type": "array"}, "opts": {"type": "object"}, "s": {"type": "string"},
            "maybe": {"type": ["integer", "null"]}, "free": {},
        },
    }  # fmt: skip
    values = {
        "n": "42", "x": "2.5", "ok": "True", "tags": '["a", 1]', "opts": '{"k": null}', "s": "007",
        "maybe": "null", "free": "[1, 2]", "unnamed": "12",
    }  # fmt: skip
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    _, calls = Qwen3Coder(schemas={"f": schema}).split(text)
    assert calls is not None
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "n": 42, "x": 2.5, "ok": True, "tags": ["a", 1], "opts": {"k": None}, "s": "007",
        "maybe": None, "free": [1, 2], "unnamed": "12",
    }  # fmt: skip
    wrong = {"n": "many", "x": "inf", "ok": "yes", "tags": "[1,", "s": "null"}
    body = "".join(f"<parameter={k}>{v}</parameter>" for k, v in wrong.items())
    _, calls = Qwen3Coder(schemas={"f": schema}).split(f"<tool_call><function=f>{body}</function></tool_call>")
    assert calls is not None
    # A string parameter's "null" is null, as vLLM reads it.
    assert json.loads(calls[0]["function"]["arguments"]) == {**wrong, "s": None}
    # Without the tool's schema (another tool's name): every value text.
    _, calls = Qwen3Coder(schemas={"g": schema}).split(f"<tool_call><function=f>{body}</function></tool_call>")
    assert calls is not None
    assert json.loads(calls[0]["function"]["arguments"]) == wrong


@pytest.mark.parametrize(
    ("parser", "script", "expected"),
    [
        ("hermes", CALLED, "Let me look."),
        ("llama3_json", LLAMA.split(";")[0], None),
        ("pythonic", PYTHONIC.replace(', get_weather(city="Rome")', ""), None),
        ("qwen3_coder", CODER, "Let me look."),
    ],
)
def test_the_openai_sdk_reads_auto_tool_calls_whole_and_streamed(
    parser: str, script: str, expected: str | None
) -> None:
    """tool_choice "auto" with each --tool-call-parser, served by the HTTP
    API over a service that answers a scripted text in small pieces: the
    openai SDK gets the text before the call (if any) as content and the
    call as tool_calls (finish_reason tool_calls), streamed and not alike;
    without a parser, "auto" is a 400 naming tool_choice."""
    import asyncio

    import openai

    from mmsplit.common.v1 import common_pb2
    from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
    from tokenizer_svc.http_api import HttpApi, start

    class Scripted:
        tokenizer = None

        async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
            for at in range(0, len(script), 3):
                yield pb.GenerateResponse(delta=pb.TextDelta(text=script[at : at + 3]))
            yield pb.GenerateResponse(
                finished=pb.Finished(finish_reason=common_pb2.FINISH_REASON_STOP, prompt_tokens=5, completion_tokens=9)
            )

    async def run(parser: str) -> Any:
        api = HttpApi(Scripted(), model="m", ready=lambda: True, max_body_bytes=1 << 20, tool_parser=parser)  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        ask = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL]}
        try:
            whole = await client.chat.completions.create(**ask)  # type: ignore[call-overload]
            content, pieces, finish = "", {"name": "", "arguments": ""}, None
            async for chunk in await client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    pieces["name"] += call.function.name or ""
                    pieces["arguments"] += call.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            tool = {"type": "function", **TOOL["function"]}  # type: ignore[dict-item]
            stream = await client.responses.create(model="m", input="Weather?", tools=[tool], stream=True)  # type: ignore[call-overload]
            events = [e async for e in stream]
            return whole, (content, pieces, finish), events
        finally:
            await client.close()
            await runner.cleanup()

    whole, (content, pieces, finish), events = asyncio.run(run(parser))
    # The Responses API the same: its text streamed up to the call (before the call's item), then the call.
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert texts == (expected or "")
    final = events[-1].response
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
        *([("message", None)] if expected else []),
        ("function_call", "get_weather"),
    ]
    if expected:  # content streamed as the model wrote it (in pieces), not only whole at the end
        assert sum(e.type == "response.output_text.delta" for e in events) > 1, [e.type for e in events]
    message = whole.choices[0].message
    assert (message.content, whole.choices[0].finish_reason) == (expected, "tool_calls")
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert (content, pieces["name"], finish) == (expected or "", "get_weather", "tool_calls")
    assert pieces["arguments"] == call.function.arguments
    with pytest.raises(openai.BadRequestError) as info:
        asyncio.run(run("none"))
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_a_chat_template_reaches_the_contract_for_chat_only() -> None:
    """The request's own template goes to the service, which takes it only
    where it trusts requests' templates (tests/tokenizer/test_conversation.py)."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert openai_api.parse_chat({**chat, "chat_template": "{{ 1 }}"}).request.chat_template == "{{ 1 }}"
    assert openai_api.parse_tokenize({**chat, "chat_template": "{{ 1 }}"}).request.chat_template == "{{ 1 }}"
    for parse, body in (
        (openai_api.parse_chat, {**chat, "chat_template": ["{{ 1 }}"]}),
        (openai_api.parse_completion, {"prompt": "x", "chat_template": "{{ 1 }}"}),
    ):
        with pytest.raises(InvalidRequest) as refused:
            parse(body)
        assert openai_api.param_name(refused.value) == "chat_template"


def test_documents_reach_the_contract_for_chat_only() -> None:
    documents = [{"title": "A", "text": "alpha"}]
    call = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "documents": documents})
    assert json.loads(call.request.documents) == documents
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert not openai_api.parse_chat({**chat, "documents": []}).request.documents
    assert json.loads(openai_api.parse_tokenize({**chat, "documents": documents}).request.documents) == documents
    for parse, body in (
        (openai_api.parse_chat, {**chat, "documents": {"text": "a"}}),
        (openai_api.parse_completion, {"prompt": "x", "documents": documents}),
    ):
        with pytest.raises(InvalidRequest) as refused:
            parse(body)
        assert openai_api.param_name(refused.value) == "documents"


def test_continue_final_message_and_chat_template_kwargs_reach_the_contract() -> None:
    """vLLM's continue_final_message (add_generation_prompt false or
    absent with it), add_generation_prompt false alone (no generation
    prompt) and chat_template_kwargs: chat only."""
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        request = openai_api.parse_chat({**chat, **extra}).request
        assert (request.continue_final_message, request.no_generation_prompt) == (True, False)
    closed = openai_api.parse_chat({**chat, "add_generation_prompt": False}).request
    assert (closed.continue_final_message, closed.no_generation_prompt) == (False, True)
    assert not openai_api.parse_chat({**chat, "add_generation_prompt": True}).request.no_generation_prompt
    kwargs = openai_api.parse_chat({**chat, "chat_template_kwargs": {"enable_thinking": False}}).request
    assert (json.loads(kwargs.chat_template_kwargs), kwargs.continue_final_message) == (
        {"enable_thinking": False},
        False,
    )
    for wrong, param in (
        ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"continue_final_message": 1}, "continue_final_message"),
        ({"chat_template_kwargs": "x=1"}, "chat_template_kwargs"),
    ):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_chat({**chat, **wrong})
        assert openai_api.param_name(info.value) == param, wrong
    for name, value in (("continue_final_message", True), ("chat_template_kwargs", {"a": 1})):
        with pytest.raises(InvalidRequest, match="completions") as info:
            openai_api.parse_completion({"prompt": "x", name: value})
        assert openai_api.param_name(info.value) == name


def test_vllm_s_min_p_ignore_eos_and_include_stop_str_in_output_reach_the_contract() -> None:
    body = {"min_p": 0.05, "ignore_eos": True, "include_stop_str_in_output": True}
    for call in (
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], **body}),
        openai_api.parse_completion({"prompt": "x", **body}),
    ):
        s = call.request.sampling
        assert (s.min_p, s.ignore_eos, s.include_stop_str_in_output) == (pytest.approx(0.05), True, True)
    for wrong in ({"min_p": "high"}, {"ignore_eos": 1}, {"include_stop_str_in_output": "yes"}):
        with pytest.raises(InvalidRequest) as info:
            openai_api.parse_completion({"prompt": "x", **wrong})
        assert openai_api.param_name(info.value) == next(iter(wrong))


def test_structured_outputs_become_the_contract_s_regex_choice_and_json_schema() -> None:
    """vLLM's structured_outputs and its older guided_* fields."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    cases: list[tuple[dict[str, Any], tuple[Any, ...]]] = [
        ({"structured_outputs": {"regex": "[0-9]+"}}, ("", "[0-9]+", [])),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("", "", ["a", "b"])),
        ({"structured_outputs": {"json": {"type": "object"}}}, ('{"type": "object"}', "", [])),
        ({"structured_outputs": {"json": '{"type": "object"}'}}, ('{"type": "object"}', "", [])),
        ({"structured_outputs": {"json_object": True}}, ('{"type": "object"}', "", [])),
        ({"guided_choice": ["yes", "no"]}, ("", "", ["yes", "no"])),
        ({"guided_regex": "a+"}, ("", "a+", [])),
        ({"structured_outputs": {"grammar": "root ::= x"}}, ("", "", [], "root ::= x")),
        ({"guided_grammar": 'start: "a"'}, ("", "", [], 'start: "a"')),
    ]
    for extra, expected in cases:
        for call in (openai_api.parse_chat({**chat, **extra}), openai_api.parse_completion({"prompt": "x", **extra})):
            s = call.request.sampling
            assert (s.json_schema, s.regex, list(s.choice), s.grammar)[: len(expected)] == expected, extra


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": 5}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "x", "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs"),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        ({"guided_regex": 5}, "guided_regex"),
    ],
)
def test_structured_outputs_that_cannot_be_served_are_refused(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert openai_api.param_name(info.value) == param


def test_a_client_gone_before_a_write_is_cancelled_not_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream's write that finds the client gone (aiohttp raises
    ConnectionResetError when that comes before its cancellation of the
    handler) ends the request CANCELLED, with no internal error logged:
    it once counted as INTERNAL, with an incident and a traceback."""
    import asyncio
    import logging

    from mmsplit.common.v1 import common_pb2
    from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
    from tokenizer_svc import http_api

    class Endless:
        tokenizer = None

        async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
            while True:
                yield pb.GenerateResponse(delta=pb.TextDelta(text="and on "))
                await asyncio.sleep(0)
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason=common_pb2.FINISH_REASON_STOP))

    sent = 0
    send = http_api._send

    async def gone_after_two(response: Any, data: bytes) -> None:
        nonlocal sent
        sent += 1
        if sent > 2:
            raise ConnectionResetError("Cannot write to closing transport")
        await send(response, data)

    monkeypatch.setattr(http_api, "_send", gone_after_two)

    async def run() -> None:
        api = http_api.HttpApi(Endless(), model="m", ready=lambda: True, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        runner, port = await http_api.start(api, "127.0.0.1", 0)
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            await reader.readuntil(b"data: ")  # the stream began
            for _ in range(3000):  # until the request's line is logged (it ends at the failed write)
                if any("finished:" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)
            writer.close()
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert any("finished: CANCELLED" in line for line in lines), lines
    assert not any("unexpected error" in line or "INTERNAL" in line for line in lines), lines


def test_the_responses_api_names_its_own_fields_in_errors_before_and_during_a_stream() -> None:
    """An error the service raises about a chat message (a medium that does
    not decode) names the Responses input item it came from, as a 400
    before the stream and as an `error` event (after the text so far)
    during one; nothing else is sent after it."""
    import asyncio

    import openai

    from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
    from tokenizer_svc.errors import MediaDecodeFailed
    from tokenizer_svc.http_api import HttpApi, start

    class Failing:
        tokenizer = None

        async def generate(self, request: Any, rid: str, timeout_s: Any, client: str = "") -> Any:
            if request.take().sampling.max_tokens == 5:  # handed over (`Call.hand_over`); fail mid-stream
                yield pb.GenerateResponse(delta=pb.TextDelta(text="So far"))
            raise MediaDecodeFailed("not an image", metadata={"param": "messages[1].content[0]"})

    async def run() -> tuple[Any, list[Any]]:
        api = HttpApi(Failing(), model="m", ready=lambda: True, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        runner, port = await start(api, "127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        ask = {"model": "m", "instructions": "Be brief.", "input": [{"role": "user", "content": "x"}]}
        try:
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(**ask, max_output_tokens=4)  # type: ignore[call-overload]
            stream = await client.responses.create(**ask, max_output_tokens=5, stream=True)  # type: ignore[call-overload]
            return info.value.body, [e async for e in stream]
        finally:
            await client.close()
            await runner.cleanup()

    body, events = asyncio.run(run())
    assert (body["code"], body["param"]) == ("MEDIA_DECODE_FAILED", "input[0].content[0]")  # type: ignore[index]
    kinds = [e.type for e in events]
    assert kinds[-1] == "error", kinds
    assert "response.output_text.delta" in kinds
    assert (events[-1].code, events[-1].param) == ("MEDIA_DECODE_FAILED", "input[0].content[0]")


def test_a_responses_body_becomes_the_chat_body_of_the_same_conversation() -> None:
    """instructions first; input items as messages (parts renamed); an
    answer's text and calls one assistant turn, their outputs tool turns;
    text.format, max_output_tokens, function tools and a named tool_choice
    in chat's form; and where each message came from."""
    from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
    from tokenizer_svc.openai_responses import to_chat

    tool = {"type": "function", "name": "f", "description": "F.", "parameters": {"type": "object"}}
    chat, places = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5, "store": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"role": "user", "content": "And?"},
        ],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "tools": [tool], "tool_choice": {"type": "function", "name": "f"},
    })  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "user", "content": "And?"},
    ]  # fmt: skip
    assert places == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]"]
    assert (chat["max_completion_tokens"], chat["temperature"], "store" in chat) == (7, 0.5, False)
    schema = {"name": "s", "schema": {"type": "object"}, "strict": True}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "F.",
                                                               "parameters": {"type": "object"}}}]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    del chat["response_format"]  # (not with a named tool: chat's rule)
    call = openai_api.parse_chat(chat)  # chat's own checks take it
    roles = [pb.CHAT_ROLE_SYSTEM, pb.CHAT_ROLE_USER, pb.CHAT_ROLE_ASSISTANT, pb.CHAT_ROLE_TOOL, pb.CHAT_ROLE_USER]
    assert [m.role for m in call.request.messages] == roles


def test_several_prompts_merge_and_one_failure_ends_every_other_s_work() -> None:
    """The merge of several streams (`service.merged`: several prompts'
    over HTTP, a request's n choices): items as they come; the first
    failure is raised and the other sources are ended (their cleanup runs)
    before it leaves; a consumer that stops early ends them too."""
    import asyncio

    from tokenizer_svc.service import merged as _merged

    ended: list[str] = []

    async def source(name: str, items: int, fail: bool = False) -> Any:
        try:
            for k in range(items):
                yield f"{name}{k}"
                await asyncio.sleep(0)
            if fail:
                raise Overloaded("busy")
            await asyncio.Event().wait()  # never ends by itself
        finally:
            ended.append(name)

    async def run(stop_after: int | None) -> list[str]:
        got: list[str] = []
        merged = _merged([source("a", 3), source("b", 2, fail=stop_after is None)])
        try:
            async for item in merged:
                got.append(item)
                if stop_after is not None and len(got) == stop_after:
                    break
        finally:
            await merged.aclose()
        return got

    with pytest.raises(Overloaded):
        asyncio.run(run(None))
    assert sorted(ended) == ["a", "b"]
    ended.clear()
    assert len(asyncio.run(run(3))) == 3
    assert sorted(ended) == ["a", "b"]


def test_responses_calls_and_their_outputs_must_name_the_call() -> None:
    from tokenizer_svc.openai_responses import to_chat

    for item in (
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "output": "sunny"},
        {"type": "function_call_output", "call_id": "", "output": "sunny"},
    ):
        with pytest.raises(InvalidRequest) as info:
            to_chat({"input": [{"role": "user", "content": "x"}, item]})
        assert openai_api.param_name(info.value) == "input[1].call_id", item


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [4, 5]], ["a", [4, 5]]),
    ],
)  # fmt: skip
def test_completions_take_text_or_token_id_prompts(prompt: Any, expected: list[Any]) -> None:
    call = openai_api.parse_completion({"prompt": prompt})
    got = [r.prompt if r.prompt else list(r.prompt_token_ids) for r in call.requests]
    assert got == expected
    for r in call.requests:  # one or the other, never both
        assert not (r.prompt and r.prompt_token_ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt[0]"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 2**32]}, "prompt"),
        ({"prompt": [True, 1]}, "prompt"),
        ({"prompt": [[1], [2.5]]}, "prompt[1]"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)  # fmt: skip
def test_completions_prompt_echo_and_prompt_logprobs_refusals(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        openai_api.parse_completion(body)
    assert openai_api.param_name(info.value) == param


def test_echo_and_prompt_logprobs_ask_the_scheduler_for_the_most_top_tokens_either_needs() -> None:
    def asked(**body: Any) -> int | None:
        s = openai_api.parse_completion({"prompt": [1, 2], **body}).request.sampling
        return s.prompt_logprobs if s.HasField("prompt_logprobs") else None

    assert asked() is None
    assert asked(echo=True) is None  # the prompt's text only: nothing to compute
    assert asked(logprobs=3) is None  # the generated tokens' only
    assert asked(echo=True, logprobs=3) == 3
    assert asked(echo=True, logprobs=0) == 0
    assert asked(prompt_logprobs=5) == 5
    assert asked(echo=True, logprobs=2, prompt_logprobs=5) == 5
    assert asked(echo=True, logprobs=7, prompt_logprobs=1) == 7
    chat = openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})
    assert chat.request.sampling.prompt_logprobs == 0
    assert chat.prompt_logprobs == 0
    with pytest.raises(InvalidRequest):
        openai_api.parse_chat({"messages": [{"role": "user", "content": "x"}], "echo": True})
