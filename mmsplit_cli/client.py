"""A small client of the tokenizer service, used by `mmsplit generate`, the
demo and the tests."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mmsplit.client import (
    Client,
    Delta,
    Event,
    ImagePart,
    Message,
    PromptIds,
    PromptScores,
    RequestFailed,
    VideoPart,
    build_request,
    transport_hint,
)
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc


@dataclass
class Outcome:
    """What one request came to."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    grpc_code: str = ""
    reason: str = ""
    message: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    latency_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens taken from the scheduler's prefix cache
    logprobs: list[float] = field(default_factory=list)  # each token's, when the request asked

    @property
    def ok(self) -> bool:
        return not self.grpc_code


def _text_or_file(value: str) -> str:
    """A flag's text, or the file's named after an "@"."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


def make_request(
    prompt: str,
    images: list[bytes] | None = None,
    *,
    max_tokens: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
    request_id: str = "",
    urls: list[str] | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    stop: list[str] | None = None,
    videos: list[bytes] | None = None,
    **sampling: Any,
) -> tokenizer_pb2.GenerateRequest:
    """`mmsplit.client.build_request`, with images by value and by URL apart
    (`sampling`: its other sampling fields, the penalties and logit_bias)."""
    return build_request(
        prompt,
        images=[*(images or []), *(urls or [])],
        videos=videos or [],
        request_id=request_id,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        min_tokens=min_tokens,
        stop=stop or [],
        stop_token_ids=stop_token_ids or [],
        **sampling,
    )


def run_request(
    stub: tokenizer_pb2_grpc.TokenizerServiceStub, request: tokenizer_pb2.GenerateRequest, timeout: float = 120.0
) -> Outcome:
    out = Outcome(request_id=request.request_id)
    start = time.perf_counter()
    try:
        for event in stub.Generate(request, timeout=timeout):
            out.request_id = event.request_id
            if event.HasField("delta"):
                out.text += event.delta.text
                out.token_ids.extend(event.delta.token_ids)
                out.logprobs.extend(lp.logprob for lp in event.delta.logprobs)
            elif event.HasField("finished"):
                out.finish_reason = common_pb2.FinishReason.Name(event.finished.finish_reason)
                out.cached_tokens = event.finished.cached_tokens
    except grpc.RpcError as exc:
        error = RemoteError.from_rpc_error(exc)
        out.grpc_code = exc.code().name  # type: ignore[attr-defined]
        out.reason, out.message, out.metadata = error.reason, error.message, error.metadata
    out.latency_s = time.perf_counter() - start
    return out


def generate_command(args: argparse.Namespace) -> int:
    """`mmsplit generate`: one request through the client library
    (`mmsplit.client`), its text or one JSON object per event on stdout."""

    if args.beams and args.n > 1:
        print("mmsplit generate: give --n (sampled choices) or --beams (beam search), not both", file=sys.stderr)
        return 2
    if args.length_penalty is not None and not args.beams:
        print("mmsplit generate: --length-penalty applies to beam search only: give --beams", file=sys.stderr)
        return 2

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    client = Client(
        args.server,
        root_certificates=read(args.tls_ca),
        certificate_chain=read(args.tls_cert),
        private_key=read(args.tls_key),
        server_name=args.tls_server_name,
        retries=args.retries,
    )
    try:
        images = [_medium(p) for p in args.image]
        videos = [_medium(p) for p in args.video]
        schema, grammar = (_text_or_file(t) for t in (args.json_schema, args.grammar))
    except OSError as exc:
        print(f"mmsplit generate: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    messages = conversation(args.turns, images, videos)
    # What is asked about, whether generating or counting its tokens.
    asked: dict[str, Any] = {
        "messages": messages,
        "images": [] if messages else images,
        "videos": [] if messages else videos,
        "request_id": args.request_id,
        "timeout": args.timeout,
        "min_pixels": args.min_pixels,
        "max_pixels": args.max_pixels,
        "video_fps": args.video_fps,
        "video_max_frames": args.video_max_frames,
        "truncate_prompt_tokens": args.truncate_prompt_tokens,
    }
    midline = False  # text printed since the last line's end
    with client:
        try:
            if args.tokenize:
                counted = client.tokenize(args.prompt or "", **asked)
                answer = {"count": len(counted.ids), "max_context_tokens": counted.max_context_tokens}
                if args.json:
                    print(json.dumps({**answer, "token_ids": counted.ids}), flush=True)
                else:
                    print(f"{answer['count']} prompt tokens (context {answer['max_context_tokens']})", flush=True)
                return 0
            sampling: dict[str, Any] = dict(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                min_p=args.min_p,
                ignore_eos=args.ignore_eos,
                seed=args.seed,
                min_tokens=args.min_tokens,
                stop=args.stop,
                stop_token_ids=args.stop_token_id,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty,
                logit_bias=dict(args.logit_bias),
                allowed_token_ids=args.allowed_token_id,
                bad_words=args.bad_word,
                priority=args.priority,
                json_schema=schema,
                regex=args.regex,
                choice=args.choice,
                grammar=grammar,
                prompt_logprobs=args.prompt_logprobs,
            )
            if args.beams or args.n > 1:
                found = (
                    client.beam_search(
                        args.prompt or "", width=args.beams, length_penalty=args.length_penalty, **asked, **sampling
                    )
                    if args.beams
                    else client.choices(args.prompt or "", n=args.n, **asked, **sampling)
                )
                for i, beam in enumerate(found):
                    if args.json:
                        said = {"index": i, "text": beam.text, "token_ids": beam.token_ids}
                        said |= {"finish_reason": beam.finish_reason, "completion_tokens": beam.completion_tokens}
                        print(json.dumps(said), flush=True)
                    else:
                        print(f"[{i}] {beam.text}", flush=True)
                return 0
            events = client.generate(args.prompt or "", **asked, **sampling)
            try:
                for event in events:
                    if args.json:
                        print(json.dumps(_event_json(event)), flush=True)
                    else:
                        print(event.text, end="", flush=True)
                        midline = bool(event.text) and not event.text.endswith("\n")
                if not args.json:
                    print()
            except BrokenPipeError:  # `| head` has read what it wanted: not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
        except RequestFailed as exc:
            error = {"code": exc.grpc_code, "reason": exc.reason, "message": exc.message, "retriable": exc.retriable}
            if args.json:
                print(json.dumps({"request_id": exc.request_id, "error": error}), flush=True)
            else:
                if midline:  # the error on a line of its own
                    print(flush=True)
                # A typed error names its reason; one without (the transport's) names the server.
                what = (
                    f"{args.server}: {exc.grpc_code}"
                    if exc.reason == exc.grpc_code
                    else f"{exc.reason} ({exc.grpc_code})"
                )
                hint = transport_hint(exc.message) if exc.reason == exc.grpc_code else ""
                if exc.grpc_code == "UNAUTHENTICATED":  # a tokenizer's gRPC port asks for no token; a scheduler's does
                    hint = f" ({SCHEDULER_PORT_HINT})"
                print(f"mmsplit generate: {what}: {exc.message}{hint}", file=sys.stderr)
            return 2
    return 0


SCHEDULER_PORT_HINT = "a scheduler's port? mmsplit generate talks to a tokenizer: give its --port, 50052 by default"


def _medium(given: str) -> bytes | str:
    """A file's bytes, or a URL as it is (the server fetches it)."""
    if given.startswith(("http://", "https://", "data:")):
        return given
    return Path(given).read_bytes()


def conversation(turns: list[tuple[str, str]], images: list[bytes | str], videos: list[bytes | str]) -> list[Message]:
    """`--system`/`--user`/`--assistant` turns in the order given; the
    `--image` and `--video` files go to the last user turn, before its text."""
    messages: list[Message] = [(role, text) for role, text in turns]
    if not messages:
        return []
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None:
        print("mmsplit generate: a conversation needs at least one --user turn", file=sys.stderr)
        raise SystemExit(2)
    parts: list[str | ImagePart | VideoPart] = [ImagePart(b) for b in images]
    parts += [VideoPart(b) for b in videos]
    messages[last_user] = ("user", [*parts, turns[last_user][1]])
    return messages


def _event_json(event: Event) -> dict[str, object]:
    if isinstance(event, PromptIds):
        return {"request_id": event.request_id, "prompt_token_ids": list(event.token_ids)}
    if isinstance(event, Delta):
        return {"request_id": event.request_id, "text": event.text, "token_ids": list(event.token_ids)}
    if isinstance(event, PromptScores):
        top = [{str(t): v for t, v in best.items()} for best in event.top]
        scored = {"token_ids": list(event.token_ids), "logprobs": list(event.logprobs), "ranks": list(event.ranks)}
        return {"request_id": event.request_id, "prompt": {**scored, "top_logprobs": top}}
    return {
        "request_id": event.request_id,
        "finished": {
            "finish_reason": event.finish_reason,
            "prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
            "cached_tokens": event.cached_tokens,
        },
    }


def info_command(args: argparse.Namespace) -> int:
    """`mmsplit info`: a server's GetServerInfo as JSON (a tokenizer's, else a scheduler's)."""
    from google.protobuf.json_format import MessageToJson

    from mmsplit import localauth
    from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    # A scheduler of this host on loopback asks for its local token (mmsplit.localauth).
    metadata = localauth.LocalToken(args.server).metadata()
    with grpc.insecure_channel(args.server) as channel:
        asks = [
            (tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetServerInfo, tokenizer_pb2.GetServerInfoRequest()),
            (scheduler_pb2_grpc.SchedulerServiceStub(channel).GetServerInfo, scheduler_pb2.GetServerInfoRequest()),
        ]
        for call, request in asks:
            try:
                reply = call(request, timeout=args.timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    continue
                details = exc.details() or ""  # type: ignore[attr-defined]
                said = f"{exc.code().name}: {details}{transport_hint(details)}"  # type: ignore[attr-defined]
                print(f"mmsplit info: {args.server}: {said}", file=sys.stderr)
                return 1
            print(MessageToJson(reply, indent=2))
            return 0
    print(f"mmsplit info: {args.server} serves neither the tokenizer nor the scheduler service", file=sys.stderr)
    return 1


def health_command(args: argparse.Namespace) -> int:
    """`mmsplit health`: live ("") and ready (each service the server has)
    per grpc.health.v1; exit 0 when it is live and ready, else 1."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mmsplit_cli.launch import SCHEDULER_SERVICE, TOKENIZER_SERVICE

    statuses: dict[str, str] = {}
    failed = ""  # what the connection's failure means, when it failed
    with grpc.insecure_channel(args.server) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", TOKENIZER_SERVICE, SCHEDULER_SERVICE):
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=args.timeout)
                statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    continue  # not this server's service
                statuses[service] = exc.code().name  # type: ignore[attr-defined]
                failed = failed or transport_hint(exc.details() or "")  # type: ignore[attr-defined]
    for service, status in statuses.items():
        print(f"{service or '(live)'}: {status}")
    if failed:
        print(f"mmsplit health: {args.server}: {failed.strip(' ()')}", file=sys.stderr)
    return 0 if statuses and all(s == "SERVING" for s in statuses.values()) else 1
