"""Conversations through real servers, for every family with the chat
template its public checkpoints ship (`mmsplit tiny-model`'s default):
greedy tokens of a system + user + assistant + user conversation, with
images in two turns, equal single-process `generate` on
``processor.apply_chat_template(messages)``; and what a conversation may
not be is refused with a typed error naming where. One rank a pair: what
is checked here (templates, turns, the prefix cache across them) is the
tokenizer's and the cache's, the same at any TP, and every family's TP=2
forward has its own suite (test_families.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmsplit.client import ImagePart, VideoPart, build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import run_request
from tests.e2e.helpers import png
from tests.support import greedy, hf_family
from tests.support.services import Pair, running_pair

pytestmark = pytest.mark.e2e
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["llava", "llava-next", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl"])
def chat_pair(
    request: pytest.FixtureRequest, chat_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Pair]]:
    family = request.param
    with running_pair(chat_models(family), tmp_path_factory.mktemp(f"chat-{family}"), tp=1) as pair:
        yield family, pair


def conversation(a: bytes, b: bytes) -> list[tuple[str, Any]]:
    return [
        ("system", "You answer in one word."),
        ("user", ["What is this?", ImagePart(a)]),
        ("assistant", "A square."),
        ("user", [ImagePart(b), "And this one, next to it?"]),
    ]


def as_hf(messages: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for role, content in messages:
        parts = [content] if isinstance(content, str) else content
        out.append(
            {
                "role": role,
                "content": [
                    {"type": "text", "text": p}
                    if isinstance(p, str)
                    else {"type": "video" if isinstance(p, VideoPart) else "image"}
                    for p in parts
                ],
            }
        )
    return out


def test_a_conversation_with_images_in_two_turns_gets_the_tokens_of_generate(chat_pair: tuple[str, Pair]) -> None:
    from tokenizer_svc.decode import decode_image

    family, pair = chat_pair
    a, b = png(120, 200, 1), png(224, 224, 2)
    messages = conversation(a, b)
    request = build_request(messages=messages, max_tokens=MAX_TOKENS)
    request.sampling.logprobs = True
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request, timeout=120)
    assert out.ok, (family, out)
    proc = hf_family.processor(pair.model)
    text = proc.apply_chat_template(as_hf(messages), tokenize=False, add_generation_prompt=True)
    images = [decode_image(x, max_pixels=10**8) for x in (a, b)]
    tokens, logprobs = hf_family.scored(pair.model, proc, text, images, MAX_TOKENS)
    assert out.token_ids == tokens, family
    assert out.logprobs == pytest.approx(logprobs, abs=greedy.LOGPROB_TOLERANCE), family


def test_what_a_conversation_may_not_be_is_refused_naming_where(chat_pair: tuple[str, Pair]) -> None:
    family, pair = chat_pair
    good = png(64, 64, 3)
    marker = {"internvl": "<IMG_CONTEXT>"}.get(family, "<image>" if family.startswith("llava") else "<|image_pad|>")
    cases: list[tuple[tokenizer_pb2.GenerateRequest, str, str]] = [
        (build_request("a prompt", messages=[("user", "hi")]), "INVALID_REQUEST", ""),
        (build_request(messages=[("user", "hi"), ("system", "late")]), "INVALID_REQUEST", "messages[1]"),
        (build_request(messages=[("assistant", ["hm", ImagePart(good)])]), "INVALID_REQUEST", "messages[0].content[1]"),
        (build_request(messages=[("user", ["fine", f"a {marker} here"])]), "INVALID_REQUEST", "messages[0].content[1]"),
        (
            build_request(messages=[("user", ["one", ImagePart(good)]), ("user", ImagePart(good[: len(good) // 2]))]),
            "MEDIA_DECODE_FAILED",
            "messages[1].content[0]",
        ),
        (build_request(messages=[("user", [ImagePart(good)] * 9)]), "INVALID_REQUEST", "messages"),
    ]
    if family == "internvl":  # the tokens around an image's run are the model's too
        cases.append(
            (build_request(messages=[("user", ["an <img> tag"])]), "INVALID_REQUEST", "messages[0].content[0]")
        )
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for request, reason, param in cases:
            out = run_request(stub, request, timeout=60)
            assert (out.reason, out.metadata.get("param", "")) == (reason, param), (family, out)
        after = run_request(stub, build_request(messages=[("user", "hello")], max_tokens=2), timeout=60)
    assert after.ok, after


def test_a_tool_conversation_through_the_client_library(chat_pair: tuple[str, Pair]) -> None:
    """Tools, an assistant's call and the tool's result (the client
    library's Tool, ToolCall and ToolResult), the answer constrained to the
    tool's parameters: every family's shipped template takes it but
    LLaVA-NeXT's (it reads an assistant turn's first text part, and refuses
    a tool turn), a typed error that says so; the next request is served."""
    import json

    from mmsplit.client import Tool, ToolCall, ToolResult

    family, pair = chat_pair
    params = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    messages = [
        ("user", [ImagePart(png(64, 64, 4)), "Is it sunny there?"]),
        ("assistant", [ToolCall("get_weather", {"place": "here"}, id="call_1")]),
        ("tool", ToolResult("call_1", "Clear skies.")),
        ("user", "So?"),
    ]
    request = build_request(
        messages=messages, tools=[Tool("get_weather", "The weather.", params)], json_schema=params, max_tokens=40
    )
    assert request.messages[1].tool_calls[0].arguments == '{"place": "here"}'
    assert request.messages[2].tool_call_id == "call_1"
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        out = run_request(stub, request, timeout=120)
        after = run_request(stub, build_request(messages=[("user", "hello")], max_tokens=2), timeout=60)
    if family == "llava-next":
        assert out.reason == "INVALID_REQUEST", out
        assert "chat template refused the conversation" in out.message, out
    else:
        assert out.ok, (family, out)
        assert isinstance(json.loads(out.text)["sunny"], bool), out.text
    assert after.ok, after


def test_the_cli_sends_a_conversation_with_the_image_in_the_last_user_turn(
    chat_pair: tuple[str, Pair], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mmsplit generate --system ... --user ... --assistant ... --user ... --image F --json`:
    the tokens of the same conversation built with the client library."""
    import json

    from mmsplit_cli.main import parser

    family, pair = chat_pair
    picture = png(80, 90, 4)
    (tmp_path / "p.png").write_bytes(picture)
    argv = ["generate", "--server", pair.tokenizer_address, "--max-tokens", str(MAX_TOKENS), "--json"]
    argv += ["--system", "Be brief.", "--user", "Hi.", "--assistant", "Hello.", "--user", "What is it?"]
    args = parser().parse_args([*argv, "--image", str(tmp_path / "p.png")])
    assert args.func(args) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [t for e in events for t in e.get("token_ids", [])]
    messages = [
        ("system", "Be brief."),
        ("user", "Hi."),
        ("assistant", "Hello."),
        ("user", [ImagePart(picture), "What is it?"]),
    ]
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        same = run_request(stub, build_request(messages=messages, max_tokens=MAX_TOKENS), timeout=60)
    assert same.ok, same
    assert ids == same.token_ids, (family, events)
    assert events[-1]["finished"]["completion_tokens"] == len(ids)


def test_n_choices_over_grpc_are_tagged_seeded_and_each_finished(chat_pair: tuple[str, Pair]) -> None:
    """GenerateRequest.n: every response names its choice, each choice has
    its own Finished, greedy choices agree, seeded sampled ones repeat."""
    family, pair = chat_pair
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

        def texts(request: tokenizer_pb2.GenerateRequest) -> dict[int, str]:
            out: dict[int, str] = {}
            finished: list[int] = []
            for event in stub.Generate(request, timeout=60):
                if event.HasField("delta"):
                    out[event.index] = out.get(event.index, "") + event.delta.text
                elif event.HasField("finished"):
                    finished.append(event.index)
            assert sorted(finished) == list(range(request.n)), (family, finished)
            return out

        greedy = build_request(messages=[("user", "Hi there.")], max_tokens=4)
        greedy.n = 3
        assert len(set(texts(greedy).values())) == 1, family
        sampled = build_request(messages=[("user", "Hi there.")], max_tokens=6, temperature=1.0, seed=9)
        sampled.n = 2
        assert texts(sampled) == texts(sampled), family
        sampled.n = 9
        out = run_request(stub, sampled, timeout=30)
    assert (out.reason, out.metadata.get("param")) == ("INVALID_REQUEST", "n")


def test_a_conversation_resent_whole_each_turn_hits_the_prefix_cache_and_keeps_its_tokens(
    chat_pair: tuple[str, Pair],
) -> None:
    """Four turns of one chat, each resent whole with the answers so far
    (images in turns 1 and 3; for the video families a video in turn 2, which
    Qwen3-VL writes as several timed runs and InternVL as a line of image
    placeholders a frame), the way chat clients do: every
    turn's tokens equal `generate` on the whole conversation (the scheduler's
    prefix cache is on by default), and turns 2 to 4 report prompt tokens
    taken from it."""
    from tokenizer_svc.decode import decode_image

    family, pair = chat_pair
    a, b = png(96, 128, 5), png(128, 96, 6)
    asks: list[list[Any]] = [
        ["Describe this picture: its colors, its shapes, where the light comes from and what it shows.", ImagePart(a)],
        ["Now say it again in other words, at more length, for a child who cannot see it."]
        + (
            [VideoPart(samples.video(frames=12, seed=1)), "And this clip?"]
            if family.startswith(("qwen", "internvl"))
            else []
        ),
        [ImagePart(b), "And this second picture: how does it differ from the first one?"],
        ["Which of the two would you hang in a kitchen, and why?"],
    ]
    messages: list[tuple[str, Any]] = [("system", "You are a careful describer of pictures.")]
    proc = hf_family.processor(pair.model)
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for turn, ask in enumerate(asks):
            messages.append(("user", ask))
            request = build_request(messages=messages, max_tokens=MAX_TOKENS)
            request.sampling.logprobs = True
            out = run_request(stub, request, timeout=120)
            assert out.ok, (family, turn, out)
            text = proc.apply_chat_template(as_hf(messages), tokenize=False, add_generation_prompt=True)
            parts = [p for _, content in messages if not isinstance(content, str) for p in content]
            images = [decode_image(p.source, max_pixels=10**8) for p in parts if isinstance(p, ImagePart)]
            clips = [hf_family.video_inputs(pair.model, p.source, fps=2.0, max_frames=32)
                     for p in parts if isinstance(p, VideoPart)]  # fmt: skip
            tokens, logprobs = hf_family.scored(pair.model, proc, text, images, MAX_TOKENS, clips)
            assert out.token_ids == tokens, (family, turn)
            # A prefix taken from the cache gives what a whole prefill gives, to float noise.
            assert out.logprobs == pytest.approx(logprobs, abs=greedy.LOGPROB_TOLERANCE), (family, turn)
            if turn:
                assert out.cached_tokens > 0, (family, turn, out)
            else:
                assert out.cached_tokens == 0
            messages.append(("assistant", out.text))
