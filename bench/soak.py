"""Memory over a long mixed load: each service process's resident memory
after every round of requests, and its growth per 1,000 requests from the
second round to the last (the first round warms caches and allocators up)
and over the second half of the run. A leak shows as growth that does not
level off; with both caches off (the default) nothing should grow.

Each round: 10 % corrupt images, 10 % text only with a stop string, 10 %
images never seen before, the rest a rotation of 50 images; every 13th
client leaves after its first token. Every request ends in success, the
corrupt ones' MEDIA_DECODE_FAILED, or the leaver's CANCELLED.

With --http the same load goes through the OpenAI-compatible API and the
official `openai` SDK (a tiny LLaVA with its chat template), chat
completions streamed and not, and adds what only that API has: structured
output with a schema of its own per request (nothing may keep one per
schema), a tool call, beam searches (width 3), and stored Responses API answers, each continued by
`previous_response_id`, then deleted (with --caches only half of them: the
store holds the rest, up to --responses-store-bytes, 64 MiB by default); a
leaver closes its stream after the first chunk.

    python bench/soak.py [--rounds 10] [--per-round 1000] [--tp 2] [--caches] [--http]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, build_model, scratch_dir, table

from mmsplit.errors import RemoteError
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import ServiceProcess, scheduler_args, tokenizer_args
from mmsplit_server.serving import free_port

ROTATION = [samples.encode(samples.gradient(320, 240, seed=i), "JPEG") for i in range(50)]
CORRUPT = samples.good_png(seed=1)[:300]
EXPECTED = {"", "MEDIA_DECODE_FAILED", "CANCELLED"}


def request(i: int) -> tokenizer_pb2.GenerateRequest:
    kind = i % 10
    if kind == 3:
        return make_request("Look.", [CORRUPT], max_tokens=2)
    if kind == 7:
        return make_request("Say something.", max_tokens=4, stop=["e"])
    if kind == 5:
        fresh = samples.encode(samples.gradient(160, 120, seed=100_000 + i), "JPEG")
        return make_request("Look.", [fresh], max_tokens=2)
    return make_request("Look.", [ROTATION[i % len(ROTATION)]], max_tokens=3)


async def one_round(address: str, first: int, count: int, concurrency: int) -> list[str]:
    """Each request's outcome: "" for success, else its reason."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int) -> str:
            async with slots:
                call = stub.Generate(request(i), timeout=120)
                try:
                    async for _ in call:
                        if i % 13 == 0:
                            call.cancel()
                            return "CANCELLED"
                except grpc.aio.AioRpcError as exc:
                    return RemoteError.from_rpc_error(exc).reason
                return ""

        return await asyncio.gather(*(one(i) for i in range(first, first + count)))


def chat_request(i: int) -> dict[str, Any]:
    """Request i of the HTTP load (one that is not `responses_request`): the chat completion's arguments."""
    kind = i % 10
    if kind == 3:
        return {"messages": [_looking(_image_url(CORRUPT))], "max_tokens": 2}
    if kind == 7:
        return {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "stop": ["e"]}
    if kind == 5:
        fresh = samples.encode(samples.gradient(160, 120, seed=100_000 + i), "JPEG")
        return {"messages": [_looking(_image_url(fresh))], "max_tokens": 2}
    if kind == 1:  # a schema no earlier request had
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        form = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        return {"messages": [{"role": "user", "content": "A number."}], "max_tokens": 8, "response_format": form}
    request: dict[str, Any] = {"messages": [_looking(_image_url(ROTATION[i % len(ROTATION)]))], "max_tokens": 3}
    if kind == 2:  # a beam search: a scheduler request per beam and step, each with its own copy of the image
        request |= {"n": 3, "max_tokens": 4, "extra_body": {"use_beam_search": True}}
    if kind == 8:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        request |= {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 8}
    if i % 13 == 0 or (i // 10) % 2:  # every 13th is a leaver: it streams
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    return request


def responses_request(i: int) -> bool:
    """Whether request i of the HTTP load goes to the Responses API."""
    return i % 10 == 9


def _image_url(image: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(image).decode()


def _looking(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": "Look."}, {"type": "image_url", "image_url": {"url": url}}],
    }


async def one_http_round(url: str, model: str, first: int, count: int, concurrency: int, keep: bool) -> list[str]:
    """Each HTTP request's outcome: "" for success, else its reason (the
    error's code). `keep`: half of the stored responses are left in the store."""
    import openai

    api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    slots = asyncio.Semaphore(concurrency)

    async def stored(i: int) -> None:
        content = [{"type": "input_text", "text": "Look."}]
        content.append({"type": "input_image", "image_url": _image_url(ROTATION[i % len(ROTATION)])})
        answer = await api.responses.create(
            model=model, input=[{"role": "user", "content": content}], max_output_tokens=3
        )
        then = await api.responses.create(
            model=model, previous_response_id=answer.id, input="And?", max_output_tokens=2
        )
        if not keep or (i // 10) % 2:
            await api.responses.delete(answer.id)
            await api.responses.delete(then.id)

    async def one(i: int) -> str:
        async with slots:
            try:
                if responses_request(i):
                    await stored(i)
                    return ""
                request = chat_request(i)
                reply = await api.chat.completions.create(model=model, **request)
                if request.get("stream"):
                    async for _ in reply:  # type: ignore[union-attr]
                        if i % 13 == 0:
                            await reply.close()  # type: ignore[union-attr]
                            return "CANCELLED"
                return ""
            except openai.APIStatusError as exc:
                return exc.code or str(exc.status_code)

    try:
        return await asyncio.gather(*(one(i) for i in range(first, first + count)))
    finally:
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--caches", action="store_true", help="keep both caches on (they grow to their bounds)")
    parser.add_argument("--workdir", type=Path, help="where the model and logs go (default: a temporary directory)")
    parser.add_argument("--http", action="store_true", help="through the OpenAI-compatible API and the openai SDK")
    args = parser.parse_args()
    off = [] if args.caches else ["--encoder-cache-bytes", "0", "--prefix-cache-bytes", "0"]
    tok_off = [] if args.caches else ["--preprocess-cache-bytes", "0"]
    http = free_port() if args.http else 0
    if args.http:
        tok_off += ["--http-port", str(http)]
    with scratch_dir(args.workdir) as where:
        if args.http:  # with its chat template: conversations are what the API takes
            from mmsplit_cli.tiny_model import build_once

            model = build_once(where / "model-tiny-chat", cache_dir=ROOT / ".cache")
        else:
            model = build_model("tiny", where)
        sched = ServiceProcess("scheduler", scheduler_args(model, tp=args.tp, extra=off), where / "scheduler.log")
        tok: ServiceProcess | None = None
        try:
            sched.wait_serving("mmsplit.scheduler.v1.SchedulerService", 300)
            tok = ServiceProcess(
                "tokenizer", tokenizer_args(model, sched.address, extra=tok_off), where / "tokenizer.log"
            )
            tok.wait_serving("mmsplit.tokenizer.v1.TokenizerService", 300)
            rank0 = psutil.Process(sched.pid)
            processes = {"tokenizer": psutil.Process(tok.pid), "rank 0": rank0}
            # Ranks 1.. are rank 0's children that name themselves mmsplit-rankN (not the resource tracker).
            ranks = sorted(
                (p for p in rank0.children() if p.name().startswith("mmsplit-rank")), key=psutil.Process.name
            )
            assert len(ranks) == args.tp - 1, [p.name() for p in rank0.children()]
            processes |= {f"rank {r}": p for r, p in enumerate(ranks, 1)}
            rows, resident = [], {name: [] for name in processes}
            seen: Counter[str] = Counter()
            for n in range(args.rounds):
                started = time.monotonic()
                if args.http:
                    round_ = one_http_round(
                        f"http://127.0.0.1:{http}/v1",
                        model.name,
                        n * args.per_round,
                        args.per_round,
                        args.concurrency,
                        keep=args.caches,
                    )
                else:
                    round_ = one_round(tok.address, n * args.per_round, args.per_round, args.concurrency)
                outcomes = asyncio.run(round_)
                seen.update(outcomes)
                unexpected = [o for o in outcomes if o not in EXPECTED]
                if unexpected:
                    raise SystemExit(f"round {n + 1}: unexpected outcomes {sorted(set(unexpected))}")
                for name, process in processes.items():
                    resident[name].append(process.memory_info().rss / 2**20)
                took = time.monotonic() - started
                rows.append([(n + 1) * args.per_round, f"{took:.0f}", *(f"{resident[k][-1]:.0f}" for k in processes)])
        finally:
            if tok is not None:
                tok.stop()
            sched.stop()
    over = "HTTP (openai SDK)" if args.http else "gRPC"
    print(f"{over}, tp={args.tp}, caches {'on' if args.caches else 'off'}, {args.concurrency} clients; resident MiB")
    print(table(["requests", "round s", *processes], rows))
    print("outcomes:", ", ".join(f"{k or 'ok'} {v}" for k, v in sorted(seen.items())))
    if args.rounds >= 4:
        # Growth that levels off (allocators, the KV cache's chunks) is not a
        # leak: the second half of the run shows whether it goes on.
        for label, first in (("round 2", 1), (f"round {args.rounds // 2 + 1}", args.rounds // 2)):
            span = (args.rounds - 1 - first) * args.per_round / 1000
            growth = ", ".join(f"{k} {(v[-1] - v[first]) / span:+.2f}" for k, v in resident.items())
            print(f"growth per 1,000 requests from {label} to the last, MiB: {growth}")


if __name__ == "__main__":
    main()
