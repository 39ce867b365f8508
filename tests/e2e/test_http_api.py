"""The OpenAI-compatible HTTP API through real servers, driven by the
official `openai` SDK (sync and async, streaming and not): the same greedy
text as gRPC for the same conversation, streamed or not; every bad input a
typed OpenAI error with its status, code and param, and a good request
succeeding after each; retriable errors say when to retry and the SDK
never resends one that cannot succeed; a client that leaves mid-stream
leaves nothing held."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmsplit.client import ImagePart, RequestFailed, VideoPart, build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import run_request
from mmsplit_server.serving import free_port
from tests.e2e.helpers import rank_active_requests, scrape, tokenizer_info
from tests.support import hf_loaded
from tests.support.leaks import PROJECT_PREFIX, project_segments, wait_until
from tests.support.services import ROOT, FreePort, Pair, running_pair
from tokenizer_svc.detokenize import token_text

pytestmark = pytest.mark.e2e
KEY = "sk-test-0123456789"
BODY_LIMIT = 2 * 1024 * 1024


@dataclass
class Api:
    pair: Pair
    url: str  # http://127.0.0.1:PORT/v1
    model: str
    metrics: str  # http://127.0.0.1:PORT/metrics
    scheduler_metrics: int  # the scheduler's metrics port
    closed_port: int  # a loopback port the fetch guard lets through, where nothing listens
    key_file: Path  # --api-key-file (read again as it changes)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=KEY, **kwargs)

    def seen(self, route: str, status: int) -> float:
        """Responses the server counted for `route` with `status`."""
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        labels = f'{{route="{route}",status="{status}"}}'
        for line in text.splitlines():
            if line.startswith(f"mmsplit_tokenizer_http_responses_total{labels} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _api(model: Path, logs: Path, *, tp: str = "1", extra: tuple[str, ...] = ()) -> Iterator[Api]:
    (logs / "key").write_text(KEY + "\n")
    http, metrics, closed = FreePort(), FreePort(), free_port()  # closed: nothing listens there
    tokenizer = [
        "--http-port", http,
        "--api-key-file", str(logs / "key"),
        "--http-max-body-bytes", str(BODY_LIMIT),
        "--metrics-port", metrics,
        "--private-fetch-exempt", f"127.0.0.1:{closed}",
        "--fetch-retries", "0",
        *extra,
    ]  # fmt: skip
    scheduler_metrics = FreePort()
    scheduler = ["--tp", tp, "--metrics-port", scheduler_metrics]
    with running_pair(model, logs, scheduler_extra=scheduler, tokenizer_extra=tokenizer) as pair:
        urls = f"http://127.0.0.1:{http.number}/v1", f"http://127.0.0.1:{metrics.number}/metrics"
        yield Api(pair, urls[0], model.name, urls[1], scheduler_metrics.number, closed, logs / "key")


@pytest.fixture(scope="module")
def api(chat_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from _api(chat_models("llava"), tmp_path_factory.mktemp("http"))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime), "detail": "high"}}


A, B = samples.good_png(seed=11), samples.good_png(seed=12)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(A)]},
    {"role": "assistant", "content": "A picture."},
    {"role": "user", "content": [image_part(B), {"type": "text", "text": "And this?"}]},
]
SAME_OVER_GRPC = [
    ("system", "You answer briefly."),
    ("user", ["What is this?", ImagePart(A)]),
    ("assistant", "A picture."),
    ("user", [ImagePart(B), "And this?"]),
]


def grpc_text(pair: Pair, messages: list[Any], max_tokens: int, **sampling: Any) -> str:
    request = build_request(messages=messages, max_tokens=max_tokens, **sampling)
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request)
    assert out.ok, out
    return out.text


def test_a_conversation_is_the_same_over_http_and_grpc_streamed_or_not(api: Api) -> None:
    client = api.client()
    whole = client.chat.completions.create(model=api.model, messages=CONVERSATION, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None
    assert whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert choice.message.content == grpc_text(api.pair, SAME_OVER_GRPC, 8)

    chunks = list(
        client.chat.completions.create(
            model=api.model,
            messages=CONVERSATION,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def curl(api: Api, path: str, body: dict[str, Any] | None, *, key: str = KEY) -> tuple[int, str]:
    """`curl` as a person types it (-N: print the stream as it comes): the status and the body."""
    command = ["curl", "-sS", "-N", "-w", "\n%{http_code}", "-H", "Content-Type: application/json"]
    if key:
        command += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        command += ["--data-binary", "@-"]
    done = subprocess.run(
        [*command, f"{api.url}{path}"], input=json.dumps(body), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    text, status = done.stdout.rsplit("\n", 1)
    return int(status), text


def test_curl_streams_server_sent_events_and_reads_errors(api: Api) -> None:
    """The stream as curl prints it: `data: ` lines of chunks, the text the
    SDK gets whole, the usage last, then `data: [DONE]`; a bad body and a
    missing key are JSON errors with their statuses."""
    question = {"model": api.model, "messages": CONVERSATION, "max_tokens": 8, "temperature": 0}
    whole = api.client().chat.completions.create(**question)
    status, stream = curl(
        api, "/chat/completions", {**question, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200, stream
    events = [line for line in stream.splitlines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole.choices[0].message.content
    assert chunks[-1]["choices"] == []
    assert whole.usage is not None
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens

    status, said = curl(api, "/chat/completions", {**question, "max_tokens": -1})
    assert status == 400, said
    error = json.loads(said)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "max_tokens")
    assert error["message"]
    status, said = curl(api, "/chat/completions", question, key="")
    assert status == 401, said
    assert json.loads(said)["error"]["message"]


@pytest.mark.skipif(
    shutil.which("node") is None, reason="Node.js is not installed (make dev installs it where apt can)"
)
def test_the_javascript_sdk_gets_what_the_python_sdk_gets(api: Api, tmp_path: Path) -> None:
    """tests/js/openai-sdk.mjs: the official SDK for JavaScript parses our
    answers, streams and errors as its own (its stream helpers assemble a
    completion and a tool call from the chunks; its Responses stream takes
    our events in order), and its greedy text is the Python SDK's."""
    js = ROOT / "tests" / "js"
    assert (js / "node_modules" / "openai").is_dir(), "tests/js is not installed: run `make dev`"
    image = samples.good_jpeg(seed=5)
    (tmp_path / "image.jpg").write_bytes(image)
    done = subprocess.run(
        ["node", str(js / "openai-sdk.mjs"), api.url, KEY, api.model, str(tmp_path / "image.jpg")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = {report.pop("check"): report for report in map(json.loads, done.stdout.splitlines())}

    question = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(image, "image/jpeg")]}
    ]
    python = api.client().chat.completions.create(model=api.model, messages=question, max_tokens=8)  # type: ignore[arg-type]
    expected = python.choices[0].message.content
    assert seen["models"]["ids"] == [api.model]
    assert (seen["chat"]["text"], seen["chat"]["finish"]) == (expected, python.choices[0].finish_reason)
    assert python.usage is not None
    # The same prompt each time: the prefix cache gives the later ones all
    # but its last token, so the usages differ in cached_tokens only.
    usage = python.usage.model_dump(exclude_none=True)
    assert usage.pop("prompt_tokens_details") == {"cached_tokens": usage["prompt_tokens"] - 1}
    for check in ("chat", "chat stream"):
        seen[check]["usage"].pop("prompt_tokens_details")
    assert seen["chat"]["usage"] == usage
    assert seen["chat stream"] == {"text": expected, "usage": usage}
    assert seen["stream helper"]["text"] == expected
    assert seen["completion"]["text"]
    assert seen["responses"] == {"text": expected, "status": "incomplete"}  # cut at max_output_tokens
    events = seen["responses stream"]["events"]
    assert seen["responses stream"]["text"] == expected
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.incomplete"
    assert events.count("response.output_text.delta") >= 1
    assert "response.output_text.done" in events
    assert seen["continued"]["input_tokens"] > python.usage.prompt_tokens  # the first turn and its answer, stored

    for check in ("tool call", "tool call stream"):
        (call,) = seen[check]["calls"]
        assert call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert call["id"]
        assert set(json.loads(call["function"]["arguments"])) == {"city"}
    assert seen["tool call"]["finish"] == "tool_calls"

    errors = seen["errors"]
    assert errors["bad_parameter"] == {
        "name": "BadRequestError",
        "status": 400,
        "code": "INVALID_REQUEST",
        "param": "max_tokens",
        "type": "invalid_request_error",
    }
    assert (errors["unknown_model"]["name"], errors["unknown_model"]["status"]) == ("NotFoundError", 404)
    assert (errors["corrupt_image_streamed"]["name"], errors["corrupt_image_streamed"]["status"]) == (
        "BadRequestError",
        400,
    )
    assert errors["no_key"]["name"] == "AuthenticationError"
    assert errors["no_key"]["status"] == 401


def test_the_async_sdk_streams_and_completions_take_a_prompt(api: Api) -> None:
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=api.url, api_key=KEY)
        stream = await client.chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        done = await client.completions.create(model=api.model, prompt="Once upon a time", max_tokens=6)
        await client.close()
        return text, done.choices[0].text

    chat_text, completion = asyncio.run(run())
    assert chat_text == grpc_text(api.pair, [("user", "Tell me a story.")], 6)
    # Completions read the prompt as written (no chat template), as OpenAI's do.
    as_written = build_request("Once upon a time", max_tokens=6, prompt_as_written=True)
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        plain = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), as_written)
    assert completion == plain.text
    from mmsplit.client import Client

    with Client(api.pair.tokenizer_address) as grpc_client:
        written = grpc_client.tokenize("Once upon a time", prompt_as_written=True).ids
        templated = grpc_client.tokenize("Once upon a time").ids
    assert len(written) < len(templated)  # a gRPC prompt is otherwise the chat template's user turn


def test_completions_of_several_prompts_are_each_prompt_s_own(api: Api) -> None:
    """`prompt` as a list: choice p * n + j is prompt p's j-th, whole and
    streamed, each the text its prompt alone gives; the usage adds the
    prompts' tokens up."""
    client = api.client()
    prompts = ["Once upon a time", "The weather today", "Numbers: 1 2 3"]
    alone = [client.completions.create(model=api.model, prompt=p, max_tokens=5) for p in prompts]
    together = client.completions.create(model=api.model, prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in together.choices] == list(range(6))
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert together.usage is not None
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    assert together.usage.completion_tokens == sum(c.usage.completion_tokens * 2 for c in alone)  # type: ignore[union-attr]
    texts = [""] * 3
    for chunk in client.completions.create(model=api.model, prompt=prompts, max_tokens=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [a.choices[0].text for a in alone]
    bad = _bad(api, lambda c: c.completions.create(model=api.model, prompt=["fine", "</s> no"], max_tokens=2))
    assert bad.status_code == 400
    _good_after(api)


def test_stop_lists_and_n_choices(api: Api) -> None:
    client = api.client()
    question = [{"role": "user", "content": "Count: one two three"}]
    free = client.chat.completions.create(model=api.model, messages=question, max_tokens=12).choices[0].message.content
    assert free
    cut = free[len(free) // 2 :][:3].strip() or free[-1]
    stopped = client.chat.completions.create(model=api.model, messages=question, max_tokens=12, stop=[cut, "\u2603"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == free[: free.index(cut)]
    two = client.chat.completions.create(model=api.model, messages=question, max_tokens=6, n=2, seed=5, temperature=1)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage is not None
    assert 2 <= two.usage.completion_tokens <= 12, two.usage
    again = client.chat.completions.create(model=api.model, messages=question, max_tokens=6, n=2, seed=5, temperature=1)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices], "seeded"
    streamed = client.chat.completions.create(
        model=api.model, messages=question, max_tokens=6, n=2, seed=5, temperature=1, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in two.choices]


def _preprocessed(api: Api) -> float:
    """The tokenizer's count of items its workers preprocessed."""
    scraped = urllib.request.urlopen(api.metrics, timeout=10).read().decode()
    (line,) = [x for x in scraped.splitlines() if x.startswith("mmsplit_tokenizer_preprocessed_items_total ")]
    return float(line.split()[1])


def test_n_choices_of_an_image_preprocess_it_once(api: Api) -> None:
    """A chat with a new image asked for n = 4: the image is decoded and
    preprocessed once (each choice's scheduler request gets a copy), and
    the four greedy choices are the one-choice answer."""

    def preprocessed() -> float:
        return _preprocessed(api)

    client = api.client()
    question = [{"role": "user", "content": [image_part(samples.good_png(seed=77)), {"type": "text", "text": "Hi"}]}]
    before = preprocessed()
    four = client.chat.completions.create(model=api.model, messages=question, max_tokens=5, n=4)  # type: ignore[arg-type]
    assert preprocessed() - before == 1
    one = client.chat.completions.create(model=api.model, messages=question, max_tokens=5)  # type: ignore[arg-type]
    assert [c.message.content for c in four.choices] == [one.choices[0].message.content] * 4
    assert four.usage is not None
    assert one.usage is not None
    assert four.usage.prompt_tokens == one.usage.prompt_tokens


def test_one_new_image_sent_by_many_at_once_is_preprocessed_once(api: Api) -> None:
    """Six clients send the same new 1920x1080 photo at once: those that
    find it being preprocessed for another wait for that and take the
    cache's copy, so the workers preprocess it once; every answer is the
    same."""
    photo = samples.encode(samples.gradient(1920, 1080, seed=78), "JPEG", quality=90)
    question = [{"role": "user", "content": [image_part(photo, "image/jpeg"), {"type": "text", "text": "Hi"}]}]
    before = _preprocessed(api)
    barrier = threading.Barrier(6)

    def ask(_: int) -> str | None:
        client = api.client()
        barrier.wait()
        reply = client.chat.completions.create(model=api.model, messages=question, max_tokens=4)  # type: ignore[arg-type]
        return reply.choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    assert _preprocessed(api) - before == 1
    assert len(set(answers)) == 1, answers


def test_continue_final_message_and_chat_template_kwargs(api: Api) -> None:
    """vLLM's continue_final_message (extra_body): the model continues the
    last assistant message, whose turn is left open (fewer prompt tokens
    than the same message closed, no generation prompt), the text gRPC
    gives for the contract's field; chat_template_kwargs are taken (this
    template uses none: the same answer); add_generation_prompt true with
    it is a 400."""
    client = api.client()
    begun = [*CONVERSATION, {"role": "assistant", "content": "It is a"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    whole = client.chat.completions.create(model=api.model, messages=begun, max_tokens=8, extra_body=extra)  # type: ignore[arg-type]
    closed = client.chat.completions.create(model=api.model, messages=begun, max_tokens=8)  # type: ignore[arg-type]
    assert whole.usage is not None
    assert closed.usage is not None
    assert whole.usage.prompt_tokens < closed.usage.prompt_tokens
    text = whole.choices[0].message.content
    request = build_request(messages=[*SAME_OVER_GRPC, ("assistant", "It is a")], max_tokens=8,
                            continue_final_message=True)  # fmt: skip
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        over_grpc = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request)
    assert (over_grpc.ok, over_grpc.text) == (True, text), over_grpc
    kwargs = {**extra, "chat_template_kwargs": {"enable_thinking": False}}
    same = client.chat.completions.create(model=api.model, messages=begun, max_tokens=8, extra_body=kwargs)  # type: ignore[arg-type]
    assert same.choices[0].message.content == text
    bad = _bad(api, _chat([{"type": "text", "text": "x"}], extra_body={"continue_final_message": True}))
    assert (bad.status_code, bad.body["param"]) == (400, "continue_final_message")  # type: ignore[index]
    both = {"continue_final_message": True, "add_generation_prompt": True}
    bad = _bad(api, lambda c: c.chat.completions.create(model=api.model, messages=begun, extra_body=both))  # type: ignore[arg-type]
    assert (bad.status_code, bad.body["param"]) == (400, "add_generation_prompt")  # type: ignore[index]
    _good_after(api)


def test_vllm_s_min_p_ignore_eos_and_include_stop_str_in_output(api: Api) -> None:
    """Through the openai SDK's extra_body: include_stop_str_in_output ends
    the text with the stop string; ignore_eos runs past an end-of-sequence
    the bias makes certain (to max_tokens, finish_reason length; without
    it: stop at once); min_p 1 at a high temperature keeps only the
    likeliest token: the greedy text."""
    client = api.client()
    question = [{"role": "user", "content": "Count: one two three"}]
    free = client.chat.completions.create(model=api.model, messages=question, max_tokens=12).choices[0].message.content
    assert free
    cut = free[len(free) // 2 :][:3].strip() or free[-1]
    kept = client.chat.completions.create(
        model=api.model, messages=question, max_tokens=12, stop=[cut], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == free[: free.index(cut) + len(cut)]
    eos = hf_loaded.tokenizer(api.pair.model).eos_token_id
    ended = {"model": api.model, "messages": question, "max_tokens": 5, "logit_bias": {str(eos): 100}}
    short = client.chat.completions.create(**ended)  # type: ignore[call-overload]
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("stop", 1)
    long = client.chat.completions.create(**ended, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert (long.choices[0].finish_reason, long.usage.completion_tokens) == ("length", 5)
    hot = client.chat.completions.create(
        model=api.model, messages=question, max_tokens=12, temperature=5, seed=3, extra_body={"min_p": 1.0}
    )
    assert hot.choices[0].message.content == free


def _bad(api: Api, call: Callable[[openai.OpenAI], Any]) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call(api.client(max_retries=2))
    return info.value


def _streamed_text(api: Api, **kwargs: Any) -> str:
    """A streamed chat completion's content, all its chunks joined."""
    chunks = api.client().chat.completions.create(model=api.model, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _good_after(api: Api) -> None:
    ok = api.client().chat.completions.create(
        model=api.model, messages=[{"role": "user", "content": [image_part(A), {"type": "text", "text": "Hi"}]}],
        max_tokens=2,
    )  # fmt: skip
    assert ok.choices[0].finish_reason in ("stop", "length")


def _chat(content: list[dict[str, Any]], **kwargs: Any) -> Callable[[openai.OpenAI], Any]:
    def call(client: openai.OpenAI) -> Any:
        model = kwargs.pop("model", "chat-llava")
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=2, **kwargs
        )

    return call


def test_bad_inputs_get_typed_errors_that_the_sdk_does_not_resend(api: Api) -> None:
    corrupt = A[: len(A) // 2]
    text = {"type": "text", "text": "What is it?"}
    unknown = {"type": "image_url", "image_url": {"url": data_url(b"plain text, no picture format", "image/x-unknown")}}
    cases: list[tuple[Callable[[openai.OpenAI], Any], type[openai.APIStatusError], int, str, str | None]] = [
        (_chat([text, image_part(corrupt)]), openai.BadRequestError, 400, "MEDIA_DECODE_FAILED",
         "messages[0].content[1]"),
        (_chat([text, unknown]),
         openai.BadRequestError, 400, "MEDIA_UNSUPPORTED", "messages[0].content[1]"),
        (_chat([text, {"type": "image_url", "image_url": {"url": "http://127.0.0.2:9/x.png"}}]),
         openai.PermissionDeniedError, 403, "MEDIA_SOURCE_FORBIDDEN", "messages[0].content[1]"),
        (_chat([text, image_part(b"\x89PNG" + bytes(3 * 1024 * 1024))]), openai.APIStatusError, 413,
         "MEDIA_TOO_LARGE", None),
        (_chat([text], model="no-such-model"), openai.NotFoundError, 404, "NOT_FOUND", "model"),
        (_chat([text], temperature=-1), openai.BadRequestError, 400, "INVALID_REQUEST", "temperature"),
        (_chat([text], n=99), openai.BadRequestError, 400, "INVALID_REQUEST", "n"),
        # Asked for what this server cannot do: refused, not answered as if unasked.
        (_chat([text], response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}),
         openai.BadRequestError, 400, "INVALID_REQUEST", "response_format"),
        (_chat([text], response_format={"type": "json_object"}, extra_body={"min_tokens": 2}),
         openai.BadRequestError, 400, "INVALID_REQUEST", "response_format"),
        (_chat([text], tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
               tool_choice={"type": "function", "function": {"name": "f"}}),
         openai.BadRequestError, 400, "INVALID_REQUEST", "tools"),
        (_chat([text], tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
         openai.BadRequestError, 400, "INVALID_REQUEST", "tool_choice"),
        (_chat([text], frequency_penalty=2.5), openai.BadRequestError, 400, "INVALID_REQUEST", "frequency_penalty"),
        (_chat([text], extra_body={"repetition_penalty": 0}), openai.BadRequestError, 400, "INVALID_REQUEST",
         "repetition_penalty"),
        (_chat([text], logit_bias={"12": 101}), openai.BadRequestError, 400, "INVALID_REQUEST", "logit_bias"),
        # Outside the model's vocabulary: the scheduler refuses it, named as the client wrote it.
        (_chat([text], logit_bias={str(10**6): 1}), openai.BadRequestError, 400, "INVALID_REQUEST", "logit_bias"),
    ]  # fmt: skip
    for call, cls, status, code, param in cases:
        before = api.seen("/v1/chat/completions", status)
        error = _bad(api, call)
        assert type(error) is cls, (code, error)
        assert error.status_code == status, (code, error)
        body = error.body if isinstance(error.body, dict) else {}
        assert (body.get("code"), body.get("param")) == (code, param), (code, body)
        assert error.response.headers.get("x-should-retry") == "false"
        # Seen once: the SDK did not resend it.
        assert wait_until(lambda s=status, b=before: api.seen("/v1/chat/completions", s) == b + 1, timeout=5), code
        _good_after(api)


def test_unreachable_media_is_a_retriable_502_with_retry_after(api: Api) -> None:
    call = _chat([{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{api.closed_port}/x.png"}}])
    with pytest.raises(openai.APIStatusError) as info:
        call(api.client(max_retries=0))
    error = info.value
    assert error.status_code == 502
    assert isinstance(error.body, dict)
    assert error.body["code"] == "MEDIA_FETCH_FAILED"
    assert error.response.headers.get("x-should-retry") == "true"
    assert int(error.response.headers["Retry-After"]) >= 1
    _good_after(api)


def test_raw_http_mistakes_key_body_and_health(api: Api) -> None:
    base = api.url.removesuffix("/v1")

    def post(path: str, data: bytes, key: str = KEY) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            base + path, data=data, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post("/v1/chat/completions", b"{not json")
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
    status, body = post("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)  # valid, and deeper than the parser
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
    # Valid JSON, but a lone surrogate is not text: refused, naming its place (it broke protobuf: INTERNAL).
    lone = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a \\udfff"}]}]}'
    status, body = post("/v1/chat/completions", lone)
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
    assert body["error"]["param"] == "messages[0].content[0].text"
    status, body = post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                        key="wrong")  # fmt: skip
    assert (status, body["error"]["code"], body["error"]["type"]) == (401, "UNAUTHENTICATED", "authentication_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api.url, api_key="wrong").models.list()
    status, body = post("/v1/chat/completions", b"{" + b" " * (BODY_LIMIT + 10) + b"}")
    assert (status, body["error"]["code"]) == (413, "MEDIA_TOO_LARGE")
    assert [m.id for m in api.client().models.list()] == [api.model]
    assert api.client().models.retrieve(api.model).id == api.model
    with pytest.raises(openai.NotFoundError) as unknown:
        api.client().models.retrieve("no-such-model")
    assert unknown.value.body["param"] == "model"  # type: ignore[index]
    with urllib.request.urlopen(base + "/health", timeout=10) as reply:
        assert reply.status == 200
    # vLLM's /ping (GET or POST, as SageMaker asks) and /version, with curl and no key.
    from mmsplit import __version__

    def curl(*args: str) -> str:
        return subprocess.run(["curl", "-s", *args], capture_output=True, text=True, timeout=30, check=True).stdout

    for method in ("GET", "POST"):
        assert curl("-X", method, "-o", "/dev/null", "-w", "%{http_code}", base + "/ping") == "200", method
    assert json.loads(curl(base + "/version")) == {"version": __version__}
    # A body past the limit sent in chunks (no Content-Length to refuse it by): a 413 once it passes.
    (api.key_file.parent / "big.json").write_bytes(b"{" + b" " * (BODY_LIMIT + 10) + b"}")
    sent = curl("-H", "Transfer-Encoding: chunked", "-H", f"Authorization: Bearer {KEY}", "-H",
                "Content-Type: application/json", "--data-binary", f"@{api.key_file.parent / 'big.json'}",
                "-w", "\n%{http_code}", api.url + "/chat/completions")  # fmt: skip
    answer, _, code = sent.rpartition("\n")
    assert (code, json.loads(answer)["error"]["code"]) == ("413", "MEDIA_TOO_LARGE"), sent[-500:]
    _good_after(api)


# Generated bodies for the three generating routes: a request with some of
# the API's fields (and an unknown one) set, each to one of its edge values
# or to any JSON at all, and messages of any shape. Lengths stay small (the
# answer's time, not its validation, would grow with them).
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
_EDGES: dict[str, list[Any]] = {
    "temperature": [0, 1e-9, 0.7, 2], "top_p": [1e-9, 0.01, 1], "top_k": [-1, 0, 1, 10**6], "min_p": [0, 0.999],
    "seed": [0, -1, 2**63 - 1, 2**64 - 1], "stop": ["", " ", ["a", "b", "c", "d"], []],
    "stop_token_ids": [[], [0], [2**31]], "ignore_eos": [True], "include_stop_str_in_output": [True],
    "stream": [True, False], "stream_options": [{"include_usage": True, "continuous_usage_stats": True}],
    "logprobs": [True, 0, 5], "top_logprobs": [0, 20], "presence_penalty": [-2, 2], "frequency_penalty": [2],
    "repetition_penalty": [1e-9, 2], "logit_bias": [{"0": 100}, {str(i): 1 for i in range(1024)}],
    "allowed_token_ids": [[0], [1, 2, 3]], "bad_words": [["a"], [""]], "return_tokens_as_token_ids": [True],
    "response_format": [
        {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}},
    ],
    "structured_outputs": [{"regex": "[ab]{3}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}],
    "cache_salt": ["a", "b" * 256], "mm_processor_kwargs": [{}, {"max_pixels": 784}, {"fps": 1}],
    "return_token_ids": [True], "skip_special_tokens": [False], "truncate_prompt_tokens": [-1, 1, 50, 10**6],
    "priority": [0, 1], "use_beam_search": [True], "length_penalty": [0, 2], "echo": [True],
    "prompt_logprobs": [0, 5], "add_special_tokens": [False], "continue_final_message": [True],
    "add_generation_prompt": [False], "chat_template_kwargs": [{"enable_thinking": False}],
    "documents": [[{"title": "t", "text": "x"}]], "tools": [[_TOOL]],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
    "max_tokens": [0, 1, 3, -1], "n": [1, 2, 8], "min_tokens": [0, 2, 10**6],
}  # fmt: skip
_FIELDS = sorted([
    *_EDGES, "model", "messages", "prompt", "input", "instructions", "suffix", "parallel_tool_calls",
    "previous_response_id", "text", "reasoning", "store", "metadata", "user", "no_such_field",
])  # fmt: skip
_KEYS = st.sampled_from([*_FIELDS, "type", "text", "image_url", "url", "role", "content", "name", "json_schema",
                         "schema", "function", "parameters", "include_usage", "max_pixels", "fps"])  # fmt: skip
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2, 0.5, -0.0, 1e308, 2**63, 2**64])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "auto", "required", "none", "text", "json_object", "function", "<image>", "</s>"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8,
)
_ASK, _PICTURE = {"type": "text", "text": "What is it?"}, image_part(A)
_PART = st.one_of(
    st.sampled_from([_ASK, _PICTURE, {"image_url": data_url(B)}]),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "video_url", "input_text", "refusal"])},
        optional={"text": _JSON, "image_url": _JSON, "video_url": _JSON},
    ),
    st.dictionaries(_KEYS, _JSON, max_size=3),
)
_TURN = st.sampled_from([
    {"role": "user", "content": [_ASK, _PICTURE]}, {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "A picture."}, {"role": "system", "content": "Be brief."},
])  # fmt: skip
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), _JSON),
        "content": st.one_of(st.just("Hello"), st.lists(_PART, max_size=3), _JSON),
    },
    optional={"tool_calls": _JSON, "tool_call_id": _JSON, "name": _JSON},
)
_ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(sorted(_ROUTES)))
    body: dict[str, Any] = {"max_tokens": 3, "max_output_tokens": 16}  # the model's name: the test's
    # Mostly well-formed messages (what the fields' checks then see), some of any shape.
    turns = st.lists(_TURN, min_size=1, max_size=3).map(
        lambda t: [*t[:-1], {"role": "user", "content": [_ASK, _PICTURE]}]
    )
    shape = draw(st.integers(0, 9))
    if route == "chat":
        body["messages"] = draw(
            turns if shape < 6 else st.lists(_MESSAGE, min_size=1, max_size=3) if shape < 9 else _JSON
        )
    elif route == "completions":
        body["prompt"] = draw(
            st.just("Hello") if shape < 6 else st.lists(st.integers(-5, 40_000), max_size=4) if shape < 8 else _JSON
        )
    else:
        body["input"] = draw(st.just("Hello") if shape < 5 else st.lists(_MESSAGE, max_size=2) if shape < 8 else _JSON)
    for field in draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)):
        edges = _EDGES.get(field)
        body[field] = draw(st.sampled_from(edges) if edges and draw(st.integers(0, 2)) else _JSON)
    return route, body


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(case=_bodies())
def test_generated_bodies_get_an_answer_or_a_typed_client_error(api: Api, case: tuple[str, dict[str, Any]]) -> None:
    """Any JSON in any field of a generating route is answered (streamed to
    its end where asked) or refused with a 4xx of OpenAI's error shape,
    never a 5xx or a dropped connection; a good request succeeds after."""
    route, body = case
    body = {"model": api.model, **body}
    request = urllib.request.Request(
        api.url.removesuffix("/v1") + _ROUTES[route],
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    event(f"{route} {status}")  # --hypothesis-show-statistics: how far the bodies get
    assert status in (200, 400, 404, 413), (status, text[-2000:], body)
    if status != 200:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str), (error, body)
        assert error["message"], (error, body)
        assert error["type"], (error, body)
    elif body.get("stream") is True:
        # A stream's own failure is an event with a typed code (a chat
        # chunk {"error": ...}, a Responses "error" event), then its end.
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        failures = [e["error"] if isinstance(e.get("error"), dict) else e for e in events
                    if isinstance(e.get("error"), dict) or e.get("type") == "error"]  # fmt: skip
        assert all(f.get("code") not in (None, "INTERNAL") for f in failures), (failures, body)
        if route != "responses":
            assert text.rstrip().endswith("data: [DONE]"), (text[-2000:], body)
        else:
            last = events[-1]["type"] if events else None
            assert last in ("response.completed", "response.incomplete", "error"), (text[-2000:], body)
    else:
        assert "object" in json.loads(text), (text[-2000:], body)


def test_the_server_serves_on_after_the_generated_bodies(api: Api) -> None:
    _good_after(api)
    with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=10) as reply:
        assert reply.status == 200


def test_a_client_that_leaves_mid_stream_leaves_nothing_held(api: Api) -> None:
    client = api.client()
    stream = client.chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": [image_part(B), {"type": "text", "text": "Go on and on."}]}],
        max_tokens=2000,
        stream=True,
        extra_body={"min_tokens": 2000},
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    next(iter(stream))
    assert any(rank_active_requests(api.pair.scheduler_address)), "the request was over before the client left"
    left = time.monotonic()
    stream.close()
    # At once (5 s is a margin for a busy host), not when its 2,000 tokens are done.
    assert wait_until(lambda: not any(rank_active_requests(api.pair.scheduler_address)), timeout=5), "a row stayed"
    # The slice goes back to the slab when the tokenizer next checks its
    # hand-offs (every 20 ms): within the same few seconds.
    slab_free = lambda: tokenizer_info(api.pair.tokenizer_address).info.shm_slab_used_bytes == 0  # noqa: E731
    assert wait_until(slab_free, timeout=max(0.1, 5 - (time.monotonic() - left))), "the slab still holds its slice"
    assert time.monotonic() - left < 5.5
    mine = [n for n in project_segments() if n.startswith(f"{PROJECT_PREFIX}-{api.pair.tokenizer.pid}-")]
    assert not mine, mine
    # Its log line counts what it streamed (it once said "0+0 tokens").
    import re

    def cut() -> list[int]:
        text = api.pair.tokenizer.log_path.read_text()
        return [int(n) for n in re.findall(r"finished: CANCELLED, \d+\+(\d+) tokens", text)]

    assert wait_until(lambda: bool(cut()), timeout=5)
    assert cut()[-1] >= 1, cut()  # at least the chunk the client read (it logged 0); more is timing
    _good_after(api)


@pytest.fixture(scope="module")
def qwen_api(chat_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    # It takes requests' own chat templates (the other pair refuses them),
    # and tells a thinking model's reasoning from its answer.
    extra = ("--trust-request-chat-template", "--reasoning-parser", "qwen3")
    yield from _api(chat_models("qwen2-vl"), tmp_path_factory.mktemp("http-qwen"), extra=extra)


def test_video_url_on_a_video_model_is_the_same_over_http_and_grpc(qwen_api: Api) -> None:
    clip = samples.video(frames=8)
    content = [
        {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
        {"type": "text", "text": "What moves?"},
    ]
    reply = qwen_api.client().chat.completions.create(
        model=qwen_api.model, messages=[{"role": "user", "content": content}], max_tokens=6
    )
    assert reply.choices[0].message.content == grpc_text(qwen_api.pair, [("user", [VideoPart(clip), "What moves?"])], 6)


def test_prompt_logprobs_on_qwen2_vl_are_the_model_s_own(qwen_api: Api) -> None:
    """An M-RoPE family: a conversation with an image scored through chat
    completions' prompt_logprobs equals log_softmax of one HF forward of
    the same ids and pixels (the processor's), entry by entry."""
    import torch

    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    client = qwen_api.client()
    messages = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is it?"}]}]
    reply = client.chat.completions.create(
        model=qwen_api.model,
        messages=messages,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},  # type: ignore[arg-type]
    )
    entries = reply.model_dump()["prompt_logprobs"]
    processor = hf_family.processor(qwen_api.pair.model)
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[decode_image(A, max_pixels=10**8)], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert len(entries) == len(ids)
    model = hf_loaded.model(qwen_api.pair.model)
    with torch.inference_mode():
        expected = torch.log_softmax(model(**inputs).logits[0, :-1].float(), dim=-1)
    for k, entry in enumerate(entries[1:]):
        assert entry[str(ids[k + 1])]["logprob"] == pytest.approx(float(expected[k, ids[k + 1]]), abs=1e-4), k


def test_beam_search_on_qwen2_vl_returns_the_beams_transformers_finds(qwen_api: Api) -> None:
    """An M-RoPE family: each step re-sends the prompt with a beam's tokens,
    whose positions follow the image's as they do in generation: the beams
    equal transformers' generate(num_beams=3) on the same ids and pixels."""
    import torch

    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    processor = hf_family.processor(qwen_api.pair.model)
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[decode_image(A, max_pixels=10**8)], return_tensors="pt")
    model = hf_loaded.model(qwen_api.pair.model)
    with torch.inference_mode():
        made = model.generate(**inputs, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False)
    expected = made[:, inputs["input_ids"].shape[1] :].tolist()
    reply = qwen_api.client().chat.completions.create(
        model=qwen_api.model,
        messages=[{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is it?"}]}],
        max_tokens=6,
        n=3,
        extra_body={"use_beam_search": True, "return_token_ids": True},  # type: ignore[arg-type]
    )
    assert [c["token_ids"] for c in reply.model_dump()["choices"]] == expected


def test_mm_processor_kwargs_size_a_qwen_model_s_images_as_its_processor_does(qwen_api: Api, tmp_path: Path) -> None:
    """vLLM's `mm_processor_kwargs` `max_pixels` and `min_pixels`: the
    images of that request resized within them, as the model's own
    processor does with that `size`: the prompt ids (/tokenize, and chat's
    usage) and the greedy tokens with their log probabilities (gRPC's
    `image_budget`, through the client library). The same image with and
    without a budget, in turn, never gets the other's rows from the
    preprocessing cache. GetServerInfo names the checkpoint's budget; a
    budget past it, an unknown key, or one with a video is a 400 naming
    the field, and the next request succeeds."""
    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    pair, image = qwen_api.pair, samples.good_png(seed=21)
    proc = hf_family.processor(pair.model)
    own = proc.image_processor.size
    info = tokenizer_info(pair.tokenizer_address).info
    assert (info.image_min_pixels, info.image_max_pixels) == (own.shortest_edge, own.longest_edge)
    small = {"shortest_edge": 28 * 28, "longest_edge": 40 * 28 * 28}
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    pil = [decode_image(image, max_pixels=10**8)]
    ids = {
        name: proc(images=pil, text=text, return_tensors="pt", **kw)["input_ids"][0].tolist()
        for name, kw in (("own", {}), ("small", {"size": small}))
    }
    assert len(ids["small"]) < len(ids["own"])  # the budget matters for this image

    messages = [{"role": "user", "content": [image_part(image), {"type": "text", "text": "What is it?"}]}]
    kwargs = {"mm_processor_kwargs": {"max_pixels": small["longest_edge"], "min_pixels": small["shortest_edge"]}}
    base = qwen_api.url.removesuffix("/v1")
    request = urllib.request.Request(
        base + "/tokenize", data=json.dumps({"messages": messages, **kwargs}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["tokens"] == ids["small"]
    client = qwen_api.client()
    for name in ("small", "own", "small", "own"):  # the cache holds both forms of the image, each its own
        reply = client.chat.completions.create(
            model=qwen_api.model, messages=messages, max_tokens=1,
            extra_body=kwargs if name == "small" else {},  # type: ignore[arg-type]
        )  # fmt: skip
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(ids[name]), name

    asked = build_request(
        messages=[("user", [ImagePart(image), "What is it?"])],
        max_tokens=4,
        min_pixels=small["shortest_edge"],
        max_pixels=small["longest_edge"],
    )
    asked.sampling.logprobs = True
    got: list[int] = []
    scores: list[float] = []
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(asked, timeout=60):
            if event.HasField("delta"):
                got += event.delta.token_ids
                scores += [lp.logprob for lp in event.delta.logprobs]
    expected, logprobs = hf_family.scored(pair.model, proc, text, pil, 4, size=small)
    assert got == expected
    assert scores == pytest.approx(logprobs, abs=1e-4)
    # The command line's --min-pixels and --max-pixels: the image's placeholders as few as above.
    path = tmp_path / "image.png"
    path.write_bytes(image)
    argv = [sys.executable, "-m", "mmsplit_cli", "generate", "--server", pair.tokenizer_address, "--tokenize", "--json"]
    argv += ["--image", str(path), "What is it?"]
    bounds = ["--min-pixels", str(small["shortest_edge"]), "--max-pixels", str(small["longest_edge"])]
    counts = [
        json.loads(subprocess.run(a, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout)["count"]
        for a in (argv, [*argv, *bounds])
    ]
    assert counts[0] - counts[1] == len(ids["own"]) - len(ids["small"]), counts

    clip = {"type": "video_url", "video_url": {"url": data_url(samples.video(frames=4), "video/mp4")}}
    for body, param in (
        ({"max_pixels": own.longest_edge + 1}, "mm_processor_kwargs.max_pixels"),
        ({"max_pixels": 100}, "mm_processor_kwargs.max_pixels"),  # under one merged patch (784)
        ({"min_pixels": 5000, "max_pixels": 4000}, "mm_processor_kwargs.min_pixels"),
        ({"max_pixels": "many"}, "mm_processor_kwargs.max_pixels"),
        ({"do_resize": False}, "mm_processor_kwargs.do_resize"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=qwen_api.model, messages=messages, max_tokens=1,
                extra_body={"mm_processor_kwargs": body},  # type: ignore[arg-type]
            )  # fmt: skip
        assert refused.value.body["param"] == param, (body, refused.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=qwen_api.model, messages=[{"role": "user", "content": [clip]}], max_tokens=1,
            extra_body=kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
    assert refused.value.body["param"] == "mm_processor_kwargs"  # type: ignore[index]
    assert "images only" in refused.value.body["message"]  # type: ignore[index]
    _good_after(qwen_api)


def test_mm_processor_kwargs_fps_and_max_frames_sample_a_qwen_model_s_videos(qwen_api: Api) -> None:
    """vLLM's `mm_processor_kwargs` `fps` and `max_frames`: that request's
    videos sampled by that rule within the server's, as transformers' video
    processor samples them (the placeholders of its grid; usage over HTTP,
    Tokenize over gRPC); each rule's rows are their own in the preprocessing
    cache; a rule past the server's, or malformed, is a 400 naming it."""
    from mmsplit.client import Client
    from tests.support import hf_family

    pair, clip = qwen_api.pair, samples.video(frames=48, fps=6)  # 8 seconds
    merge = json.loads((pair.model / "video_preprocessor_config.json").read_text())["merge_size"]
    content = [{"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}, {"type": "text", "text": "Hi"}]

    def placeholders(fps: float, max_frames: int) -> int:
        grid = hf_family.video_inputs(pair.model, clip, fps=fps, max_frames=max_frames)["video_grid_thw"]
        return int(grid.prod()) // merge**2

    def prompt_tokens(**rule: Any) -> int:
        reply = qwen_api.client().chat.completions.create(
            model=qwen_api.model, messages=[{"role": "user", "content": content}], max_tokens=1,
            extra_body={"mm_processor_kwargs": rule},  # type: ignore[arg-type]
        )  # fmt: skip
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    text = prompt_tokens() - placeholders(2.0, 32)  # the server's rule: the model's 2 fps
    assert placeholders(2.0, 4) < placeholders(2.0, 32)
    for rule, (fps, most) in (
        ({"max_frames": 4}, (2.0, 4)),
        ({}, (2.0, 32)),
        ({"fps": 0.5}, (0.5, 32)),
        ({"fps": 0.5, "max_frames": 4}, (0.5, 4)),
        ({"max_frames": 4}, (2.0, 4)),
    ):
        assert prompt_tokens(**rule) == text + placeholders(fps, most), rule
    with Client(pair.tokenizer_address) as grpc_client:
        counted = grpc_client.tokenize(messages=[("user", [VideoPart(clip), "Hi"])], video_max_frames=4).ids
    assert len(counted) == text + placeholders(2.0, 4)
    for rule, param in (
        ({"fps": 0}, "mm_processor_kwargs.fps"),
        ({"fps": 61}, "mm_processor_kwargs.fps"),
        ({"fps": "fast"}, "mm_processor_kwargs.fps"),
        ({"max_frames": 0}, "mm_processor_kwargs.max_frames"),
        ({"max_frames": 33}, "mm_processor_kwargs.max_frames"),  # over the server's --video-max-frames 32
    ):
        refused = _bad(qwen_api, lambda c, rule=rule: prompt_tokens(**rule))  # type: ignore[misc]
        assert (refused.status_code, refused.body["param"]) == (400, param), (rule, refused.body)  # type: ignore[index]
    _good_after(qwen_api)


def test_mm_processor_kwargs_are_refused_by_a_model_whose_images_are_one_size(api: Api) -> None:
    """LLaVA resizes every image to its own size: a pixel budget would be
    ignored, so it is refused by name; an empty one asks for nothing."""
    messages = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "Hi"}]}]
    client = api.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=api.model, messages=messages, max_tokens=1,
            extra_body={"mm_processor_kwargs": {"max_pixels": 50_000}},  # type: ignore[arg-type]
        )  # fmt: skip
    assert refused.value.body["param"] == "mm_processor_kwargs"  # type: ignore[index]
    assert "one size" in refused.value.body["message"]  # type: ignore[index]
    info = tokenizer_info(api.pair.tokenizer_address).info
    assert (info.image_min_pixels, info.image_max_pixels) == (0, 0)
    reply = client.chat.completions.create(
        model=api.model,
        messages=messages,
        max_tokens=1,
        extra_body={"mm_processor_kwargs": {}},  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason == "length"


def test_logprobs_are_the_model_s_log_softmax_and_the_same_over_http(api: Api) -> None:
    """Greedy: each token's log probability equals log_softmax of the
    model's own logits at its position (single-process HF forward), and
    the top 5 are that distribution's top 5; over HTTP, the same values in
    OpenAI's shape, streamed or not."""
    import torch

    from mmsplit.tokenizer.v1 import tokenizer_pb2
    from tests.support import hf_family

    messages = [("system", "Be brief."), ("user", "Name three colors.")]
    request = build_request(messages=messages, max_tokens=6)
    request.sampling.logprobs, request.sampling.top_logprobs = True, 5
    ids: list[int] = []
    got: list[tokenizer_pb2.TokenLogprob] = []
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=60):
            if event.HasField("delta"):
                assert len(event.delta.logprobs) == len(event.delta.token_ids)
                ids += event.delta.token_ids
                got += event.delta.logprobs
    assert ids
    proc = hf_family.processor(api.pair.model)
    text = proc.apply_chat_template(
        [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = hf_family.prompt_ids(proc, text, [])
    model = hf_loaded.model(api.pair.model)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for k, (token, lp) in enumerate(zip(ids, got, strict=True)):
        assert lp.logprob == pytest.approx(float(expected[k, token]), abs=1e-4), k
        top = torch.topk(expected[k], 5)
        assert list(lp.top_token_ids) == top.indices.tolist(), k
        assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)

    client = api.client()
    chat = [{"role": r, "content": t} for r, t in messages]
    whole = client.chat.completions.create(model=api.model, messages=chat, max_tokens=6, logprobs=True, top_logprobs=5)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in got], abs=1e-6)
    assert all(len(c.top_logprobs) == 5 for c in content)
    assert len(content) == len(ids)
    streamed = client.chat.completions.create(
        model=api.model, messages=chat, max_tokens=6, logprobs=True, top_logprobs=5, stream=True
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in got], abs=1e-6)


def _described_a(api: Api) -> tuple[dict[str, Any], list[int], Any]:
    """One user turn, "Describe the image." with image A, as transformers
    reads it: the processor's inputs, the prompt's ids, the model."""
    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    proc = hf_family.processor(api.pair.model)
    hf_chat = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}, {"type": "image"}]}]
    text = proc.apply_chat_template(hf_chat, tokenize=False, add_generation_prompt=True)
    inputs = dict(proc(images=[decode_image(A, max_pixels=10**8)], text=text, return_tensors="pt"))
    return inputs, inputs["input_ids"][0].tolist(), hf_loaded.model(api.pair.model)


def test_penalties_and_logit_bias_give_the_tokens_of_their_definitions(api: Api) -> None:
    """Greedy, a chat turn with an image: with each of repetition_penalty,
    frequency_penalty, presence_penalty and logit_bias (and all at once)
    the served tokens are those of a reference loop here (the plain model's
    logits at each step, adjusted as defined: the bias added, transformers'
    own repetition penalty over prompt and output, OpenAI's frequency and
    presence over the output), and differ from the tokens without; the
    repetition penalty's equal `generate`'s with its own. Over HTTP the
    openai SDK's named fields (repetition_penalty in extra_body) give the
    text gRPC gives."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    messages, tokens = [("user", ["Describe the image.", ImagePart(A)])], 10
    inputs, prompt_ids, model = _described_a(api)
    eos = model.config.text_config.eos_token_id

    def served(**knobs: Any) -> list[int]:
        request = build_request(messages=messages, max_tokens=tokens, **knobs)
        with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
            out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request)
        assert out.ok, (knobs, out)
        return out.token_ids

    def reference(**knobs: Any) -> list[int]:
        out: list[int] = []
        with torch.inference_mode():
            while len(out) < tokens and eos not in out:
                seq = torch.tensor([prompt_ids + out])
                logits = model(input_ids=seq, pixel_values=inputs["pixel_values"]).logits[0, -1]
                for token, bias in knobs.get("logit_bias", {}).items():
                    logits[token] += bias
                if "repetition_penalty" in knobs:
                    logits = RepetitionPenaltyLogitsProcessor(knobs["repetition_penalty"])(seq, logits[None])[0]
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
                logits -= knobs.get("frequency_penalty", 0) * counts + knobs.get("presence_penalty", 0) * (counts > 0)
                out.append(int(logits.argmax()))
        return out

    plain = served()
    assert plain == reference()
    cases: list[dict[str, Any]] = [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"logit_bias": {plain[0]: -100.0, plain[-1]: 4.0}},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {plain[1]: 2.5}},
    ]
    for knobs in cases:
        got = served(**knobs)
        assert got == reference(**knobs), knobs
        assert got != plain, ("the knob changed nothing: the case proves nothing", knobs)
    with torch.inference_mode():
        made = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, repetition_penalty=1.8)
    assert served(repetition_penalty=1.8) == made[0, len(prompt_ids) :].tolist()

    chat = [{"role": "user", "content": "Name three colors."}]
    knobs = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {plain[0]: -100.0}}
    whole = api.client().chat.completions.create(
        model=api.model, messages=chat, max_tokens=8, extra_body={"repetition_penalty": 1.4},  # type: ignore[arg-type]
        frequency_penalty=1.0, presence_penalty=0.5, logit_bias={str(plain[0]): -100},
    )  # fmt: skip
    over_grpc = grpc_text(api.pair, [("user", "Name three colors.")], 8, repetition_penalty=1.4, **knobs)
    assert whole.choices[0].message.content == over_grpc


COLORS = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["color", "bright"],
    "additionalProperties": False,
}


def test_response_format_json_schema_gives_a_document_of_the_schema(api: Api) -> None:
    """Structured output through the openai SDK, streamed and not: the
    random tiny model answers with a document of the schema, ended by
    itself (finish_reason stop), the same text gRPC gives for
    `json_schema`; json_object gives text that opens an object."""
    import jsonschema

    client = api.client()
    chat = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "Describe the colors."}]}]
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS, "strict": True}}
    whole = client.chat.completions.create(model=api.model, messages=chat, max_tokens=40, response_format=fmt)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice
    document = json.loads(choice.message.content or "")
    jsonschema.validate(document, COLORS)
    assert _streamed_text(api, messages=chat, max_tokens=40, response_format=fmt) == choice.message.content
    over_grpc = grpc_text(api.pair, [("user", [ImagePart(A), "Describe the colors."])], 40, json_schema=COLORS)
    assert over_grpc == choice.message.content
    loose = client.chat.completions.create(
        model=api.model, messages=chat, max_tokens=8, response_format={"type": "json_object"}
    )
    assert (loose.choices[0].message.content or "").startswith("{")
    _good_after(api)


def test_structured_outputs_regex_choice_and_grammar_constrain_the_answer(api: Api) -> None:
    """vLLM's structured_outputs through the openai SDK (extra_body): a
    regex the whole answer matches, a choice it is one of and a grammar
    (Lark) it is a sentence of, each ended by the model (finish_reason
    stop), streamed and not alike, the text gRPC gives for the contract's
    regex, choice and grammar; the older guided_grammar in GBNF; a regex or
    grammar that does not compile is a 400 naming structured_outputs."""
    client = api.client()
    chat = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "Code and color?"}]}]
    pattern, colors = "[A-Z]{2}-[0-9]{3}", ["red", "green", "light blue"]
    lark = 'start: "The " COLOR " one, " NUM "."\nCOLOR: "red" | "green"\nNUM: /[1-9][0-9]?/'
    sentence = re.compile(r"The (red|green) one, [1-9][0-9]?\.")
    for extra, check, grpc_field in (
        ({"regex": pattern}, lambda text: re.fullmatch(pattern, text), {"regex": pattern}),
        ({"choice": colors}, lambda text: text in colors, {"choice": colors}),
        ({"grammar": lark}, sentence.fullmatch, {"grammar": lark}),
    ):
        body = {"structured_outputs": extra}
        whole = client.chat.completions.create(model=api.model, messages=chat, max_tokens=40, extra_body=body)  # type: ignore[arg-type]
        text = whole.choices[0].message.content or ""
        assert whole.choices[0].finish_reason == "stop", whole
        assert check(text), text
        assert _streamed_text(api, messages=chat, max_tokens=40, extra_body=body) == text
        assert grpc_text(api.pair, [("user", [ImagePart(A), "Code and color?"])], 40, **grpc_field) == text
    gbnf = 'root ::= "Size " [0-9] [0-9]? " cm"'
    sized = client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=40,
        extra_body={"guided_grammar": gbnf},  # type: ignore[arg-type]
    )
    assert re.fullmatch(r"Size [0-9][0-9]? cm", sized.choices[0].message.content or ""), sized
    for wrong in ({"regex": "(open"}, {"grammar": "start: nowhere"}, {"grammar": "root ::= ("}):
        bad = _bad(api, _chat([{"type": "text", "text": "x"}], extra_body={"structured_outputs": wrong}))
        assert (bad.status_code, bad.body["param"]) == (400, "structured_outputs"), (wrong, bad)  # type: ignore[index]
    _good_after(api)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": COLORS,
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tool_choice_gives_tool_calls_and_a_conversation_carries_them_on(api: Api) -> None:
    """Through the openai SDK: a named function's call (arguments a
    document of its parameters, whole and streamed alike, the text gRPC
    gives for that json_schema); "required" gives a list of calls; the
    calls and a tool's result go back in the next turn, and the model
    answers; "auto" is refused saying why."""
    import jsonschema

    client = api.client()
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": [image_part(A), {"type": "text", "text": "What is the weather?"}]}
    ]
    whole = client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice=NAMED,  # type: ignore[arg-type,list-item]
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), COLORS)
    assert call.function.arguments == grpc_text(
        api.pair, [("user", [ImagePart(A), "What is the weather?"])], 40, json_schema=COLORS
    )
    pieces: dict[str, str] = {"arguments": "", "name": "", "id": ""}
    finish = None
    for chunk in client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice=NAMED,
        stream=True,  # type: ignore[arg-type,list-item]
    ):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta_call.index == 0
            pieces["id"] += delta_call.id or ""
            pieces["name"] += (delta_call.function.name or "") if delta_call.function else ""
            pieces["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert (pieces["name"], pieces["arguments"], finish) == ("get_weather", call.function.arguments, "tool_calls")
    assert pieces["id"].startswith("call_")

    # "required", one call at most (this random model would list calls until max_tokens).
    required = client.chat.completions.create(
        model=api.model, messages=chat, max_tokens=80, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
        parallel_tool_calls=False,
    )  # fmt: skip
    assert required.choices[0].finish_reason == "tool_calls", required
    (made,) = required.choices[0].message.tool_calls or []
    assert made.function.name == "get_weather"
    jsonschema.validate(json.loads(made.function.arguments), COLORS)

    # The next turn: the call and the tool's result go back; the model answers in text.
    chat += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and warm."},
    ]
    after = client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=4,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[arg-type,list-item]
    )
    assert after.choices[0].message.content
    assert after.choices[0].message.tool_calls is None
    assert after.usage is not None
    assert after.usage.prompt_tokens > whole.usage.prompt_tokens  # type: ignore[union-attr]
    refused = _bad(api, lambda c: c.chat.completions.create(model=api.model, messages=chat, tools=[WEATHER]))  # type: ignore[arg-type,list-item]
    assert (refused.status_code, refused.body["param"]) == (400, "tool_choice")  # type: ignore[index]
    assert "auto" in refused.message
    _good_after(api)


def test_the_conformance_kit_passes_our_http_api_and_fails_a_broken_one(api: Api, tmp_path: Path) -> None:
    import http.server
    import threading

    from mmsplit.conformance_http import HttpKit

    ours = HttpKit(api.url, KEY).all()
    assert {r.name: r.verdict for r in ours} == dict.fromkeys((r.name for r in ours), "PASS"), ours
    assert len(ours) == 11

    class Broken(http.server.BaseHTTPRequestHandler):
        def _plain(self) -> None:
            self.send_response(500)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"Internal Server Error")

        do_GET = do_POST = _plain  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        theirs = HttpKit(f"http://127.0.0.1:{server.server_address[1]}/v1", timeout_s=10).all()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert {r.verdict for r in theirs} == {"FAIL"}, theirs


_TEXT = re.compile(r'"content":"[^"]')  # a chunk with text (the role chunk's content is "")


def _sse(url: str, body: dict[str, Any], into: list[str] | None = None) -> list[str]:
    """A streamed response's lines, as they came (keep-alive comments
    included), appended to `into` one by one when given."""
    lines = [] if into is None else into
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            if line.strip():
                lines.append(line.decode().rstrip("\n"))
    return lines


def test_a_stream_keeps_the_connection_alive_and_ends_an_error_with_an_event(
    chat_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """While a slow image is preprocessed nothing is ready to send: comment
    lines keep the connection; and a scheduler that dies mid-stream ends it
    with one error event, then [DONE] (its own pair: this kills it)."""
    from tests.support.worker_hook import SLOW, marked

    http = FreePort()
    tokenizer = ["--http-port", http, "--http-keepalive-s", "0.2", "--worker-hook", "tests.support.worker_hook"]
    with running_pair(chat_models("llava"), tmp_path, scheduler_extra=["--tp", "1"], tokenizer_extra=tokenizer) as pair:
        url = f"http://127.0.0.1:{http.number}/v1/chat/completions"
        slow = {"type": "image_url", "image_url": {"url": data_url(marked(SLOW))}}
        lines = _sse(url, {"messages": [{"role": "user", "content": [slow]}], "max_tokens": 2, "stream": True})
        # The role chunk goes out at once; then, for the 1.5 s the worker
        # sleeps on this image, a comment every 0.2 s, all before the end.
        finish = next(i for i, line in enumerate(lines) if '"finish_reason":"' in line)
        assert lines[:finish].count(": keep-alive") >= 3, lines[:12]
        assert lines[-1] == "data: [DONE]"

        got: list[str] = []

        def read() -> None:
            body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 900, "stream": True,
                    "min_tokens": 900}  # fmt: skip
            _sse(url, body, into=got)

        import threading

        reader = threading.Thread(target=read)
        reader.start()
        # Killed once a token has streamed: an error before the stream's
        # first event would be an ordinary 503 response, not an event.
        assert wait_until(lambda: any(_TEXT.search(line) for line in list(got)), timeout=60), got[:5]
        pair.scheduler.proc.kill()
        reader.join(60)
    errors = [json.loads(line[6:]) for line in got if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1, got[-5:]
    assert errors[0]["error"]["code"] == "SCHEDULER_UNAVAILABLE"
    assert got[-1] == "data: [DONE]"
    assert any(_TEXT.search(line) for line in got), "nothing streamed before the error"


def test_a_max_tokens_beyond_the_context_ends_with_a_reason_that_says_so(api: Api) -> None:
    """Served up to the context, then FINISH_REASON_CONTEXT_LENGTH (the
    OpenAI API: "length"), the completion filling every position left."""
    request = build_request(messages=[("user", "Go on.")], max_tokens=3000, min_tokens=3000)
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        out = run_request(tokenizer_pb2_grpc.TokenizerServiceStub(channel), request, timeout=120)
    assert out.finish_reason == "FINISH_REASON_CONTEXT_LENGTH", out.finish_reason
    config = json.loads((api.pair.model / "config.json").read_text())
    context = config["text_config"]["max_position_embeddings"]
    prompt = len(hf_prompt_ids(api, [("user", "Go on.")]))
    assert len(out.token_ids) == context - prompt
    short = api.client().chat.completions.create(
        model=api.model, messages=[{"role": "user", "content": "Go on."}], max_tokens=2, extra_body={"min_tokens": 2}
    )
    assert short.choices[0].finish_reason == "length"


def hf_prompt_ids(api: Api, messages: list[tuple[str, str]]) -> list[int]:
    from tests.support import hf_family

    proc = hf_family.processor(api.pair.model)
    text = proc.apply_chat_template(
        [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    return hf_family.prompt_ids(proc, text, [])


# The conversation above as the Responses API takes it.
RESPONSES_INPUT: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                 {"type": "input_image", "image_url": data_url(A), "detail": "auto"}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "A picture."}]},
    {"role": "user", "content": [{"type": "input_image", "image_url": data_url(B)},
                                 {"type": "input_text", "text": "And this?"}]},
]  # fmt: skip


def test_the_responses_api_answers_as_chat_completions_do_whole_and_streamed(api: Api) -> None:
    """`client.responses.create` (the openai SDK): instructions and input
    items (text, images, an earlier assistant turn) give chat completions'
    text for the same conversation; max_output_tokens cuts it to an
    incomplete response; streamed, the typed events (created, the text's
    deltas, done, completed) carry the same text and usage."""
    client = api.client()
    chat = client.chat.completions.create(model=api.model, messages=CONVERSATION, max_tokens=8)
    text = chat.choices[0].message.content
    ask = {"model": api.model, "instructions": "You answer briefly.", "input": RESPONSES_INPUT, "max_output_tokens": 8}
    whole = client.responses.create(**ask)  # type: ignore[call-overload]
    assert whole.output_text == text
    assert whole.object == "response"
    assert whole.id.startswith("resp_")
    assert whole.usage is not None
    assert chat.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    cut = client.responses.create(**{**ask, "max_output_tokens": 2})  # type: ignore[call-overload]
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]
    events = list(client.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text  # type: ignore[union-attr]
    logged = {**ask, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    chat_lp = client.chat.completions.create(model=api.model, messages=CONVERSATION, max_tokens=8, logprobs=True,
                                             top_logprobs=2).choices[0].logprobs  # fmt: skip
    assert chat_lp is not None
    expected = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat_lp.content or []]
    part = client.responses.create(**logged).output[0].content[0]  # type: ignore[call-overload, union-attr]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs] == expected
    streamed_lp = [e for ev in client.responses.create(**logged, stream=True)  # type: ignore[call-overload]
                   if ev.type == "response.output_text.delta" for e in ev.logprobs]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed_lp] == [(t, lp) for t, lp, _ in expected]
    one = client.responses.create(model=api.model, input="Say something.", max_output_tokens=4)
    said = client.chat.completions.create(
        model=api.model, messages=[{"role": "user", "content": "Say something."}], max_tokens=4
    )
    assert one.output_text == said.choices[0].message.content


def test_the_responses_api_takes_structured_output_and_function_tools(api: Api) -> None:
    """text.format json_schema gives a document of the schema; a function
    tool named by tool_choice comes back as a function_call item (whole and
    streamed), and a conversation carries the call and its output on; what
    needs stored state or hosted tools is a 400 naming the field, a bad
    part names its input item, and a stored response is 404."""
    client = api.client()
    base = {"model": api.model, "input": RESPONSES_INPUT, "max_output_tokens": 40}
    shaped = client.responses.create(
        **base, text={"format": {"type": "json_schema", "name": "colors", "schema": COLORS, "strict": True}}
    )  # type: ignore[call-overload]
    assert set(json.loads(shaped.output_text)) == {"color", "bright"}
    tool = {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": COLORS}
    called = client.responses.create(**base, tools=[tool], tool_choice={"type": "function", "name": "get_weather"})  # type: ignore[call-overload]
    (call,) = called.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")  # type: ignore[union-attr]
    assert set(json.loads(call.arguments)) == {"color", "bright"}  # type: ignore[union-attr]
    streamed = list(
        client.responses.create(**base, tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                                stream=True)  # type: ignore[call-overload]
    )  # fmt: skip
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(d.type, d.arguments) for d in done] == [("function_call", call.arguments)]  # type: ignore[union-attr]
    # A named function's arguments stream as they are generated, under the id the call ends with.
    pieces = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    added = [e.item for e in streamed if e.type == "response.output_item.added"]
    assert len(pieces) > 1
    assert "".join(e.delta for e in pieces) == call.arguments  # type: ignore[union-attr]
    assert {e.item_id for e in pieces} == {added[0].id} == {done[0].id}  # type: ignore[union-attr]
    answered = [
        *RESPONSES_INPUT,
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},  # type: ignore[union-attr]
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},  # type: ignore[union-attr]
    ]
    after = client.responses.create(model=api.model, input=answered, tools=[tool], tool_choice="none",
                                    max_output_tokens=4)  # type: ignore[call-overload]  # fmt: skip
    assert after.status in ("completed", "incomplete")
    assert after.output[0].type == "message"
    for extra, param in (
        ({"previous_response_id": 7}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": "yes"}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [RESPONSES_INPUT[0], {"role": "user", "content": [{"type": "input_text", "text": "</s>"}]}]},
         "input[1].content[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{**base, **extra})  # type: ignore[call-overload]
        assert info.value.body["param"] == param, (extra, info.value.body)  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    _good_after(api)


def _post_json(url: str, body: dict[str, Any], key: str = KEY) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON with the API key: the status and the JSON answer, an error's too."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_and_detokenize_give_the_ids_generation_uses(api: Api) -> None:
    """vLLM's /tokenize: a conversation with images counts the prompt
    tokens chat completions reports for it (each image's placeholders as
    its processor makes them), a prompt what completions reports;
    max_model_len is the context /v1/models states; /detokenize gives the
    text back; both need the API key, and bad input is a typed 400."""
    base = api.url.removesuffix("/v1")

    def post(path: str, body: dict[str, Any], key: str = KEY) -> tuple[int, dict[str, Any]]:
        return _post_json(base + path, body, key)

    client = api.client()
    chat = client.chat.completions.create(model=api.model, messages=CONVERSATION, max_tokens=1)
    status, counted = post("/tokenize", {"model": api.model, "messages": CONVERSATION, "return_token_strs": True})
    assert status == 200, counted
    assert chat.usage is not None
    assert counted["count"] == len(counted["tokens"]) == len(counted["token_strs"]) == chat.usage.prompt_tokens
    card = client.models.retrieve(api.model).model_dump()
    assert counted["max_model_len"] == card["max_model_len"] > 0
    plain = client.completions.create(model=api.model, prompt="Hello there, friend.", max_tokens=1)
    status, ids = post("/tokenize", {"prompt": "Hello there, friend."})
    assert plain.usage is not None
    assert (status, ids["count"], ids["token_strs"]) == (200, plain.usage.prompt_tokens, None)
    status, text = post("/detokenize", {"model": api.model, "tokens": ids["tokens"]})
    assert status == 200
    assert "Hello there, friend." in text["prompt"], text
    # A prompt as completions read it: as written (no chat template), with
    # the tokenizer's own special tokens; and as lm-evaluation-harness's
    # remote tokenizer asks, without them.
    tokenizer = hf_loaded.tokenizer(api.pair.model)
    assert ids["tokens"] == tokenizer("Hello there, friend.")["input_ids"]
    status, raw = post("/tokenize", {"prompt": "Hello there, friend.", "add_special_tokens": False})
    assert status == 200
    assert raw["tokens"] == tokenizer("Hello there, friend.", add_special_tokens=False)["input_ids"]
    info = json.loads(urllib.request.urlopen(urllib.request.Request(
        base + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}), timeout=30).read())  # fmt: skip
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert "{%" in (info["chat_template"] or "")
    assert info["model_max_length"] == card["max_model_len"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(base + "/tokenizer_info", timeout=30)
    assert refused.value.code == 401
    for path, body, code, param in (
        ("/tokenize", {"prompt": "x"}, 401, None),
        ("/tokenize", {"prompt": "x", "messages": CONVERSATION}, 400, "prompt"),
        ("/tokenize", {"messages": CONVERSATION, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": [1, 2], "add_special_tokens": False}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": [image_part(b"not an image")]}]}, 400,
         "messages[0].content[0]"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ):  # fmt: skip
        status, body = post(path, body, key="wrong" if code == 401 else KEY)
        assert (status, body["error"]["param"]) == (code, param), (path, body)
    _good_after(api)


def test_the_lesser_routes_refuse_what_they_cannot_answer_with_typed_errors(api: Api) -> None:
    """/tokenize, /detokenize and the Responses API's own routes, asked
    for another model, a prompt over --max-prompt-chars, a cache_salt over
    256 characters, a page of input
    items in an order or size they do not have or after an item they do
    not hold, or a response that is not stored: each a 4xx that names
    what was wrong, through the official SDK where it has the call."""
    base = api.url.removesuffix("/v1")
    for path, body, code, param in (
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"prompt": "x" * 100_001}, 400, "prompt"),
    ):  # fmt: skip
        status, answer = _post_json(base + path, body)
        assert (status, answer["error"]["param"]) == (code, param), (path, answer)
    client = api.client(max_retries=0)
    hi: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as salted:
        client.chat.completions.create(model=api.model, messages=hi, max_tokens=2, extra_body={"cache_salt": "s" * 257})
    assert salted.value.body["param"] == "cache_salt", salted.value.body  # type: ignore[index]
    client.chat.completions.create(model=api.model, messages=hi, max_tokens=2, extra_body={"cache_salt": "s" * 256})
    with pytest.raises(openai.NotFoundError) as other:
        client.responses.create(model="other", input="Hi", max_output_tokens=2)
    assert "other" in other.value.message
    stored = client.responses.create(model=api.model, input="Hi", max_output_tokens=2)
    assert len(client.responses.input_items.list(stored.id).data) == 1
    for query, param in (({"order": "sideways"}, "order"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                         ({"after": "msg_nope"}, "after")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.input_items.list(stored.id, **query)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param, (query, refused.value.body)  # type: ignore[index]
    client.responses.delete(stored.id)
    for gone in (lambda: client.responses.delete(stored.id), lambda: client.responses.input_items.list(stored.id)):
        with pytest.raises(openai.NotFoundError, match="no response"):
            gone()
    _good_after(api)


def test_the_sdk_s_structured_output_helpers_parse_our_answers(api: Api) -> None:
    """The openai SDK's `chat.completions.parse` and `responses.parse` with
    a pydantic model (what they send: a strict json_schema; what they read:
    the answer as that model)."""
    from typing import Literal

    import pydantic

    class Colors(pydantic.BaseModel):
        color: Literal["red", "green", "blue"]
        bright: bool

    client = api.client()
    messages = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "Its color?"}]}]
    chat = client.chat.completions.parse(model=api.model, messages=messages, max_tokens=40, response_format=Colors)  # type: ignore[arg-type]
    parsed = chat.choices[0].message.parsed
    assert isinstance(parsed, Colors), chat
    response = client.responses.parse(
        model=api.model, input=RESPONSES_INPUT[:1], max_output_tokens=40, text_format=Colors
    )  # type: ignore[arg-type]
    assert isinstance(response.output_parsed, Colors), response
    # The streaming helpers, which build the object from the events (their order and ids checked as they go).
    with client.responses.stream(model=api.model, input=RESPONSES_INPUT[:1], max_output_tokens=40,
                                 text_format=Colors) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Colors), final
    tool = {"type": "function", "name": "get_weather", "parameters": COLORS, "strict": True}
    with client.responses.stream(model=api.model, input=RESPONSES_INPUT[:1], max_output_tokens=40, tools=[tool],  # type: ignore[list-item]
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:  # fmt: skip
        called = stream.get_final_response()
    assert [(item.type, json.loads(item.arguments).keys()) for item in called.output] == [  # type: ignore[union-attr]
        ("function_call", {"color", "bright"})
    ]
    with client.chat.completions.stream(model=api.model, messages=messages, max_tokens=40,  # type: ignore[arg-type]
                                        response_format=Colors) as chat_stream:  # fmt: skip
        completion = chat_stream.get_final_completion()
    assert isinstance(completion.choices[0].message.parsed, Colors), completion


def test_a_client_s_request_id_names_the_request(api: Api) -> None:
    """X-Request-Id (the openai SDK's extra_headers) comes back in
    x-request-id and the object's id, streamed or not; one over 128
    characters is a 400 naming the header. vLLM's request_id in the body
    does the same where no header is given."""
    client = api.client()
    chat = [{"role": "user", "content": "Hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=api.model, messages=chat, max_tokens=2, extra_headers={"X-Request-Id": "trace-7f3a"}
    )  # type: ignore[arg-type]
    assert raw.headers["x-request-id"] == "trace-7f3a"
    assert raw.parse().id == "chatcmpl-trace-7f3a"
    streamed = client.responses.create(model=api.model, input="Hi", max_output_tokens=2, stream=True,
                                       extra_headers={"X-Request-Id": "trace-7f3b"})  # fmt: skip
    assert [e.response.id for e in streamed if e.type.startswith("response.") and hasattr(e, "response")][
        -1
    ] == "resp_trace-7f3b"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=api.model, messages=chat, extra_headers={"X-Request-Id": "x" * 129})  # type: ignore[arg-type]
    assert info.value.body["param"] == "X-Request-Id"  # type: ignore[index]
    # vLLM's request_id in the body names it where no header does; the header wins.
    named = client.completions.with_raw_response.create(
        model=api.model,
        prompt="Hi",
        max_tokens=2,
        extra_body={"request_id": "job-12"},  # type: ignore[arg-type]
    )
    assert (named.headers["x-request-id"], named.parse().id) == ("job-12", "cmpl-job-12")
    both = client.chat.completions.create(
        model=api.model, messages=chat, max_tokens=2, extra_headers={"X-Request-Id": "hdr-1"},  # type: ignore[arg-type]
        extra_body={"request_id": "body-1"},
    )  # fmt: skip
    assert both.id == "chatcmpl-hdr-1"
    for bad in (7, "x" * 129):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=api.model, messages=chat, extra_body={"request_id": bad})  # type: ignore[arg-type]
        assert info.value.body["param"] == "request_id"  # type: ignore[index]


def _prompt_scores(model_dir: Path, ids: list[int]) -> Any:
    """log_softmax of the model's logits over `ids`, one forward in this process: ``[len(ids), vocab]``."""
    import torch

    model = hf_loaded.model(model_dir)
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def test_a_prompt_is_scored_as_lm_evaluation_harness_asks_with_echo_and_logprobs(api: Api) -> None:
    """lm-evaluation-harness's loglikelihood request (local-completions:
    token-id prompts in a batch, max_tokens 1, temperature 0, logprobs 1,
    echo): each choice's token_logprobs are the prompt's, the first null,
    then the generated token's, each the model's own log_softmax; its
    top_logprobs the most likely token; its text the prompt and the token.
    vLLM's prompt_logprobs give the same numbers with each token's rank,
    and over gRPC (prompt_token_ids, SamplingParams.prompt_logprobs) every
    choice gets them before its first token."""
    from mmsplit.tokenizer.v1 import tokenizer_pb2

    client = api.client()
    tokenizer = hf_loaded.tokenizer(api.pair.model)
    prompts = [[1, 415, 2936, 9060, 285], [1, 9060, 415, 2936, 28705, 17]]
    reply = client.completions.create(
        model=api.model, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    scored: list[list[float]] = []
    for choice, ids in zip(sorted(reply.choices, key=lambda c: c.index), prompts, strict=True):
        lp = choice.logprobs
        assert lp is not None
        assert lp.token_logprobs is not None
        assert lp.top_logprobs is not None
        assert lp.tokens
        assert len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        expected = _prompt_scores(api.pair.model, ids)
        for k in range(1, len(ids)):
            assert lp.token_logprobs[k] == pytest.approx(float(expected[k - 1, ids[k]]), abs=1e-4), k
            (best,) = lp.top_logprobs[k].values()
            assert best == pytest.approx(float(expected[k - 1].max()), abs=1e-4)
        # The generated token: greedy, the last position's most likely.
        assert lp.token_logprobs[-1] == pytest.approx(float(expected[-1].max()), abs=1e-4)
        assert choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=True))
        assert lp.tokens[:-1] == [token_text(tokenizer, t) for t in ids]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
        scored.append(lp.token_logprobs[1:-1])
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)

    raw = client.completions.create(model=api.model, prompt=prompts[0], max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = raw.model_dump()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    assert len(entries) == len(prompts[0])
    expected = _prompt_scores(api.pair.model, prompts[0])
    for k, entry in enumerate(entries[1:], 1):
        token = entry[str(prompts[0][k])]
        assert token["logprob"] == pytest.approx(scored[0][k - 1], abs=1e-6)
        assert token["rank"] == int((expected[k - 1] > expected[k - 1, prompts[0][k]]).sum()) + 1
        ranks = sorted(v["rank"] for key, v in entry.items() if key != str(prompts[0][k]))
        assert ranks == [r for r in (1, 2) if r != token["rank"]]

    request = tokenizer_pb2.GenerateRequest(prompt_token_ids=prompts[1], n=2)
    request.sampling.max_tokens, request.sampling.prompt_logprobs = 2, 0
    events: list[tuple[int, str]] = []
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=60):
            kind = event.WhichOneof("event")
            events.append((event.index, kind))
            if kind == "prompt_logprobs":
                assert list(event.prompt_logprobs.token_ids) == prompts[1]
                got = [lp.logprob for lp in event.prompt_logprobs.logprobs]
                assert got == pytest.approx(scored[1], abs=1e-6)
    for i in (0, 1):
        mine = [kind for index, kind in events if index == i]
        assert mine[0] == "prompt_logprobs"
        assert mine.count("prompt_logprobs") == 1
        assert mine[-1] == "finished"


def test_echo_with_max_tokens_0_answers_the_prompt_alone_scored(api: Api) -> None:
    """OpenAI's and vLLM's way to score a text: echo with max_tokens 0
    answers each prompt alone, its log probabilities those of the same
    request with max_tokens 1 less the generated token's, finish_reason
    "length", no completion tokens; streamed alike. max_tokens 0 without
    echo (or on chat), or with min_tokens, is a 400 naming the field."""
    client = api.client()
    tokenizer = hf_loaded.tokenizer(api.pair.model)
    prompts = [[1, 415, 2936, 9060, 285], [1, 9060, 415, 2936, 28705, 17]]
    asked: dict[str, Any] = {"model": api.model, "prompt": prompts, "temperature": 0, "logprobs": 1, "echo": True}
    alone = client.completions.create(max_tokens=0, **asked)
    with_one = client.completions.create(max_tokens=1, **asked)
    pairs = zip(*(sorted(r.choices, key=lambda c: c.index) for r in (alone, with_one)), prompts, strict=True)
    for choice, other, ids in pairs:
        assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.finish_reason == "length"
        lp, lp1 = choice.logprobs, other.logprobs
        assert lp is not None
        assert lp1 is not None
        assert lp.tokens == lp1.tokens[:-1] == [token_text(tokenizer, t) for t in ids]  # type: ignore[index]
        assert lp.token_logprobs == pytest.approx(lp1.token_logprobs[:-1], abs=1e-6)  # type: ignore[index]
        assert lp.top_logprobs == lp1.top_logprobs[:-1]  # type: ignore[index]
    assert alone.usage is not None
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (sum(map(len, prompts)), 0)

    text = client.completions.create(model=api.model, prompt="The quick brown", max_tokens=0, echo=True, n=2)
    assert [c.text for c in text.choices] == ["The quick brown"] * 2
    chunks = list(client.completions.create(
        model=api.model, prompt="The quick brown", max_tokens=0, echo=True, logprobs=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The quick brown"
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert tokens == [token_text(tokenizer, t) for t in tokenizer("The quick brown").input_ids]
    assert tokens[-3:] == [" The", " quick", " brown"]  # each word's token named with its space
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 0

    for call, param in (
        (lambda c: c.completions.create(model=api.model, prompt="Hi", max_tokens=0), "max_tokens"),
        (lambda c: c.completions.create(model=api.model, prompt="Hi", max_tokens=0, echo=True,
                                        extra_body={"min_tokens": 1}), "min_tokens"),
        (lambda c: c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=0), "max_tokens"),
    ):  # fmt: skip
        refused = _bad(api, call)
        assert (refused.status_code, refused.body["param"]) == (400, param)  # type: ignore[index]


def test_echo_streams_the_prompt_first_and_chat_reports_prompt_logprobs(api: Api) -> None:
    """A streamed echo's text is the prompt and then the output, as the
    whole answer's; text offsets run on across chunks; a chat request's
    prompt_logprobs are one entry per prompt token (the first null)."""
    client = api.client()
    whole = client.completions.create(model=api.model, prompt="The quick brown", max_tokens=4, echo=True)
    plain = client.completions.create(model=api.model, prompt="The quick brown", max_tokens=4)
    assert whole.choices[0].text == "The quick brown" + plain.choices[0].text
    chunks = list(client.completions.create(
        model=api.model, prompt="The quick brown", max_tokens=4, echo=True, logprobs=0, stream=True
    ))  # fmt: skip
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert texts[0].startswith("The quick brown")
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for lp in logprobs for t in lp.tokens or []]
    offsets = [o for lp in logprobs for o in lp.text_offset or []]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]  # on across chunks
    assert len(tokens) > 4  # the prompt's, then the output's
    assert logprobs[0].token_logprobs[0] is None

    by_choice: dict[int, str] = {}
    for chunk in client.completions.create(
        model=api.model, prompt=["The quick", "A brown"], n=2, max_tokens=3, echo=True, stream=True, seed=3
    ):
        for c in chunk.choices:
            by_choice[c.index] = by_choice.get(c.index, "") + c.text
    assert sorted(by_choice) == [0, 1, 2, 3]
    assert all(by_choice[i].startswith(["The quick", "A brown"][i // 2]) for i in range(4))

    one = client.completions.create(model=api.model, prompt=[1], max_tokens=1, echo=True, logprobs=0)
    assert one.choices[0].logprobs is not None
    assert one.choices[0].logprobs.token_logprobs is not None
    assert one.choices[0].logprobs.token_logprobs[0] is None  # a prompt of one token: its entry, then the output's
    assert len(one.choices[0].logprobs.token_logprobs) == 2

    chat = client.chat.completions.create(
        model=api.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    entries = chat.model_dump()["prompt_logprobs"]
    assert chat.usage is not None
    assert len(entries) == chat.usage.prompt_tokens
    assert entries[0] is None
    assert all(isinstance(e, dict) and 1 <= len(e) <= 2 for e in entries[1:])


def test_token_prompts_and_prompt_logprobs_refusals_are_typed(api: Api) -> None:
    """Ids outside the vocabulary or naming an image placeholder, and
    prompt_logprobs streamed or over 20: a 400 naming the field, and the
    next request is served."""
    client = api.client(max_retries=0)
    image_id = 32000  # the tiny LLaVA's <image>
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"prompt": [1, 10**6]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1, image_id, 415]}, "prompt", "placeholder"),
        ({"prompt": "x", "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs", "within"),
        ({"prompt": "x", "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", "stream"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=api.model, max_tokens=2, **kwargs)
        body = info.value.body if isinstance(info.value.body, dict) else {}
        assert (body.get("code"), body.get("param")) == ("INVALID_REQUEST", param), body
        assert words in body.get("message", ""), body
        _good_after(api)


def test_stored_responses_carry_a_conversation_on_and_belong_to_their_key(api: Api) -> None:
    """`store` (the default) keeps a response: `previous_response_id` continues
    its conversation (images, the answer's text and a function call
    included) as if the client had sent it all (the same text and input
    tokens as chat completions over the whole conversation; the earlier
    instructions not carried over); GET gives it back, streamed ones too,
    DELETE lets it go (then 404); `store: false` keeps nothing; another API
    key finds nothing; an unknown id is a 404 naming previous_response_id."""
    client = api.client()
    first = client.responses.create(model=api.model, instructions="Be brief.", input=RESPONSES_INPUT,
                                    max_output_tokens=6)  # type: ignore[call-overload]  # fmt: skip
    assert first.store is True
    then = [{"role": "user", "content": "Say more."}]
    second = client.responses.create(model=api.model, previous_response_id=first.id, input=then,
                                     max_output_tokens=6)  # type: ignore[call-overload]  # fmt: skip
    assert second.previous_response_id == first.id
    whole = [*CONVERSATION[1:], {"role": "assistant", "content": first.output_text}, *then]
    chat = client.chat.completions.create(model=api.model, messages=whole, max_tokens=6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None
    assert chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # The items that made `second`: the first request's input and answer, then its own (newest first by default).
    listed = client.responses.input_items.list(second.id)
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
                     ("message", "user")]  # fmt: skip
    oldest = list(client.responses.input_items.list(second.id, order="asc", limit=2))  # the SDK pages on
    assert [item.id for item in oldest] == [item.id for item in reversed(listed.data)]
    assert oldest[0].content[1].type == "input_image"  # type: ignore[union-attr]
    metrics = urllib.request.urlopen(api.metrics, timeout=10).read().decode()
    stored = [line for line in metrics.splitlines() if line.startswith("mmsplit_tokenizer_stored_responses ")]
    assert float(stored[0].split()[1]) >= 2, stored

    # A function call carried on: the call in the stored output, its result in the next input.
    function = {"name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
    tool: Any = {"type": "function", **function}
    named: Any = {"type": "function", "name": "get_weather"}
    called = client.responses.create(
        model=api.model, input="Weather in Oslo?", tools=[tool], tool_choice=named, max_output_tokens=24
    )
    call: Any = called.output[-1]
    assert call.type == "function_call"
    result: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after = client.responses.create(
        model=api.model, previous_response_id=called.id, input=result, tools=[tool], tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip
    asked = {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
    carried: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [asked]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    same = client.chat.completions.create(
        model=api.model, messages=carried, max_tokens=4, tools=[{"type": "function", "function": function}],
        tool_choice="none",
    )  # fmt: skip
    assert after.output_text == same.choices[0].message.content
    assert after.usage is not None
    assert same.usage is not None
    assert after.usage.input_tokens == same.usage.prompt_tokens

    streamed = list(client.responses.create(model=api.model, input="Hello", max_output_tokens=3, stream=True))  # type: ignore[call-overload]
    final = streamed[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == final.output_text

    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model=api.model, previous_response_id=first.id, input="x")):  # type: ignore[call-overload]  # fmt: skip
        with pytest.raises(openai.NotFoundError) as info:
            gone()
        assert info.value.body["param"] in ("id", "previous_response_id")  # type: ignore[index]
    unstored = client.responses.create(model=api.model, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    # Another tenant's key reads nothing of this one's (the key file is read again as it changes).
    key_file = api.key_file
    key_file.write_text(KEY + "\nsk-other-tenant-000000\n")
    try:
        other = openai.OpenAI(base_url=api.url, api_key="sk-other-tenant-000000")
        assert wait_until(lambda: other.models.list() is not None, timeout=10)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=api.model, previous_response_id=second.id, input="x")  # type: ignore[call-overload]
        assert client.responses.retrieve(second.id).id == second.id
    finally:
        key_file.write_text(KEY + "\n")
    _good_after(api)


def test_grpc_tool_choice_gives_the_calls_chat_completions_gives(api: Api) -> None:
    """The contract's tool_choice (mmsplit.client's build_request): a named
    function and "required" (one call) give, in Finished.tool_calls, the
    calls chat completions gives for the same conversation (names and
    arguments), while the deltas stream the model's text as it is; without
    tool_choice the tools only reach the template, as before; "auto" without
    a --tool-call-parser, tool_choice without tools or with a prompt, and a
    function that is not among the tools are INVALID_REQUEST naming it."""
    from mmsplit.client import Tool

    client = api.client()
    tool = Tool("get_weather", "The weather in a city.", COLORS)
    grpc_turn = [("user", [ImagePart(A), "What is the weather?"])]
    http_turn = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is the weather?"}]}]

    def over_grpc(**choice: Any) -> tuple[str, list[Any]]:
        request = build_request(messages=grpc_turn, tools=[tool], max_tokens=80, **choice)
        text, finished = "", None
        with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
            for event in tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=60):
                text += event.delta.text
                finished = event.finished if event.HasField("finished") else finished
        assert finished is not None
        return text, [(c.name, c.arguments, c.id) for c in finished.tool_calls]

    for grpc_choice, http_choice in (
        ({"call_tool": "get_weather"}, {"tool_choice": NAMED}),
        ({"tool_choice": "required", "single_call": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ):
        text, calls = over_grpc(**grpc_choice)
        reply = client.chat.completions.create(model=api.model, messages=http_turn, max_tokens=80,  # type: ignore[arg-type]
                                               tools=[WEATHER], **http_choice)  # type: ignore[list-item]  # fmt: skip
        expected = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
        assert expected, reply
        assert [(name, arguments) for name, arguments, _ in calls] == expected, grpc_choice
        assert all(call_id.startswith("call_") for _, _, call_id in calls)
        assert text  # the model's text as generated: the arguments, or the list of calls
    text, calls = over_grpc()
    assert calls == []

    def refused(request: Any) -> str:
        with grpc.insecure_channel(api.pair.tokenizer_address) as channel, pytest.raises(grpc.RpcError) as info:
            list(tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        return str(info.value.details())

    assert "--tool-call-parser" in refused(build_request(messages=grpc_turn, tools=[tool], tool_choice="auto"))
    assert "needs tools" in refused(build_request(messages=grpc_turn, tool_choice="required"))
    assert "not among the tools" in refused(build_request(messages=grpc_turn, tools=[tool], call_tool="nope"))
    assert "tool_choice go with a conversation" in refused(build_request("Hi", tool_choice="required"))
    _good_after(api)


def test_return_token_ids_gives_the_ids_the_model_read_and_made(api: Api) -> None:
    """vLLM's `return_token_ids`: chat's answer has the prompt's ids (those
    /tokenize and gRPC's Tokenize give) and each choice's generated ids
    (gRPC's, for the same greedy request); streamed, the prompt's ids come
    in each choice's first chunk (the role's) and the chunks' ids add up to
    the whole; completions have both per choice, each of its own prompt.
    Without it the objects are as before; a value that is not a boolean is a
    400 naming it."""
    from mmsplit.client import Client

    client, tokenizer = api.client(), hf_loaded.tokenizer(api.pair.model)
    asked = {"return_token_ids": True}
    prompts = ["Once upon a time", "The capital of France is"]
    with Client(api.pair.tokenizer_address) as grpc_client:
        prompt_ids = grpc_client.tokenize(messages=SAME_OVER_GRPC).ids
        done = grpc_client.complete(messages=SAME_OVER_GRPC, max_tokens=6, return_prompt_token_ids=True)
        read = [grpc_client.tokenize(p, prompt_as_written=True).ids for p in prompts]  # as completions read one
    assert done.prompt_token_ids == prompt_ids
    whole = client.chat.completions.create(
        model=api.model,
        messages=CONVERSATION,
        max_tokens=6,
        extra_body=asked,  # type: ignore[arg-type]
    ).model_dump()
    assert whole["prompt_token_ids"] == prompt_ids
    choice = whole["choices"][0]
    assert choice["token_ids"] == done.token_ids
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]

    chunks = [c.model_dump() for c in client.chat.completions.create(
        model=api.model, messages=CONVERSATION, max_tokens=6, stream=True, n=2, extra_body=asked,  # type: ignore[arg-type]
    )]  # fmt: skip
    for i in range(2):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine[1:] for t in c["choices"][0]["token_ids"]] == done.token_ids  # greedy: each choice

    completion = client.completions.create(
        model=api.model,
        prompt=prompts,
        max_tokens=4,
        n=2,
        extra_body=asked,  # type: ignore[arg-type]
    ).model_dump()
    for k, c in enumerate(completion["choices"]):
        assert c["prompt_token_ids"] == read[k // 2]
        assert len(c["token_ids"]) == 4
    streamed = [c.model_dump() for c in client.completions.create(
        model=api.model, prompt=prompts[0], max_tokens=4, stream=True, extra_body=asked,  # type: ignore[arg-type]
    )]  # fmt: skip
    assert streamed[0]["choices"][0]["prompt_token_ids"] == completion["choices"][0]["prompt_token_ids"]
    assert [t for c in streamed[1:] for t in c["choices"][0]["token_ids"]] == completion["choices"][0]["token_ids"]

    plain = client.chat.completions.create(model=api.model, messages=CONVERSATION, max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain
    assert "token_ids" not in plain["choices"][0]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=api.model,
            messages=CONVERSATION,
            max_tokens=2,
            extra_body={"return_token_ids": "yes"},  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "return_token_ids"  # type: ignore[index]


def test_skip_special_tokens_false_keeps_them_in_the_text(api: Api) -> None:
    """A model made to write its end-of-sequence token (biased to it, with
    ignore_eos so it goes on): left out of the text by default, kept with
    vLLM's skip_special_tokens false, whole and streamed, chat and
    completions, with no space between them (vLLM's
    spaces_between_special_tokens is taken and changes nothing); the same
    over gRPC (keep_special_tokens); ids the same."""
    from mmsplit.client import Client

    tokenizer = hf_loaded.tokenizer(api.pair.model)
    eos = tokenizer.eos_token_id
    forced = {"ignore_eos": True, "logit_bias": {str(eos): 100}, "return_token_ids": True}
    client = api.client()
    messages = [{"role": "user", "content": "Say nothing."}]
    kept = tokenizer.eos_token * 3  # one after the other, whatever spaces_between_special_tokens says
    for extra, expected in (
        ({}, ""),
        ({"skip_special_tokens": False}, kept),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, kept),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": True}, kept),
    ):
        body: dict[str, Any] = {**forced, **extra}
        chat = client.chat.completions.create(
            model=api.model,
            messages=messages,
            max_tokens=3,
            extra_body=body,  # type: ignore[arg-type]
        ).model_dump()
        assert chat["choices"][0]["token_ids"] == [eos] * 3
        assert chat["choices"][0]["message"]["content"] == expected, extra
        streamed = client.completions.create(
            model=api.model,
            prompt="Say nothing.",
            max_tokens=3,
            stream=True,
            extra_body=body,  # type: ignore[arg-type]
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected, extra
    with Client(api.pair.tokenizer_address) as grpc_client:
        request = build_request("Say nothing.", max_tokens=3, ignore_eos=True, logit_bias={eos: 100})
        request.keep_special_tokens = True
        out = [e.text for e in grpc_client.send(request)]
    assert "".join(out) == tokenizer.eos_token * 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=api.model,
            messages=messages,
            max_tokens=1,
            extra_body={"skip_special_tokens": 0},  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "skip_special_tokens"  # type: ignore[index]


def _with_ids(api: Api, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy chat answer to CONVERSATION, with return_token_ids and `extra` in extra_body."""
    return (
        api.client()
        .chat.completions.create(  # type: ignore[no-any-return]
            model=api.model,
            messages=CONVERSATION,
            max_tokens=max_tokens,
            extra_body={"return_token_ids": True, **extra},  # type: ignore[arg-type]
        )
        .model_dump()
    )


def test_allowed_token_ids_and_bad_words_keep_what_they_ban_out_of_the_answer(api: Api) -> None:
    """vLLM's two extensions over the openai SDK (extra_body), greedy:
    with allowed_token_ids every generated id is one of them, and the
    first is the plain answer's when that one is listed; with bad_words
    the plain answer is kept up to where a banned word would come, never
    that word: a one-token word never, a two-token word's second token
    never right after its first. Refused, naming the field: an id outside
    the vocabulary, a request left with nothing to draw (its only allowed
    token is EOS, before min_tokens), and a priority other than 0 where
    the scheduler admits first come first served; the next request is
    served, with priority 0 too."""
    from tokenizer_svc.bad_words import token_sequences

    tokenizer = hf_loaded.tokenizer(api.pair.model)

    def ids(**extra: Any) -> list[int]:
        return _with_ids(api, 24, **extra)["choices"][0]["token_ids"]  # type: ignore[no-any-return]

    plain = ids()
    allowed = sorted({plain[0], plain[2], 100, 200, 300})
    constrained = ids(allowed_token_ids=allowed)
    assert set(constrained) <= set(allowed)
    assert constrained[0] == plain[0]
    assert constrained != plain[: len(constrained)]
    # top_logprobs lists as many as asked: past the allowed ids, tokens that
    # could not be drawn, at OpenAI's -9999.0 (JSON has no -inf).
    scored = _with_ids(api, 3, allowed_token_ids=allowed, logprobs=True, top_logprobs=len(allowed) + 2)
    for entry in scored["choices"][0]["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == len(allowed) + 2
        assert all(v > -9999.0 for v in tops[: len(allowed)]), tops
        assert tops[len(allowed) :] == [-9999.0, -9999.0], tops

    def word(tokens: list[int]) -> str | None:
        """The text of `tokens`, where it is a bad word whose one sequence is exactly them."""
        text = tokenizer.decode(tokens).strip()
        return text if text and token_sequences(tokenizer, [text]) == [tuple(tokens)] else None

    one = next(i for i in range(1, len(plain)) if word(plain[i : i + 1]) and plain[i] not in plain[:i])
    banned = ids(bad_words=[word(plain[one : one + 1])])
    assert banned[:one] == plain[:one]
    assert plain[one] not in banned
    two = next(i for i in range(1, len(plain) - 1) if word(plain[i : i + 2]) and plain[i] not in plain[:i])
    split = ids(bad_words=[word(plain[two : two + 2])])
    assert split[: two + 1] == plain[: two + 1]
    assert all((a, b) != (plain[two], plain[two + 1]) for a, b in itertools.pairwise(split))

    eos = hf_loaded.model(api.pair.model).config.text_config.eos_token_id
    for extra, param in (
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": [eos], "min_tokens": 2}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"priority": 5}, "priority"),  # this scheduler runs --scheduling-policy fcfs (the default)
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            ids(**extra)
        assert refused.value.body["param"] == param, (extra, refused.value.body)  # type: ignore[index]
    assert ids() == plain
    assert ids(priority=0) == plain


def test_return_tokens_as_token_ids_names_logprob_tokens_by_their_ids(api: Api) -> None:
    """vLLM's return_tokens_as_token_ids: with logprobs, each token (and
    each top alternative) is named "token_id:<id>", the ids those of
    return_token_ids, in chat (whole and streamed) and in completions'
    legacy form; the log probabilities are the same as without it."""
    client = api.client()
    asked = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(
        model=api.model, messages=CONVERSATION, max_tokens=5, logprobs=True, top_logprobs=3, extra_body=asked,  # type: ignore[arg-type]
    ).model_dump()  # fmt: skip
    plain = client.chat.completions.create(
        model=api.model, messages=CONVERSATION, max_tokens=5, logprobs=True, top_logprobs=3
    ).model_dump()
    entries, ids = chat["choices"][0]["logprobs"]["content"], chat["choices"][0]["token_ids"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    assert all(re.fullmatch(r"token_id:\d+", top["token"]) for e in entries for top in e["top_logprobs"])
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in plain["choices"][0]["logprobs"]["content"]]
    assert entries[0]["top_logprobs"][0]["token"] == f"token_id:{ids[0]}"  # greedy: the first is the likeliest
    streamed = [c.model_dump() for c in client.chat.completions.create(
        model=api.model, messages=CONVERSATION, max_tokens=5, logprobs=True, stream=True, extra_body=asked,  # type: ignore[arg-type]
    )]  # fmt: skip
    logprobs = [c["choices"][0]["logprobs"] for c in streamed if c["choices"]]
    names = [e["token"] for lp in logprobs if lp for e in lp["content"]]
    assert names == [f"token_id:{t}" for t in ids]
    legacy = client.completions.create(
        model=api.model,
        prompt="Once upon a time",
        max_tokens=4,
        logprobs=2,
        extra_body=asked,  # type: ignore[arg-type]
    ).model_dump()
    choice = legacy["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice["logprobs"]["top_logprobs"])
    refused = _bad(api, _chat([{"type": "text", "text": "x"}], extra_body={"return_tokens_as_token_ids": 1}))
    assert (refused.status_code, refused.body["param"]) == (400, "return_tokens_as_token_ids")  # type: ignore[index]


def test_truncate_prompt_tokens_reads_the_prompt_s_last_tokens_and_never_half_an_image(api: Api) -> None:
    """vLLM's truncate_prompt_tokens, over the openai SDK: completions read
    the prompt's last N ids (return_token_ids shows them; the usage counts
    them, and so does Tokenize; the answer is that of a prompt of those
    ids); -1 cuts a prompt
    longer than the context to the context less one; a chat with an image
    keeps its image when N reaches it and is a 400 naming the field when N
    would cut it; echo with it, and -2, are 400s."""
    from mmsplit.client import Client

    client = api.client()

    def completion(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
        return client.completions.create(
            model=api.model,
            prompt=prompt,
            max_tokens=4,
            extra_body={"return_token_ids": True, **extra},  # type: ignore[arg-type]
        ).model_dump()

    text = "Once upon a time there was a picture of a cat on a mat."
    whole = completion(text)["choices"][0]["prompt_token_ids"]
    cut = completion(text, truncate_prompt_tokens=6)
    assert cut["choices"][0]["prompt_token_ids"] == whole[-6:]
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["choices"][0]["token_ids"] == completion(whole[-6:])["choices"][0]["token_ids"]
    assert completion(text, truncate_prompt_tokens=len(whole) + 5)["choices"][0]["prompt_token_ids"] == whole

    with Client(api.pair.tokenizer_address) as grpc_client:
        context = grpc_client.tokenize(text).max_context_tokens
        assert grpc_client.tokenize(text, truncate_prompt_tokens=6, prompt_as_written=True).ids == whole[-6:]
    long = completion(" ".join(["cat"] * (context + 50)), truncate_prompt_tokens=-1)
    assert long["usage"]["prompt_tokens"] == context - 1, (context, long["usage"])
    assert long["choices"][0]["finish_reason"] == "length"

    def chat_ids(**extra: Any) -> list[int]:
        return _with_ids(api, 2, **extra)["prompt_token_ids"]  # type: ignore[no-any-return]

    rendered = chat_ids()
    image = hf_loaded.model(api.pair.model).config.image_token_id
    keep = len(rendered) - rendered.index(image)  # from the first image's first placeholder on
    assert chat_ids(truncate_prompt_tokens=keep) == rendered[-keep:]
    refused = _bad(api, lambda c: chat_ids(truncate_prompt_tokens=keep - 1))
    assert (refused.status_code, refused.body["param"]) == (400, "truncate_prompt_tokens"), refused.body  # type: ignore[index]
    assert f"keep at least {keep} tokens" in refused.message
    for extra in ({"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "3"}):
        refused = _bad(api, lambda c, extra=extra: completion(text, **extra))  # type: ignore[misc]
        assert (refused.status_code, refused.body["param"]) == (400, "truncate_prompt_tokens")  # type: ignore[index]
    refused = _bad(api, lambda c: completion(text, truncate_prompt_tokens=3, echo=True))
    assert (refused.status_code, refused.body["param"]) == (400, "echo")  # type: ignore[index]


def test_documents_are_taken_and_a_template_that_reads_none_leaves_them_out(api: Api) -> None:
    """vLLM's `documents` over the openai SDK: LLaVA's template reads none,
    so the prompt and the answer are those without them (what a template
    that renders them makes: tests/tokenizer/test_prompt.py); a document
    with a special token's text, or a malformed list, is a 400 naming it.
    add_generation_prompt false leaves the template's generation prompt
    off the same conversation."""
    documents = [{"title": "Cats", "text": "Cats sleep a lot."}]
    plain, given = _with_ids(api, 4), _with_ids(api, 4, documents=documents)
    assert given["prompt_token_ids"] == plain["prompt_token_ids"]
    assert given["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    # add_generation_prompt false: the same conversation without the template's "ASSISTANT:" at its end.
    closed = _with_ids(api, 2, add_generation_prompt=False)["prompt_token_ids"]
    tokenizer = hf_loaded.tokenizer(api.pair.model)
    assert tokenizer.decode(plain["prompt_token_ids"]).rstrip().endswith("ASSISTANT:")
    assert not tokenizer.decode(closed).rstrip().endswith("ASSISTANT:")
    assert len(closed) < len(plain["prompt_token_ids"])
    for bad, param in (
        ([{"text": "ok"}, {"text": "</s> sneaky"}], "documents[1]"),
        ([{"text": "a", "page": 3}], "documents"),
        ({"text": "a"}, "documents"),
    ):
        refused = _bad(api, lambda c, bad=bad: _with_ids(api, 1, documents=bad))  # type: ignore[misc]
        assert (refused.status_code, refused.body["param"]) == (400, param), refused.body  # type: ignore[index]


# A request's own template: ChatML with a system turn of its own, each part's text or a vision block.
OWN_TEMPLATE = (
    "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_request_s_own_chat_template_where_the_tokenizer_trusts_them(api: Api, qwen_api: Api) -> None:
    """vLLM's chat_template: a tokenizer started with
    --trust-request-chat-template renders that request's conversation with
    it (the prompt ids are those of the processor's apply_chat_template with
    that template, image included) and the answer is that prompt's; one
    that fails to render is a 400 naming it; a tokenizer without the flag
    refuses any with a 400 that names the flag."""
    from tests.support import hf_family
    from tokenizer_svc.decode import decode_image

    messages = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "What is it?"}]}]
    own = qwen_api.client().chat.completions.create(
        model=qwen_api.model, messages=messages, max_tokens=3,  # type: ignore[arg-type]
        extra_body={"chat_template": OWN_TEMPLATE, "return_token_ids": True},
    ).model_dump()  # fmt: skip
    proc = hf_family.processor(qwen_api.pair.model)
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    rendered = proc.apply_chat_template(
        hf_messages, chat_template=OWN_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert "Answer in one word." in rendered
    expected = proc(images=[decode_image(A, max_pixels=10**8)], text=rendered, return_tensors="pt")["input_ids"][0]
    assert own["prompt_token_ids"] == expected.tolist()
    by_template = qwen_api.client().chat.completions.create(
        model=qwen_api.model, messages=messages, max_tokens=3,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    ).model_dump()  # fmt: skip
    assert by_template["prompt_token_ids"] != own["prompt_token_ids"]
    broken = _bad(qwen_api, _chat([{"type": "text", "text": "x"}], model=qwen_api.model,
                                  extra_body={"chat_template": "{% if %}"}))  # fmt: skip
    assert (broken.status_code, broken.body["param"]) == (400, "chat_template"), broken.body  # type: ignore[index]
    refused = _bad(api, _chat([{"type": "text", "text": "x"}], extra_body={"chat_template": OWN_TEMPLATE}))
    assert (refused.status_code, refused.body["param"]) == (400, "chat_template")  # type: ignore[index]
    assert "--trust-request-chat-template" in refused.message
    _good_after(qwen_api)


def test_beam_search_returns_the_beams_transformers_finds(api: Api) -> None:
    """vLLM's use_beam_search over the openai SDK, a chat turn with an
    image: the n choices are transformers' `generate(num_beams=n,
    num_return_sequences=n)` sequences on the same prompt and pixels, best
    first, for several widths and length penalties, with a stop token id
    that ends some beams early (transformers' extra eos id), streamed too;
    each choice's log probabilities sum to its beam's. Refused, naming the
    field: a sampling field beam search cannot honour (stop), a
    length_penalty without beam search; the next request is served."""
    import torch

    inputs, prompt_ids, model = _described_a(api)
    eos = model.config.text_config.eos_token_id
    chat = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}, image_part(A)]}]
    client = api.client()

    def hf_beams(width: int, penalty: float, tokens: int, stops: list[int]) -> list[list[int]]:
        with torch.inference_mode():
            made = model.generate(
                **inputs, max_new_tokens=tokens, num_beams=width, num_return_sequences=width, do_sample=False,
                length_penalty=penalty, early_stopping=False, eos_token_id=[eos, *stops], pad_token_id=eos,
            )  # fmt: skip
        beams = []
        for row in made[:, len(prompt_ids) :].tolist():
            ends = [i for i, t in enumerate(row) if t in (eos, *stops)]
            beams.append(row[: ends[0] + 1] if ends else row)
        return beams

    plain = client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=8,
        extra_body={"return_token_ids": True},  # type: ignore[arg-type]
    ).model_dump()
    assert plain["prompt_token_ids"] == prompt_ids
    greedy = plain["choices"][0]["token_ids"]
    best: list[int] = []
    answers: dict[float, list[list[int]]] = {}
    # The best beam's third token as a stop token: with no length penalty a
    # beam it ends early keeps a higher sum and is in the answer; a penalty
    # of 3 ranks the longer beams first.
    cases = ((3, 1.0, 8, []), (4, 0.0, 6, [-3]), (4, 3.0, 6, [-3]), (2, 2.0, 7, [greedy[1]]))
    logged = lambda: api.pair.scheduler.log_path.read_text().count(" finished: ")  # noqa: E731

    def counted() -> tuple[float, float]:
        """The scheduler's finished requests and search steps, from its /metrics."""
        sample = scrape(api.scheduler_metrics)
        total = lambda suffix: sum(v for (name, _), v in sample.items() if name.endswith(suffix))  # noqa: E731
        return total("_requests_total"), total("_search_steps_total")

    for width, penalty, tokens, stops in cases:
        stops = [best[2] if s == -3 else s for s in stops]
        expected = hf_beams(width, penalty, tokens, stops)
        extra = {"use_beam_search": True, "length_penalty": penalty, "return_token_ids": True, "stop_token_ids": stops}
        lines, (requests, steps) = logged(), counted()
        reply = client.chat.completions.create(
            model=api.model, messages=chat, max_tokens=tokens, n=width, logprobs=True, top_logprobs=2,
            extra_body=extra,  # type: ignore[arg-type]
        ).model_dump()  # fmt: skip
        choices = reply["choices"]
        assert [c["token_ids"] for c in choices] == expected, (width, penalty, stops)
        assert logged() == lines  # the scheduler logs each step (one token of a beam) at debug level
        # ... and counts the steps apart from its requests (at least one a token of the best beam).
        now = counted()
        assert now[0] == requests, "a beam search's steps are no requests in the scheduler's metrics"
        assert now[1] - steps >= len(choices[0]["token_ids"]), (now, steps)
        assert [c["index"] for c in choices] == list(range(width))
        assert [c["finish_reason"] for c in choices] == [
            "stop" if c["token_ids"][-1] in stops else "length" for c in choices
        ]
        if penalty == 0.0:
            assert any(c["finish_reason"] == "stop" for c in choices), (width, stops, choices)
        best = best or choices[0]["token_ids"]
        answers[penalty] = expected
        for c in choices:
            content = c["logprobs"]["content"]
            assert len(content) == len(c["token_ids"])
            assert all(len(e["top_logprobs"]) == 2 for e in content)
        assert reply["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
        assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert answers[0.0] != answers[3.0], "the length penalty changed nothing: the cases prove nothing"
    # The beams' text, streamed: the same choices, each whole at the end.
    streamed = client.chat.completions.create(
        model=api.model, messages=chat, max_tokens=8, n=3, stream=True,
        extra_body={"use_beam_search": True},  # type: ignore[arg-type]
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    whole = client.chat.completions.create(
        model=api.model,
        messages=chat,
        max_tokens=8,
        n=3,
        extra_body={"use_beam_search": True},  # type: ignore[arg-type]
    )
    assert texts == [c.message.content for c in whole.choices]
    assert whole.choices[0].message.content != whole.choices[1].message.content

    for extra, param in (
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=api.model,
                messages=chat,
                max_tokens=4,
                extra_body=extra,  # type: ignore[arg-type]
            )
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
    assert client.chat.completions.create(model=api.model, messages=chat, max_tokens=4).choices[0].message.content


def test_a_beam_search_the_client_leaves_ends_and_lets_everything_go(api: Api) -> None:
    """A gRPC beam search (n 4, an image, up to 300 tokens) cancelled by its
    client while its beams' steps run: the scheduler holds no row within
    seconds, the slab no slice, /dev/shm no segment of the tokenizer's, and
    the next request is served."""
    request = build_request(messages=[("user", [ImagePart(B), "Go on and on."])], max_tokens=300)
    request.n = 4
    request.sampling.ignore_eos = True
    request.beam_search.SetInParent()
    with grpc.insecure_channel(api.pair.tokenizer_address) as channel:
        call = tokenizer_pb2_grpc.TokenizerServiceStub(channel).Generate(request, timeout=120)
        assert wait_until(lambda: any(rank_active_requests(api.pair.scheduler_address)), timeout=30), "no step ran"
        call.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: not any(rank_active_requests(api.pair.scheduler_address)), timeout=10), "a row stayed"
    slab_free = lambda: tokenizer_info(api.pair.tokenizer_address).info.shm_slab_used_bytes == 0  # noqa: E731
    assert wait_until(slab_free, timeout=10), "the slab still holds a slice"
    mine = [n for n in project_segments() if n.startswith(f"{PROJECT_PREFIX}-{api.pair.tokenizer.pid}-")]
    assert not mine, mine
    _good_after(api)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(api: Api) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage),
    chat and completions (echo, two choices) over the openai SDK: every
    chunk of output carries the usage so far, its prompt tokens the final
    usage's and its completion tokens never fewer than the chunk before,
    up to the final usage's; without it no chunk but the last has usage.
    A non-boolean value is a 400 naming stream_options."""
    client = api.client()
    chat = [{"role": "user", "content": [image_part(A), {"type": "text", "text": "Hi"}]}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    for streamed in (
        client.chat.completions.create(model=api.model, messages=chat, max_tokens=6, stream=True,
                                       stream_options=options),  # type: ignore[arg-type]
        client.completions.create(model=api.model, prompt="Once upon", max_tokens=5, n=2, echo=True, stream=True,
                                  stream_options=options),  # type: ignore[arg-type]
    ):  # fmt: skip
        chunks = list(streamed)
        final = chunks[-1].usage
        assert final is not None
        assert not chunks[-1].choices
        # Every chunk with output (all but chat's opening one, with the role) says the usage so far.
        with_output = [
            c for c in chunks[:-1] if c.choices and not getattr(c.choices[0].__dict__.get("delta"), "role", None)
        ]
        counted = [c.usage for c in with_output]
        assert counted
        assert None not in counted
        assert {u.prompt_tokens for u in counted} == {final.prompt_tokens}  # type: ignore[union-attr]
        seen = [u.completion_tokens for u in counted]  # type: ignore[union-attr]
        assert seen == sorted(seen), seen
        assert seen[-1] == final.completion_tokens, (seen, final)
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in counted)  # type: ignore[union-attr]
    plain = list(client.chat.completions.create(model=api.model, messages=chat, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=api.model, messages=chat, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": "yes"})  # type: ignore[typeddict-item]  # fmt: skip
    assert info.value.body["param"] == "stream_options"  # type: ignore[index]


# A template whose generation prompt opens the model's thinking, as
# DeepSeek-R1's and the Qwen3 Thinking models' do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n"
)


def _streamed_parts(api: Api, **kwargs: Any) -> dict[str, str]:
    """A streamed chat answer's deltas added up by field."""
    parts: dict[str, str] = {}
    for chunk in api.client().chat.completions.create(model=api.model, stream=True, **kwargs):
        for key, value in chunk.choices[0].delta.model_dump().items():
            if isinstance(value, str):
                parts[key] = parts.get(key, "") + value
    return parts


def test_a_reasoning_parser_answers_the_thinking_apart_from_the_content(qwen_api: Api) -> None:
    """--reasoning-parser qwen3 through the openai SDK: an output that
    opens its thinking and closes it (made so by a regex: the tiny model's
    own words are random) answers the thinking as `reasoning` and
    `reasoning_content` and the rest as `content`, streamed and not alike; a
    prompt whose template opens the thinking has the whole output as
    reasoning (this model never writes the end tag), and refuses structured
    output with a 400 that says why; an answer with no thinking is all
    content."""
    from transformers import AutoTokenizer

    client = qwen_api.client()
    chat = [{"role": "user", "content": [{"type": "text", "text": "Think, then answer."}]}]
    pattern = "<think>[a-z]{3,8}</think>\n\n[a-z]{2,6}"
    body = {"structured_outputs": {"regex": pattern}}
    whole = client.chat.completions.create(model=qwen_api.model, messages=chat, max_tokens=30, extra_body=body)  # type: ignore[arg-type]
    message = whole.choices[0].message.model_dump()
    assert whole.choices[0].finish_reason == "stop", whole
    found = re.fullmatch("<think>([a-z]+)</think>\n\n([a-z]+)", "<think>" + message["reasoning"] + "</think>\n\n"
                         + message["content"])  # fmt: skip
    assert found, message
    assert message["reasoning_content"] == message["reasoning"]
    # vLLM's include_reasoning: false: the same answer without its thinking (a 400 for a non-boolean).
    hide = {**body, "include_reasoning": False}
    bare = client.chat.completions.create(model=qwen_api.model, messages=chat, max_tokens=30, extra_body=hide)  # type: ignore[arg-type]
    bare = bare.choices[0].message
    assert (bare.content, bare.model_dump()["reasoning"]) == (message["content"], None)
    wrong = _bad(qwen_api, _chat([{"type": "text", "text": "x"}], model=qwen_api.model,
                                 extra_body={"include_reasoning": "yes"}))  # fmt: skip
    assert (wrong.status_code, wrong.body["param"]) == (400, "include_reasoning")  # type: ignore[index]
    thinking = whole.usage.completion_tokens_details.reasoning_tokens  # type: ignore[union-attr]
    assert 0 < thinking < whole.usage.completion_tokens, whole.usage  # type: ignore[union-attr]
    streamed = _streamed_parts(qwen_api, messages=chat, max_tokens=30, extra_body=body)
    assert (streamed["reasoning"], streamed["reasoning_content"], streamed["content"]) == (
        message["reasoning"], message["reasoning"], message["content"],
    )  # fmt: skip

    opened = {"chat_template": THINKING_TEMPLATE, "return_token_ids": True}
    thought = client.chat.completions.create(model=qwen_api.model, messages=chat, max_tokens=12, extra_body=opened)  # type: ignore[arg-type]
    answer = thought.model_dump()
    tokenizer = AutoTokenizer.from_pretrained(qwen_api.pair.model)
    assert tokenizer.decode(answer["prompt_token_ids"][-4:]).rstrip().endswith("<think>")
    text = tokenizer.decode(answer["choices"][0]["token_ids"], skip_special_tokens=True)
    assert "</think>" not in text  # what the next line relies on
    assert answer["choices"][0]["message"]["reasoning"] == text.strip()
    assert answer["choices"][0]["message"]["content"] is None
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == answer["usage"]["completion_tokens"]
    streamed = _streamed_parts(qwen_api, messages=chat, max_tokens=12, extra_body={"chat_template": THINKING_TEMPLATE})
    assert (streamed["reasoning"], streamed.get("content", "")) == (text.strip(), "")
    refused = _bad(qwen_api, _chat([{"type": "text", "text": "x"}], model=qwen_api.model,
                                   extra_body={"chat_template": THINKING_TEMPLATE, **body}))  # fmt: skip
    assert refused.status_code == 400
    assert "enable_thinking" in refused.message
    streamed_refusal = _bad(qwen_api, _chat([{"type": "text", "text": "x"}], model=qwen_api.model, stream=True,
                                            extra_body={"chat_template": THINKING_TEMPLATE, **body}))  # fmt: skip
    assert streamed_refusal.status_code == 400, streamed_refusal  # before the stream began, not an event in it

    plain = client.chat.completions.create(model=qwen_api.model, messages=chat, max_tokens=6)  # type: ignore[arg-type]
    assert plain.choices[0].message.model_dump()["reasoning"] is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
    assert plain.choices[0].message.content

    # The answer sent back as the SDK gives it: its thinking reaches the template as reasoning_content.
    history = [*chat, whole.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
    shows = {"chat_template": SHOWS_REASONING, "return_token_ids": True}
    again = client.chat.completions.create(model=qwen_api.model, messages=history, max_tokens=2, extra_body=shows)  # type: ignore[arg-type]
    prompt = tokenizer.decode(again.model_dump()["prompt_token_ids"])
    assert f"[thought: {message['reasoning']}]{message['content']}" in prompt, prompt

    # The Responses API: the thinking as a reasoning item before the message, streamed as its own events.
    response = client.responses.create(model=qwen_api.model, input="Think, then answer.", max_output_tokens=30,
                                       extra_body=body)  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "message"], response
    reasoning_text = response.output[0].content[0].text  # type: ignore[union-attr,index]
    assert re.fullmatch("[a-z]+", reasoning_text), response
    assert re.fullmatch("[a-z]+", response.output_text), response
    assert response.usage.output_tokens_details.reasoning_tokens == thinking  # type: ignore[union-attr]
    events = list(client.responses.create(model=qwen_api.model, input="Think, then answer.", max_output_tokens=30,
                                          extra_body=body, stream=True))  # fmt: skip
    deltas = {kind: "".join(e.delta for e in events if e.type == kind)  # type: ignore[union-attr]
              for kind in ("response.reasoning_text.delta", "response.output_text.delta")}  # fmt: skip
    assert deltas == {"response.reasoning_text.delta": reasoning_text,
                      "response.output_text.delta": response.output_text}  # fmt: skip
    # Its output sent back as the next input (reasoning item included), and continued by id.
    sent_back = [item.model_dump(exclude_none=True) for item in response.output]
    after = client.responses.create(model=qwen_api.model, max_output_tokens=2,
                                    input=[*sent_back, {"role": "user", "content": "And?"}])  # type: ignore[list-item]  # fmt: skip
    assert after.status in ("completed", "incomplete")
    continued = client.responses.create(model=qwen_api.model, max_output_tokens=2, input="And?",
                                        previous_response_id=response.id)  # fmt: skip
    listed = client.responses.input_items.list(continued.id)
    assert "reasoning" in [item.type for item in listed.data], listed

    # gRPC: the server says its parsers; split_reasoning gives the same two parts in Finished; the deltas stay
    # the text as written.
    said = tokenizer_info(qwen_api.pair.tokenizer_address).info
    assert (said.reasoning_parser, said.tool_call_parser) == ("qwen3", "none")
    from mmsplit.conformance import Kit, Options

    kit = Kit(Options(qwen_api.pair.tokenizer_address))
    try:  # the conformance kit's check, on a tokenizer with a parser (the shared pair has none: its refusal)
        assert kit.tokenizer_split_reasoning() == "qwen3: reasoning 'a b', content 'c'"
    finally:
        kit.close()
    from mmsplit.client import Client, Reasoning

    with Client(qwen_api.pair.tokenizer_address) as grpc_client:
        done = grpc_client.complete(messages=[("user", "Think, then answer.")], max_tokens=30, regex=pattern,
                                    split_reasoning=True)  # fmt: skip
        assert (done.reasoning, done.content) == (message["reasoning"], message["content"])
        assert done.text == f"<think>{message['reasoning']}</think>\n\n{message['content']}"
        with pytest.raises(RequestFailed) as refused_grpc:
            grpc_client.complete(messages=[("user", "x")], max_tokens=2, regex=pattern, split_reasoning=True,
                                 chat_template=THINKING_TEMPLATE)  # fmt: skip
        assert refused_grpc.value.reason == "INVALID_REQUEST"
        # An earlier answer's thinking sent back in an assistant turn: the template gets it.
        answered = ("assistant", [Reasoning(message["reasoning"]), message["content"]])
        back = grpc_client.complete(
            messages=[("user", "Think, then answer."), answered, ("user", "And?")],
            max_tokens=1, return_prompt_token_ids=True, chat_template=SHOWS_REASONING,
        )  # fmt: skip
        assert f"[thought: {message['reasoning']}]" in tokenizer.decode(back.prompt_token_ids)
    _good_after(qwen_api)


SHOWS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.reasoning_content %}[thought: "
    "{{ m.reasoning_content }}]{% endif %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
