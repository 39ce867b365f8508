"""The conformance kit's checks of an OpenAI-compatible HTTP API
(`mmsplit conformance ... --http http://HOST:PORT/v1`), stdlib only.

- health: GET /health (beside /v1) is 200;
- models: GET /v1/models lists the model, in OpenAI's list shape;
- chat: a completion has an assistant message, a finish reason and usage
  that adds up;
- stream: server-sent events with the assistant's role first, exactly one
  finish reason, the usage chunk (choices []) when asked, `[DONE]` last;
- structured output: `response_format` json_schema answered with a document
  of the schema, finish reason "stop"; a schema that is no schema is 400
  naming `response_format`;
- tool calls: a `tool_choice` naming a function answered with one call of
  it (an id, arguments a document of its parameters), finish reason
  "tool_calls"; a tool_choice naming no tool given is 400 naming
  `tool_choice`;
- responses: POST /v1/responses answers a response object (a message item
  with output_text, a status, usage that adds up) and, streamed, typed
  events numbered from 0, response.created first and response.completed
  (or .incomplete) last, whose text deltas make the response's text;
- scoring: POST /v1/completions of a prompt of token ids (vLLM's
  /tokenize of a text) with `echo`,
  `logprobs` 1 and `max_tokens` 1 (what lm-evaluation-harness sends for
  its loglikelihoods): the text starts as the prompt's, one log
  probability per prompt token (the first null) and one for the output
  token, each top_logprobs entry one token, its value at least the
  token's own;
- error shape: a bad parameter is 400 with {"error": {message, type, param,
  code}}, code INVALID_REQUEST, param naming it, x-should-retry false;
- unknown model 404, malformed JSON 400, each in the same shape.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from mmsplit.checks import SCHEMA, Result, expect, expect_a_document_of_the_schema, run_check


class HttpKit:
    def __init__(self, base: str, api_key: str = "", timeout_s: float = 60.0) -> None:
        self.base = base.rstrip("/")
        self.root = self.base.removesuffix("/v1")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = ""

    def all(self) -> list[Result]:
        checks: list[tuple[str, Callable[[], str | None]]] = [
            ("http.health", self.health),
            ("http.models", self.models),
            ("http.chat", self.chat),
            ("http.stream", self.stream),
            ("http.response_format", self.response_format),
            ("http.tool_call", self.tool_call),
            ("http.responses", self.responses),
            ("http.echo_logprobs", self.echo_logprobs),
            ("http.error_shape", self.error_shape),
            ("http.unknown_model", self.unknown_model),
            ("http.malformed_json", self.malformed_json),
        ]
        return [run_check(name, check) for name, check in checks]

    # ---- HTTP ----

    def _call(self, method: str, url: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        return self._call("POST", self.base + path, json.dumps(body).encode())

    def _chat_body(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, **extra}

    # ---- checks ----

    def health(self) -> str:
        status, _, _ = self._call("GET", self.root + "/health")
        expect(status == 200, f"GET /health is {status}, expected 200 on a ready server")
        return "200"

    def models(self) -> str:
        status, _, raw = self._call("GET", self.base + "/models")
        expect(status == 200, f"GET /v1/models is {status}")
        body = json.loads(raw)
        expect(body.get("object") == "list" and body.get("data"), f"not a list of models: {body}")
        self.model = body["data"][0].get("id", "")
        expect(bool(self.model) and body["data"][0].get("object") == "model", f"not a model card: {body['data'][0]}")
        return self.model

    def chat(self) -> str:
        status, _, raw = self._post("/chat/completions", self._chat_body())
        expect(status == 200, f"status {status}: {raw[:200]!r}")
        body = json.loads(raw)
        choice = body["choices"][0]
        expect(choice["message"]["role"] == "assistant", f"message role {choice['message'].get('role')!r}")
        expect(isinstance(choice["message"]["content"], str), "message content is not a string")
        expect(choice["finish_reason"] in ("stop", "length"), f"finish_reason {choice['finish_reason']!r}")
        usage = body["usage"]
        expect(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage {usage}")
        return f"{usage['completion_tokens']} tokens"

    def stream(self) -> str:
        body = self._chat_body(stream=True, stream_options={"include_usage": True})
        status, headers, raw = self._post("/chat/completions", body)
        expect(status == 200, f"status {status}")
        kind = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
        expect(kind.startswith("text/event-stream"), f"content type {kind!r}")
        data = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        expect(bool(data) and data[-1] == "[DONE]", "the stream does not end with data: [DONE]")
        chunks = [json.loads(d) for d in data[:-1]]
        expect(all("error" not in c for c in chunks), "an error event in a good stream")
        expect(chunks[0]["choices"][0]["delta"].get("role") == "assistant", "the first chunk is not the role")
        finishes = [
            c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        expect(len(finishes) == 1, f"{len(finishes)} chunks with a finish reason, expected 1")
        expect(chunks[-1]["choices"] == [] and "usage" in chunks[-1], "no usage chunk (choices []) before [DONE]")
        return f"{len(chunks)} chunks"

    def response_format(self) -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": "check", "schema": SCHEMA}}
        status, _, raw = self._post("/chat/completions", self._chat_body(max_tokens=64, response_format=fmt))
        expect(status == 200, f"status {status}: {raw[:200]!r}")
        choice = json.loads(raw)["choices"][0]
        text = choice["message"]["content"]
        expect(choice["finish_reason"] == "stop", f"finish_reason {choice['finish_reason']!r} after {text!r}")
        expect_a_document_of_the_schema(text)
        bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 7}}}
        status, headers, raw = self._post("/chat/completions", self._chat_body(response_format=bad))
        error = self._error(status, raw, headers, 400, "INVALID_REQUEST")
        expect(error["param"] == "response_format", f"param {error['param']!r}, expected 'response_format'")
        return str(text)

    def tool_call(self) -> str:
        tool = {"type": "function", "function": {"name": "check", "description": "A check.", "parameters": SCHEMA}}
        named = {"type": "function", "function": {"name": "check"}}
        body = self._chat_body(max_tokens=64, tools=[tool], tool_choice=named)
        status, _, raw = self._post("/chat/completions", body)
        expect(status == 200, f"status {status}: {raw[:200]!r}")
        choice = json.loads(raw)["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        expect(len(calls) == 1, f"{len(calls)} tool calls, expected 1: {choice['message']!r}")
        call = calls[0]
        expect(choice["finish_reason"] == "tool_calls", f"finish_reason {choice['finish_reason']!r}")
        expect(bool(call.get("id")) and call.get("type") == "function", f"a call without an id or type: {call!r}")
        expect(call["function"]["name"] == "check", f"called {call['function']['name']!r}, not 'check'")
        expect_a_document_of_the_schema(call["function"]["arguments"])
        other = {"type": "function", "function": {"name": "no_such_tool"}}
        status, headers, raw = self._post("/chat/completions", self._chat_body(tools=[tool], tool_choice=other))
        error = self._error(status, raw, headers, 400, "INVALID_REQUEST")
        expect(error["param"] == "tool_choice", f"param {error['param']!r}, expected 'tool_choice'")
        return str(call["function"]["arguments"])

    def responses(self) -> str:
        ask = {"model": self.model, "input": "Say hello.", "max_output_tokens": 4}
        status, _, raw = self._post("/responses", ask)
        expect(status == 200, f"status {status}: {raw[:200]!r}")
        body = json.loads(raw)
        expect(body.get("object") == "response", f"object {body.get('object')!r}, expected 'response'")
        expect(body.get("status") in ("completed", "incomplete"), f"status {body.get('status')!r}")
        texts = [p["text"] for item in body["output"] if item.get("type") == "message" for p in item["content"]]
        expect(len(texts) == 1 and isinstance(texts[0], str), f"output {body['output']!r}: not one output_text")
        usage = body["usage"]
        expect(usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], f"usage {usage}")
        status, _, raw = self._post("/responses", {**ask, "stream": True})
        expect(status == 200, f"streamed: status {status}")
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        kinds = [e.get("type") for e in events]
        expect(bool(kinds) and kinds[0] == "response.created", f"first event {kinds[:1]}, expected response.created")
        last = kinds[-1] if kinds else None
        expect(last in ("response.completed", "response.incomplete"), f"last event {last!r}")
        numbers = [e.get("sequence_number") for e in events]
        expect(numbers == list(range(len(events))), f"sequence numbers {numbers[:8]}..., expected 0, 1, 2...")
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        final = events[-1]["response"]["output"][0]["content"][0]["text"]
        expect(deltas == final, f"the deltas make {deltas!r}, the response says {final!r}")
        return f"{len(events)} events"

    def echo_logprobs(self) -> str:
        asked = json.dumps({"model": self.model, "prompt": "The quick brown fox"}).encode()
        status, _, raw = self._call("POST", self.root + "/tokenize", asked)
        expect(status == 200, f"POST /tokenize is {status}: {raw[:200]!r}")
        ids = json.loads(raw)["tokens"]
        ask = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
        status, _, raw = self._post("/completions", ask)
        expect(status == 200, f"status {status}: {raw[:200]!r}")
        choice = json.loads(raw)["choices"][0]
        lp = choice["logprobs"]
        values, tops = lp["token_logprobs"], lp["top_logprobs"]
        expect(
            len(values) == len(tops) == len(lp["tokens"]) == len(ids) + 1, f"{len(values)} entries for {len(ids)} ids"
        )
        expect(values[0] is None and tops[0] is None, "the first prompt token has a log probability")
        for value, top in zip(values[1:], tops[1:], strict=True):
            expect(len(top) == 1 and value <= max(top.values()) + 1e-6 and value <= 0, f"{value} with top {top}")
        return f"{len(ids)} prompt tokens scored"

    def _error(self, status: int, raw: bytes, headers: dict[str, str], want: int, code: str) -> dict[str, Any]:
        expect(status == want, f"status {status}, expected {want}")
        error = json.loads(raw).get("error")
        expect(isinstance(error, dict), f"no error object: {raw[:200]!r}")
        expect({"message", "type", "param", "code"} <= set(error), f"error lacks fields: {error}")
        expect(error["code"] == code, f"code {error['code']!r}, expected {code!r}")
        retry = {k.lower(): v for k, v in headers.items()}.get("x-should-retry")
        expect(retry == "false", f"x-should-retry {retry!r}, expected 'false'")
        return error

    def error_shape(self) -> str:
        status, headers, raw = self._post("/chat/completions", self._chat_body(temperature=-1))
        error = self._error(status, raw, headers, 400, "INVALID_REQUEST")
        expect(error["param"] == "temperature", f"param {error['param']!r}, expected 'temperature'")
        return error["message"][:60]

    def unknown_model(self) -> str:
        status, headers, raw = self._post("/chat/completions", {**self._chat_body(), "model": "no-such-model-here"})
        self._error(status, raw, headers, 404, "NOT_FOUND")
        return "404"

    def malformed_json(self) -> str:
        status, headers, raw = self._call("POST", self.base + "/chat/completions", b"{not json")
        self._error(status, raw, headers, 400, "INVALID_REQUEST")
        return "400"
