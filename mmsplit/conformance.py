"""The contract's conformance kit: what a server implementing our protos must
do that a `.proto` cannot say.

    mmsplit conformance --tokenizer HOST:PORT [--scheduler HOST:PORT] [--http http://HOST:PORT/v1]
    mmsplit-conformance ...    # the same, from the light client distribution alone

It speaks only the protos (the generated stubs, `grpc.health.v1` and server
reflection) and the error table of DESIGN.md §4 (`mmsplit.errors.TABLE`); it
imports nothing of our servers, so it judges anyone's implementation the same
way. Each check is a name and a verdict (PASS, FAIL or SKIP with the reason);
the table it prints is the report, and any FAIL makes the exit status 1.

What it checks, per service:
- health: `""` (live) and the full service name (ready) are SERVING; an
  unknown service name is NOT_FOUND.
- reflection (v1, or v1alpha where v1 is not served) lists the service,
  health and reflection itself.
- GetServerInfo: the fields a client relies on are filled in and consistent.
- a stream's events: (scheduler: exactly one Accepted first), then deltas,
  then exactly one Finished last; the tokens add up; the tokenizer puts the
  request id on every event (and makes one up when the request has none).
- Tokenize: as many ids as Generate of the same request (with an image)
  reports prompt tokens, and a context longer than them.
- structured output: a request with a small `json_schema` ends (STOP) with
  a document of that schema; one with a `choice` of strings, with one of them.
- every client-error ErrorCode that an input can provoke: the gRPC code of
  the table, an ErrorInfo with domain "mmsplit", the reason, retriable=false
  and the request id; then a good request still succeeds.
- cancellation and deadlines propagate: after a client cancels, or its
  deadline passes, the scheduler's running + queued requests come back to
  what they were (read through GetServerInfo) within a bound.
- unknown fields in a request are tolerated (proto3 forward compatibility).
- with --http, the OpenAI-compatible API (`mmsplit.conformance_http`).

Run it against an otherwise idle server: the propagation checks compare the
scheduler's request counts before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

try:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2
except ImportError as exc:  # the light client without its extra
    raise ImportError(
        f"{exc.name} is missing: the conformance kit needs pip install 'mmsplit-client[conformance]'", name=exc.name
    ) from exc

from mmsplit import localauth
from mmsplit.checks import SCHEMA, Failed, Result, Skipped, expect, expect_a_document_of_the_schema, run_check, table
from mmsplit.client import read_secret, transport_hint
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import DOMAIN, TABLE, error_info_of, reason_of
from mmsplit.pairing import Pairing
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

E = common_pb2.ErrorCode
CHOICES = ["yes", "no", "not sure"]  # the choice check's strings
TOKENIZER_SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
# The protocol's current name: the same messages as v1alpha's, in another package.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# Appended to a serialized request: field 1999 as a varint and field 1998 as
# bytes. Neither exists in any of our messages.
UNKNOWN_FIELDS = b"\xf8\x7c\x01" + b"\xf2\x7c\x03abc"
SETTLE_S = 15.0  # how long a cancelled or expired request may take to leave the scheduler


@dataclass
class Options:
    tokenizer: str
    scheduler: str = ""
    not_found_url: str = ""
    timeout_s: float = 60.0
    long_tokens: int = 0  # 0: as many as the server allows (its max_tokens_limit)
    credentials: grpc.ChannelCredentials | None = None
    scheduler_token: str = ""


# ---- media the checks send (made here: the kit depends on no test code) ----
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, idat: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def png(width: int = 64, height: int = 48) -> bytes:
    """A valid RGB PNG of one colour (the standard library alone: the kit
    needs nothing but gRPC)."""
    row = b"\0" + bytes((90, 140, 200)) * width  # filter type 0, then the pixels
    return _png(width, height, zlib.compress(row * height))


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT: a bomb
    any server must refuse before allocating the pixels."""
    return _png(width, height, zlib.compress(b"\0" * 64))


# ---- the error a failed call carries ----
def check_error(exc: grpc.RpcError, code: int, request_id: str) -> str:
    """That `exc` is `code` as the table says, with an ErrorInfo naming it;
    returns a one-line summary."""
    kind = TABLE[code]
    got = exc.code()
    info = error_info_of(exc)
    expect(info is not None, f"{got.name} without a google.rpc.ErrorInfo detail: {exc.details()!r}")
    assert info is not None
    expect(info.domain == DOMAIN, f"ErrorInfo domain {info.domain!r}, expected {DOMAIN!r}")
    expect(info.reason == reason_of(code), f"reason {info.reason!r}, expected {reason_of(code)!r} ({exc.details()!r})")
    expect(got == kind.grpc_code, f"gRPC code {got.name}, expected {kind.grpc_code.name}")
    retriable = info.metadata.get("retriable")
    expect(retriable == str(kind.retriable).lower(), f"metadata retriable={retriable!r}, expected {kind.retriable}")
    if request_id:
        echoed = info.metadata.get("request_id")
        expect(echoed == request_id, f"metadata request_id={echoed!r}, expected {request_id!r}")
    return f"{got.name} {info.reason}"


class Kit:
    """The checks, against one tokenizer (and optionally its scheduler)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.results: list[Result] = []
        channel_options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self._channels: list[grpc.Channel] = []
        self.tokenizer = self._channel(options.tokenizer, channel_options)
        self.tok = tokenizer_pb2_grpc.TokenizerServiceStub(self.tokenizer)
        self.scheduler = self._channel(options.scheduler, channel_options) if options.scheduler else None
        self.sched = scheduler_pb2_grpc.SchedulerServiceStub(self.scheduler) if self.scheduler else None
        # Without a token given, a scheduler of this host on loopback is
        # called with its local token, as its own user's clients do.
        self.sched_metadata = (
            (("authorization", f"Bearer {options.scheduler_token}"),)
            if options.scheduler_token
            else localauth.LocalToken(options.scheduler).metadata()
            if options.scheduler
            else ()
        )

    def _channel(self, target: str, channel_options: list[tuple[str, Any]]) -> grpc.Channel:
        if self.options.credentials is not None:
            channel = grpc.secure_channel(target, self.options.credentials, options=channel_options)
        else:
            channel = grpc.insecure_channel(target, options=channel_options)
        self._channels.append(channel)
        return channel

    def unreachable(self) -> str:
        """Why the servers cannot be reached at all ("" when each answers
        its health service, whatever it says): every check would fail with
        the same transport error, so the command says it once instead."""
        targets = [("--tokenizer", self.options.tokenizer, self.tokenizer)]
        if self.scheduler is not None:
            targets.append(("--scheduler", self.options.scheduler, self.scheduler))
        for flag, target, channel in targets:
            try:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self.options.timeout_s
                )
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):  # type: ignore[attr-defined]
                    details = exc.details() or ""  # type: ignore[attr-defined]
                    code = exc.code().name  # type: ignore[attr-defined]
                    return f"{flag} {target}: cannot be reached: {code}: {details}{transport_hint(details)}"
        return ""

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    # ---- running ----
    def run(self, name: str, check: Callable[[], str | None]) -> None:
        self.results.append(run_check(name, check, _describe_rpc_error))

    def all(self) -> list[Result]:
        checks: list[tuple[str, Callable[[], str | None]]] = [
            *self._common_checks("tokenizer", self.tokenizer, TOKENIZER_SERVICE),
            ("tokenizer.server_info", self.tokenizer_server_info),
            ("tokenizer.stream.events", self.tokenizer_stream),
            ("tokenizer.stream.image", self.tokenizer_image),
            ("tokenizer.tokenize", self.tokenizer_tokenize),
            ("tokenizer.stream.prompt_tokens", self.tokenizer_prompt_tokens),
            ("tokenizer.stream.prompt_logprobs", self.tokenizer_prompt_logprobs),
            ("tokenizer.stream.request_id_assigned", self.tokenizer_request_id),
            ("tokenizer.stream.json_schema", self.tokenizer_json_schema),
            ("tokenizer.stream.choice", self.tokenizer_choice),
            ("tokenizer.stream.split_reasoning", self.tokenizer_split_reasoning),
            *[(f"tokenizer.error.{label}", self._tokenizer_error(code, build)) for label, code, build in CLIENT_ERRORS],
            ("tokenizer.error.MEDIA_NOT_FOUND", self.tokenizer_not_found),
            ("tokenizer.error.INVALID_REQUEST(image_budget past the model's)", self.tokenizer_image_budget),
            ("tokenizer.unknown_fields", self.tokenizer_unknown_fields),
            ("tokenizer.cancel_propagates", lambda: self.tokenizer_ends_early(cancel=True)),
            ("tokenizer.deadline_propagates", lambda: self.tokenizer_ends_early(cancel=False)),
        ]
        if self.scheduler is not None:
            checks += [
                *self._common_checks("scheduler", self.scheduler, SCHEDULER_SERVICE, self.sched_metadata),
                ("scheduler.server_info", self.scheduler_server_info),
                ("scheduler.stream.events", self.scheduler_stream),
                ("scheduler.generate_stream.events", self.scheduler_generate_stream),
                (
                    "scheduler.error.INVALID_REQUEST(no input ids)",
                    self._scheduler_error(lambda r: r.ClearField("input_ids")),
                ),
                ("scheduler.error.INVALID_REQUEST(token id outside the vocabulary)", self._scheduler_error(_huge_id)),
                (
                    "scheduler.error.INVALID_REQUEST(an item that fits neither its tensor nor the prompt)",
                    self._scheduler_error(_bad_tensor),
                ),
                ("scheduler.unknown_fields", self.scheduler_unknown_fields),
                ("scheduler.cancel_propagates", lambda: self.scheduler_ends_early(cancel=True)),
                ("scheduler.deadline_propagates", lambda: self.scheduler_ends_early(cancel=False)),
            ]
        checks.append(("tokenizer.serving_after_all", self.still_serving))
        for name, check in checks:
            self.run(name, check)
        return self.results

    # ---- both services ----
    def _common_checks(
        self, label: str, channel: grpc.Channel, service: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> list[tuple[str, Callable[[], str | None]]]:
        def live() -> str:
            return self._health(channel, "")

        def ready() -> str:
            return self._health(channel, service)

        def unknown() -> str:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="no.such.v1.Service"), timeout=10)
            except grpc.RpcError as exc:
                expect(exc.code() == grpc.StatusCode.NOT_FOUND, f"{exc.code().name}, expected NOT_FOUND")
                return "NOT_FOUND"
            raise Failed(
                f"answered {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}, expected NOT_FOUND"
            )

        def listed() -> str:
            # As grpcurl and buf curl do: v1 first, v1alpha where v1 is not served.
            for reflection_service in (REFLECTION_V1, REFLECTION_SERVICE):
                ask = channel.stream_stream(
                    f"/{reflection_service}/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                try:
                    replies = list(ask(iter([request]), timeout=10, metadata=metadata))
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED and reflection_service == REFLECTION_V1:
                        continue
                    raise
                names = {s.name for reply in replies for s in reply.list_services_response.service}
                missing = {service, HEALTH_SERVICE, reflection_service} - names
                expect(not missing, f"reflection does not list {sorted(missing)} (lists {sorted(names)})")
                return ", ".join(sorted(names))
            raise AssertionError("unreachable: v1alpha either answers or raises")

        return [
            (f"{label}.health.live", live),
            (f"{label}.health.ready", ready),
            (f"{label}.health.unknown_service", unknown),
            (f"{label}.reflection", listed),
        ]

    def _health(self, channel: grpc.Channel, service: str) -> str:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        expect(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{service or '(live)'} is {status}")
        return f"{service or '(empty name)'}: {status}"

    # ---- tokenizer ----
    def _generate(self, request: tokenizer_pb2.GenerateRequest, timeout: float | None = None) -> list[Any]:
        return list(self.tok.Generate(request, timeout=timeout or self.options.timeout_s))

    def tokenizer_server_info(self) -> str:
        reply = self.tok.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=10)
        info, sched = reply.info, reply.scheduler
        expect(bool(info.model), "info.model is empty")
        expect(bool(info.version), "info.version is empty")
        expect(info.tp_size == 1, f"info.tp_size is {info.tp_size}; a tokenizer reports 1")
        expect(reply.transport != common_pb2.TRANSPORT_UNSPECIFIED, "transport is UNSPECIFIED")
        expect(reply.HasField("scheduler"), "no scheduler info")
        expect(sched.tp_size >= 1, f"scheduler.tp_size is {sched.tp_size}")
        expect(reply.transport in sched.transports, "the transport in use is not one the scheduler offers")
        differ = Pairing.of(info).differences(Pairing.of(sched))
        expect(not differ, f"the tokenizer uses a scheduler of another {' and '.join(differ)}")
        return f"model={info.model} transport={common_pb2.Transport.Name(reply.transport)} scheduler tp={sched.tp_size}"

    def tokenizer_stream(self) -> str:
        rid = _request_id()
        events = self._generate(_text_request(rid, tokens=4))
        expect(bool(events), "no events")
        kinds = [e.WhichOneof("event") for e in events]
        expect(
            kinds[-1] == "finished" and kinds.count("finished") == 1, f"events {kinds}: not deltas then one Finished"
        )
        expect(all(e.request_id == rid for e in events), "an event without the request's id")
        done = events[-1].finished
        streamed = sum(len(e.delta.token_ids) for e in events[:-1])
        expect(done.completion_tokens == 4, f"completion_tokens {done.completion_tokens} with min = max = 4")
        expect(
            streamed == done.completion_tokens, f"{streamed} token ids streamed, Finished says {done.completion_tokens}"
        )
        expect(done.finish_reason == common_pb2.FINISH_REASON_LENGTH, "finish_reason is not LENGTH at max_tokens")
        expect(done.prompt_tokens > 0, "prompt_tokens is 0")
        return f"{len(events) - 1} deltas, then Finished(LENGTH, {done.prompt_tokens}+{done.completion_tokens})"

    def tokenizer_image(self) -> str:
        text = self._generate(_text_request(_request_id(), tokens=1))[-1].finished
        request = _text_request(_request_id(), tokens=1)
        request.images.add(data=png())
        events = self._generate(request)
        expect(events[-1].WhichOneof("event") == "finished", "no Finished for an image request")
        with_image = events[-1].finished.prompt_tokens
        expect(
            with_image > text.prompt_tokens, f"an image added no prompt tokens ({with_image} vs {text.prompt_tokens})"
        )
        return f"prompt tokens {text.prompt_tokens} -> {with_image} with one image"

    def tokenizer_prompt_logprobs(self) -> str:
        """A text prompt's ids (Tokenize) sent back as prompt_token_ids with
        prompt_logprobs: the same prompt, scored before the first delta."""
        text = _text_request(_request_id(), tokens=1)
        ids = list(
            self.tok.Tokenize(tokenizer_pb2.TokenizeRequest(request=text), timeout=self.options.timeout_s).token_ids
        )
        request = tokenizer_pb2.GenerateRequest(request_id=_request_id(), prompt_token_ids=ids)
        request.sampling.max_tokens, request.sampling.prompt_logprobs = 1, 2
        events = self._generate(request)
        kinds = [e.WhichOneof("event") for e in events]
        expect(kinds[:1] == ["prompt_logprobs"], f"events {kinds}: no PromptLogprobs first")
        expect(kinds[-1] == "finished", "no Finished")
        scored = events[0].prompt_logprobs
        expect(list(scored.token_ids) == ids, "PromptLogprobs.token_ids are not the prompt sent")
        expect(len(scored.logprobs) == len(ids) - 1, f"{len(scored.logprobs)} logprobs for {len(ids)} prompt tokens")
        for lp in scored.logprobs:
            expect(lp.logprob <= 0 and lp.rank >= 1, f"logprob {lp.logprob}, rank {lp.rank}")
            expect(len(lp.top_token_ids) == len(lp.top_logprobs) == 2, "not 2 top tokens per position")
            expect((lp.rank == 1) == (lp.logprob >= lp.top_logprobs[0]), "rank 1 and the top token disagree")
        expect(events[-1].finished.prompt_tokens == len(ids), "Finished.prompt_tokens is not the ids sent")
        return f"{len(ids)} prompt ids scored"

    def tokenizer_tokenize(self) -> str:
        request = _text_request(_request_id(), tokens=1)
        request.images.add(data=png())
        counted = self.tok.Tokenize(tokenizer_pb2.TokenizeRequest(request=request), timeout=self.options.timeout_s)
        events = self._generate(request)
        expect(events[-1].WhichOneof("event") == "finished", "no Finished for the request tokenized")
        prompt = events[-1].finished.prompt_tokens
        expect(len(counted.token_ids) == prompt, f"{len(counted.token_ids)} ids; Generate reports {prompt}")
        expect(
            counted.max_context_tokens > prompt, f"max_context_tokens {counted.max_context_tokens} for {prompt} tokens"
        )
        return f"{prompt} ids, context {counted.max_context_tokens}"

    def tokenizer_prompt_tokens(self) -> str:
        """return_prompt_token_ids: a PromptTokens event first, of the ids Tokenize gives."""
        request = _text_request(_request_id(), tokens=1)
        request.images.add(data=png())
        counted = self.tok.Tokenize(tokenizer_pb2.TokenizeRequest(request=request), timeout=self.options.timeout_s)
        request.return_prompt_token_ids = True
        events = self._generate(request)
        kinds = [e.WhichOneof("event") for e in events]
        expect(kinds[0] == "prompt_tokens" and kinds.count("prompt_tokens") == 1, f"events {kinds}")
        expect(list(events[0].prompt_tokens.token_ids) == list(counted.token_ids), "not the ids Tokenize gives")
        return f"{len(counted.token_ids)} ids"

    def tokenizer_json_schema(self) -> str:
        """Structured output: the answer is a document of the schema, ended by the server (STOP)."""
        request = _text_request(_request_id(), tokens=64)
        request.sampling.min_tokens = 0
        request.sampling.json_schema = json.dumps(SCHEMA)
        events = self._generate(request)
        expect(events[-1].WhichOneof("event") == "finished", "no Finished")
        text = "".join(e.delta.text for e in events[:-1])
        reason = common_pb2.FinishReason.Name(events[-1].finished.finish_reason)
        expect(events[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP, f"{reason} after {text!r}")
        expect_a_document_of_the_schema(text)
        return text

    def tokenizer_choice(self) -> str:
        """Structured output by `choice`: the answer is one of the strings, ended by the server (STOP)."""
        request = _text_request(_request_id(), tokens=32)
        request.sampling.min_tokens = 0
        request.sampling.choice.extend(CHOICES)
        events = self._generate(request)
        expect(events[-1].WhichOneof("event") == "finished", "no Finished")
        text = "".join(e.delta.text for e in events[:-1])
        reason = common_pb2.FinishReason.Name(events[-1].finished.finish_reason)
        expect(events[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP, f"{reason} after {text!r}")
        expect(text in CHOICES, f"{text!r} is none of {CHOICES}")
        return text

    def tokenizer_split_reasoning(self) -> str:
        """split_reasoning: on a tokenizer that says it has a reasoning
        parser (ServerInfo.reasoning_parser), an answer made (by `choice`)
        to think between <think> tags and then answer has Finished.reasoning
        the thinking and Finished.content the answer; on one that says it
        has none, INVALID_REQUEST. The prompt is as written: no chat
        template opens the thinking."""
        info = self.tok.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=10).info
        rid = _request_id()
        request = _text_request(rid, tokens=32)
        request.prompt_as_written, request.split_reasoning = True, True
        request.sampling.min_tokens = 0
        request.sampling.choice.append(THOUGHT)
        if info.reasoning_parser in ("", "none"):
            said = "says none" if info.reasoning_parser else "does not say (an older server)"
            refused = self._expect_tokenizer_error(request, E.ERROR_CODE_INVALID_REQUEST, rid)
            return f"no reasoning parser ({said}): {refused}"
        events = self._generate(request)
        expect(events[-1].WhichOneof("event") == "finished", "no Finished")
        done = events[-1].finished
        text = "".join(e.delta.text for e in events[:-1])
        expect(text == THOUGHT, f"the deltas are {text!r}, not the one choice {THOUGHT!r} as written")
        expect(
            (done.reasoning, done.content) == ("a b", "c"), f"reasoning {done.reasoning!r}, content {done.content!r}"
        )
        return f"{info.reasoning_parser}: reasoning {done.reasoning!r}, content {done.content!r}"

    def tokenizer_request_id(self) -> str:
        events = self._generate(_text_request("", tokens=2))
        ids = {e.request_id for e in events}
        expect(len(ids) == 1 and "" not in ids, f"request ids on the events: {sorted(ids)}")
        return f"assigned {ids.pop()!r}"

    def _tokenizer_error(self, code: int, build: Callable[[tokenizer_pb2.GenerateRequest], None]) -> Callable[[], str]:
        def check() -> str:
            rid = _request_id()
            request = _text_request(rid, tokens=1)
            build(request)
            return self._expect_tokenizer_error(request, code, rid)

        return check

    def _expect_tokenizer_error(self, request: tokenizer_pb2.GenerateRequest, code: int, rid: str) -> str:
        try:
            events = self._generate(request)
        except grpc.RpcError as exc:
            summary = check_error(exc, code, rid)
        else:
            raise Failed(f"succeeded ({len(events)} events), expected {reason_of(code)}")
        after = self._generate(_text_request(_request_id(), tokens=1))
        expect(after[-1].WhichOneof("event") == "finished", "the next good request did not finish")
        return summary

    def tokenizer_image_budget(self) -> str:
        """A pixel budget over the model's (ServerInfo.image_max_pixels), or
        any for a model without one (0: every image one size)."""
        most = self.tok.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=10).info.image_max_pixels

        def build(request: tokenizer_pb2.GenerateRequest) -> None:
            request.images.add(data=png())
            request.image_budget.max_pixels = most + 1 if most else 1 << 20

        return self._tokenizer_error(E.ERROR_CODE_INVALID_REQUEST, build)()

    def tokenizer_not_found(self) -> str:
        if not self.options.not_found_url:
            raise Skipped("give --not-found-url: a media URL this server may fetch that does not exist")
        rid = _request_id()
        request = _text_request(rid, tokens=1)
        request.images.add(url=self.options.not_found_url)
        return self._expect_tokenizer_error(request, E.ERROR_CODE_MEDIA_NOT_FOUND, rid)

    def tokenizer_unknown_fields(self) -> str:
        method = f"/{TOKENIZER_SERVICE}/Generate"
        call = self.tokenizer.unary_stream(method, request_serializer=None, response_deserializer=None)
        rid = _request_id()
        raw = _text_request(rid, tokens=2).SerializeToString() + UNKNOWN_FIELDS
        events = [tokenizer_pb2.GenerateResponse.FromString(b) for b in call(raw, timeout=self.options.timeout_s)]
        expect(bool(events) and events[-1].WhichOneof("event") == "finished", "no Finished")
        info = self.tokenizer.unary_unary(f"/{TOKENIZER_SERVICE}/GetServerInfo")(UNKNOWN_FIELDS, timeout=10)
        tokenizer_pb2.GetServerInfoResponse.FromString(info)
        return "Generate and GetServerInfo accept fields 1998 and 1999"

    def _scheduler_load(self) -> tuple[int, Callable[[], int]]:
        """The scheduler's running + queued requests now, and a way to read
        them again: from the scheduler when given, else as the tokenizer
        reports it."""

        def read() -> int:
            if self.sched is not None:
                info = self.sched.GetServerInfo(
                    scheduler_pb2.GetServerInfoRequest(), timeout=10, metadata=self.sched_metadata
                ).info
            else:
                info = self.tok.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=10).scheduler
            return info.running_requests + info.queued_requests

        # Requests of earlier checks (or of others) may still be ending: wait
        # a while for an idle scheduler, so the count this check makes shows.
        settle = time.monotonic() + 10.0
        while (now := read()) > 0 and time.monotonic() < settle:
            time.sleep(0.05)
        return now, read

    def _long_tokens(self) -> int:
        """Tokens of the requests that are cut short: --long-tokens, else
        the most the server takes (its max_tokens_limit; served up to the
        context), so that even a small, fast model is still making them
        when they are cut."""
        if self.options.long_tokens > 0:
            return self.options.long_tokens
        answer = self.tok.GetServerInfo(tokenizer_pb2.GetServerInfoRequest(), timeout=10)
        return answer.scheduler.max_tokens_limit or answer.info.max_tokens_limit or FALLBACK_LONG_TOKENS

    def tokenizer_ends_early(self, *, cancel: bool) -> str:
        before, load = self._scheduler_load()
        request = _text_request(_request_id(), tokens=self._long_tokens())
        deadline = None if cancel else 2.0
        call = self.tok.Generate(request, timeout=deadline or self.options.timeout_s)
        return self._ends_early(call, cancel=cancel, before=before, load=load, first="delta")

    def _ends_early(self, call: Any, *, cancel: bool, before: int, load: Callable[[], int], first: str) -> str:
        """Read `call` until its first `first` event, then cancel it (or let
        its deadline pass); the scheduler's load must come back to `before`."""
        events = iter(call)
        try:
            while (event := next(events)).WhichOneof("event") != first:
                expect(event.WhichOneof("event") != "finished", "finished before it could be cut short")
            # Its counts are as of the scheduler's last step: give them a moment.
            counted = time.monotonic() + 5.0
            while (seen := load()) <= before and time.monotonic() < counted:
                time.sleep(0.02)
            where = "" if self.sched is not None else (
                "; read through the tokenizer, whose view of its scheduler is some seconds old:"
                " give --scheduler to read the scheduler itself"
            )  # fmt: skip
            expect(seen > before, f"the scheduler did not count the request while it ran ({seen} vs {before}){where}")
            if cancel:
                call.cancel()
            for event in events:
                expect(
                    event.WhichOneof("event") != "finished",
                    "finished before it could be cut short: raise --long-tokens",
                )
        except grpc.RpcError as exc:
            wanted = grpc.StatusCode.CANCELLED if cancel else grpc.StatusCode.DEADLINE_EXCEEDED
            expect(exc.code() == wanted, f"the call ended {exc.code().name}, expected {wanted.name}")
        else:
            raise Failed("the call ended without an error")
        started = time.monotonic()
        while (now := load()) > before:
            expect(time.monotonic() - started < SETTLE_S, f"scheduler still holds {now - before} after {SETTLE_S:.0f}s")
            time.sleep(0.05)
        return f"scheduler back to {before} within {time.monotonic() - started:.2f}s"

    def still_serving(self) -> str:
        detail = self._health(self.tokenizer, TOKENIZER_SERVICE)
        events = self._generate(_text_request(_request_id(), tokens=1))
        expect(events[-1].WhichOneof("event") == "finished", "a good request did not finish")
        return detail

    # ---- scheduler ----
    def scheduler_server_info(self) -> str:
        assert self.sched is not None
        info = self.sched.GetServerInfo(
            scheduler_pb2.GetServerInfoRequest(), timeout=10, metadata=self.sched_metadata
        ).info
        expect(bool(info.model), "info.model is empty")
        expect(bool(info.version), "info.version is empty")
        expect(info.tp_size >= 1, f"tp_size {info.tp_size}")
        expect(len(info.rank_active_requests) == info.tp_size, "rank_active_requests has not one entry per rank")
        expect(bool(info.transports), "no transports offered")
        expect(common_pb2.TRANSPORT_INLINE in info.transports, "inline transport is not offered")
        expect(info.kv_budget_tokens > 0, "kv_budget_tokens is 0")
        return f"tp={info.tp_size} transports={[common_pb2.Transport.Name(t) for t in info.transports]}"

    def _sched_generate(self, request: scheduler_pb2.GenerateRequest, timeout: float | None = None) -> Any:
        assert self.sched is not None
        return self.sched.Generate(request, timeout=timeout or self.options.timeout_s, metadata=self.sched_metadata)

    def scheduler_stream(self) -> str:
        events = list(self._sched_generate(_scheduler_request(_request_id(), tokens=4)))
        kinds = [e.WhichOneof("event") for e in events]
        expect(kinds[:1] == ["accepted"] and kinds.count("accepted") == 1, f"events {kinds}: not one Accepted first")
        expect(kinds[-1] == "finished" and kinds.count("finished") == 1, f"events {kinds}: not one Finished last")
        done = events[-1].finished
        streamed = sum(len(e.tokens.token_ids) for e in events if e.WhichOneof("event") == "tokens")
        expect(
            done.completion_tokens == 4 == streamed,
            f"{streamed} tokens streamed, Finished says {done.completion_tokens}",
        )
        expect(done.prompt_tokens == 3, f"prompt_tokens {done.prompt_tokens} for 3 input ids")
        return f"Accepted, {len(events) - 2} Tokens, Finished"

    def scheduler_generate_stream(self) -> str:
        """GenerateStream (when the scheduler says it serves it): two good
        requests and a bad one on one call, sent and half-closed at once;
        each request's events as over Generate, the bad one's a single
        RequestFailed, and the call ends OK once they are done."""
        assert self.sched is not None
        info = self.sched.GetServerInfo(
            scheduler_pb2.GetServerInfoRequest(), timeout=10, metadata=self.sched_metadata
        ).info
        if not info.generate_stream:
            raise Skipped("the scheduler does not serve GenerateStream (ServerInfo.generate_stream)")
        good = {_request_id(): 3, _request_id(): 4}
        bad = _scheduler_request(_request_id(), tokens=1)
        _huge_id(bad)
        sent = [scheduler_pb2.GenerateStreamRequest(generate=_scheduler_request(r, tokens=n)) for r, n in good.items()]
        sent.append(scheduler_pb2.GenerateStreamRequest(generate=bad))
        events: dict[str, list[scheduler_pb2.RequestEvent]] = {r: [] for r in [*good, bad.request_id]}
        messages = 0
        call = self.sched.GenerateStream(iter(sent), timeout=self.options.timeout_s, metadata=self.sched_metadata)
        for message in call:
            messages += 1
            ids = [e.request_id for e in message.events if e.WhichOneof("event") == "tokens"]
            expect(len(ids) == len(set(ids)), f"two Tokens events of one request in one message: {ids}")
            for event in message.events:
                expect(event.request_id in events, f"an event of request {event.request_id!r}, not ours")
                events[event.request_id].append(event)
        for rid, tokens in good.items():
            kinds = [e.WhichOneof("event") for e in events[rid]]
            expect(
                kinds[:1] == ["accepted"] and kinds.count("accepted") == 1, f"{rid}: {kinds}: not one Accepted first"
            )
            expect(
                kinds[-1:] == ["finished"] and kinds.count("finished") == 1, f"{rid}: {kinds}: not one Finished last"
            )
            streamed = sum(len(e.tokens.token_ids) for e in events[rid] if e.WhichOneof("event") == "tokens")
            done = events[rid][-1].finished.completion_tokens
            expect(
                streamed == tokens == done, f"{rid}: {streamed} tokens streamed, Finished says {done}, {tokens} asked"
            )
        failed = events[bad.request_id]
        expect(
            [e.WhichOneof("event") for e in failed] == ["failed"],
            f"the bad request's events {[e.WhichOneof('event') for e in failed]}: not one RequestFailed",
        )
        reason = failed[0].failed.reason
        expect(
            reason == reason_of(E.ERROR_CODE_INVALID_REQUEST), f"the bad request failed {reason}, not INVALID_REQUEST"
        )
        return f"3 requests in {messages} messages, the bad one {reason}"

    def _scheduler_error(self, mutate: Callable[[scheduler_pb2.GenerateRequest], None]) -> Callable[[], str]:
        def check() -> str:
            rid = _request_id()
            request = _scheduler_request(rid, tokens=1)
            mutate(request)
            try:
                events = list(self._sched_generate(request))
            except grpc.RpcError as exc:
                return check_error(exc, E.ERROR_CODE_INVALID_REQUEST, rid)
            raise Failed(f"succeeded ({len(events)} events), expected INVALID_REQUEST")

        return check

    def scheduler_unknown_fields(self) -> str:
        assert self.scheduler is not None
        call = self.scheduler.unary_stream(f"/{SCHEDULER_SERVICE}/Generate")
        raw = _scheduler_request(_request_id(), tokens=2).SerializeToString() + UNKNOWN_FIELDS
        replies = call(raw, timeout=self.options.timeout_s, metadata=self.sched_metadata)
        events = [scheduler_pb2.GenerateResponse.FromString(b) for b in replies]
        expect(bool(events) and events[-1].WhichOneof("event") == "finished", "no Finished")
        return "Generate accepts fields 1998 and 1999"

    def scheduler_ends_early(self, *, cancel: bool) -> str:
        before, load = self._scheduler_load()
        request = _scheduler_request(_request_id(), tokens=self._long_tokens())
        call = self._sched_generate(request, timeout=None if cancel else 2.0)
        return self._ends_early(call, cancel=cancel, before=before, load=load, first="tokens")


# Tokens of the requests that are cut short, from a server that does not say its limit.
FALLBACK_LONG_TOKENS = 512

# ---- requests ----
# An answer that thinks, then answers (tokenizer.stream.split_reasoning).
THOUGHT = "<think>a b</think>\n\nc"


def _request_id() -> str:
    return f"conformance-{uuid.uuid4().hex[:12]}"


def _text_request(request_id: str, *, tokens: int) -> tokenizer_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=tokens, min_tokens=tokens)
    return tokenizer_pb2.GenerateRequest(request_id=request_id, prompt="Say something.", sampling=sampling)


def _scheduler_request(request_id: str, *, tokens: int) -> scheduler_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=tokens, min_tokens=tokens)
    return scheduler_pb2.GenerateRequest(request_id=request_id, input_ids=[1, 2, 3], sampling=sampling)


def _huge_id(request: scheduler_pb2.GenerateRequest) -> None:
    request.input_ids.append(2**31)


def _bad_tensor(request: scheduler_pb2.GenerateRequest) -> None:
    # 3 floats of bytes for a [1, 3, 4, 4] tensor: no reader may accept it.
    ref = common_pb2.TensorRef(dtype=common_pb2.DTYPE_FLOAT32, shape=[1, 3, 4, 4], inline=b"\0" * 12)
    item = request.items.add(modality=common_pb2.MODALITY_IMAGE)
    item.tensors["pixel_values"].CopyFrom(ref)
    item.placeholders.add(offset=0, length=1)


def _image(data: bytes = b"", url: str = "") -> Callable[[tokenizer_pb2.GenerateRequest], None]:
    def build(request: tokenizer_pb2.GenerateRequest) -> None:
        request.images.add(**({"url": url} if url else {"data": data}))

    return build


def _sampling(**fields: Any) -> Callable[[tokenizer_pb2.GenerateRequest], None]:
    def build(request: tokenizer_pb2.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(request.sampling, name, value)

    return build


def _truncated_png() -> bytes:
    data = png(640, 480)
    return data[: len(data) // 2]


# (label, the ErrorCode it must get, how to spoil a good request). Each
# input is one the contract (proto comments, DESIGN.md §4) rules out.
CLIENT_ERRORS: Sequence[tuple[str, int, Callable[[tokenizer_pb2.GenerateRequest], None]]] = [
    ("INVALID_REQUEST(temperature NaN)", E.ERROR_CODE_INVALID_REQUEST, _sampling(temperature=math.nan)),
    ("INVALID_REQUEST(top_p 1.5)", E.ERROR_CODE_INVALID_REQUEST, _sampling(top_p=1.5)),
    (
        "INVALID_REQUEST(33 stop token ids)",
        E.ERROR_CODE_INVALID_REQUEST,
        lambda r: r.sampling.stop_token_ids.extend(range(1, 34)),
    ),
    ("INVALID_REQUEST(presence_penalty 3)", E.ERROR_CODE_INVALID_REQUEST, _sampling(presence_penalty=3.0)),
    ("INVALID_REQUEST(65 bad words)", E.ERROR_CODE_INVALID_REQUEST, lambda r: r.sampling.bad_words.extend(["x"] * 65)),
    (
        "INVALID_REQUEST(truncate_prompt_tokens -2)",
        E.ERROR_CODE_INVALID_REQUEST,
        lambda r: setattr(r, "truncate_prompt_tokens", -2),
    ),
    (
        "INVALID_REQUEST(video_budget fps 61)",
        E.ERROR_CODE_INVALID_REQUEST,
        lambda r: r.video_budget.CopyFrom(tokenizer_pb2.VideoBudget(fps=61.0)),
    ),
    (
        "INVALID_REQUEST(json_schema not a schema)",
        E.ERROR_CODE_INVALID_REQUEST,
        _sampling(min_tokens=0, json_schema="[1]"),
    ),
    ("INVALID_REQUEST(data: URL not base64)", E.ERROR_CODE_INVALID_REQUEST, _image(url="data:image/png;base64,***")),
    ("MEDIA_DECODE_FAILED(truncated PNG)", E.ERROR_CODE_MEDIA_DECODE_FAILED, lambda r: _image(_truncated_png())(r)),
    (
        "MEDIA_UNSUPPORTED(a PDF)",
        E.ERROR_CODE_MEDIA_UNSUPPORTED,
        _image(b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF"),
    ),
    (
        "MEDIA_TOO_LARGE(header claims 100000x100000)",
        E.ERROR_CODE_MEDIA_TOO_LARGE,
        lambda r: _image(png_claiming(100_000, 100_000))(r),
    ),
    (
        "MEDIA_SOURCE_FORBIDDEN(ftp:// URL)",
        E.ERROR_CODE_MEDIA_SOURCE_FORBIDDEN,
        _image(url="ftp://example.invalid/cat.png"),
    ),
    (
        "MEDIA_SOURCE_FORBIDDEN(link-local metadata address)",
        E.ERROR_CODE_MEDIA_SOURCE_FORBIDDEN,
        _image(url="http://169.254.169.254/latest/meta-data/"),
    ),
]


# ---- the command ----
def _describe_rpc_error(exc: Exception) -> str | None:
    if isinstance(exc, grpc.RpcError):
        return f"unexpected {exc.code().name}: {exc.details()!r}"  # type: ignore[attr-defined]
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, help="tokenizer service address HOST:PORT")
    p.add_argument(
        "--scheduler", default="", help="scheduler service address HOST:PORT (its checks are skipped without it)"
    )
    p.add_argument("--not-found-url", default="", help="an image URL the server may fetch that does not exist")
    p.add_argument(
        "--long-tokens",
        type=int,
        default=0,
        help="tokens of the requests that are cut short (default: the server's max_tokens_limit, up to its context)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of each call, seconds")
    p.add_argument("--tls-ca", default="", help="PEM CA certificates: connect with TLS, trusting them")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, when the servers require one")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--scheduler-token-file", default="", help="file holding the token the scheduler requires")
    p.add_argument(
        "--http", default="", help="base URL of the OpenAI-compatible API (http://HOST:PORT/v1) to check too"
    )
    p.add_argument("--api-key-file", default="", help="file holding the HTTP API's key, when it requires one")


def run_command(args: argparse.Namespace) -> int:
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    credentials = None
    if args.tls_ca:
        credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    token = read_secret(args.scheduler_token_file) if args.scheduler_token_file else ""
    options = Options(
        tokenizer=args.tokenizer,
        scheduler=args.scheduler,
        not_found_url=args.not_found_url,
        timeout_s=args.timeout,
        long_tokens=args.long_tokens,
        credentials=credentials,
        scheduler_token=token,
    )
    kit = Kit(options)
    try:
        unreachable = kit.unreachable()
        if unreachable:
            print(f"mmsplit conformance: {unreachable}", file=sys.stderr)
            return 2
        results = kit.all()
    finally:
        kit.close()
    if args.http:
        from mmsplit.conformance_http import HttpKit

        key = read_secret(args.api_key_file) if args.api_key_file else ""
        results += HttpKit(args.http, key, args.timeout).all()
    print(table(results))
    return 1 if any(r.verdict == "FAIL" for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`mmsplit-conformance` (`python -m mmsplit.conformance`): the kit
    without the server distribution."""
    parser = argparse.ArgumentParser(prog="mmsplit-conformance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
