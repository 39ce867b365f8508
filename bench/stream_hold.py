"""What the tokenizer holds for each HTTP stream in flight whose request
carried a big data: URL, once the image is preprocessed.

One service pair (TP=1, the tiny LLaVA with its family's chat template and
8,192 positions, so that a stream runs thousands of tokens), its tokenizer
giving its heaps' free memory back past 1 MiB (`--heap-free-limit-bytes`:
what is left resident is memory in use) and its preprocessing cache off
(it keeps tensors by design). Each round opens N chat completion streams
at once, each with one new image as a data: URL (an uncompressed PNG of
random pixels, --image-mb), then the same N streams with the text alone;
each stream asks for --tokens tokens. Once every stream has its first
chunk, and --settle-s after it (past the watch's 10 s between trims), the
tokenizer's anonymous memory is read from /proc/PID/smaps_rollup (the
slab's shared pages are not in it) while every stream is still running
(a round whose streams ended first fails: raise --tokens).

Printed per round: the anonymous MB with images and with text alone, and
what each stream with an image held beyond its text-only twin, in MB and
as a multiple of its body (the base64 of its image).

`--api grpc`: the same streams through gRPC's Generate, each image's PNG
by value in the request (its body: the PNG's bytes).

`--inline`: each service in a mount namespace with a /dev/shm of its own
(root only), as pods that share none: the tensors go inline, in the
scheduler request's message, and the scheduler's rank (TP=1) is read too,
its per-stream figure in MB and as a multiple of the image's tensor. What the image needs
once preprocessed is its tensor, in the slab: 0 is the floor. Before the
handler read bodies itself (aiohttp's `request.read()` keeps them on the
request for as long as it lives) and dropped the parsed body before
streaming, ~3 bodies a stream; before the request was handed over (the
service keeping it without its media once prepared), ~1 over HTTP and 2
over gRPC (docs/benchmarks.md).

    python bench/stream_hold.py [--streams 16] [--tokens 4000] [--image-mb 7] [--rounds 2] [--n 1] [--model DIR]
                                [--inline] [--api grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODELS_DIR, ROOT, scratch_dir, table
from mmsplit.client import build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.launch import FreePort, running_pair
from mmsplit_cli.tiny_model import build_once

CONTEXT = 8192
# --inline: each service in a mount namespace with a /dev/shm of its own (root only).
OWN_DEV_SHM = [sys.executable, "-m", "tests.support.mountns", "64m"]
# The tiny LLaVA's model input for one image: 3 x 336 x 336 float32.
TENSOR_MB = 3 * 336 * 336 * 4 / 2**20


def data_url(mb: float, seed: int) -> str:
    side = int((mb * 1e6 / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def anonymous_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Anonymous in /proc/{pid}/smaps_rollup")


# Room for the gRPC arm's images by value.
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]


async def held_mb(
    address: str,
    model: str,
    pids: list[int],
    urls: list[str | None],
    tokens: int,
    settle_s: float,
    n: int = 1,
    api: str = "http",
) -> list[float]:
    """The anonymous MB of each of `pids` `settle_s` after one stream per
    entry of `urls` (an image's data: URL, or None: text alone) has its
    first chunk, every one of them still running; then they are read to
    their end. `api` "grpc": `address` is the tokenizer's gRPC one, and
    each image goes by value."""
    first = asyncio.Event()
    started, streaming = [0], len(urls)

    def began() -> None:
        started[0] += 1
        if started[0] == streaming:
            first.set()

    async def over_grpc(stub: tokenizer_pb2_grpc.TokenizerServiceStub, i: int, url: str | None) -> None:
        images = [base64.b64decode(url.split(",", 1)[1])] if url is not None else []
        request = build_request(f"Describe picture {i}.", images=images, max_tokens=tokens, min_tokens=tokens)
        request.n = n
        del images
        counted = False
        async for _ in stub.Generate(request, timeout=600):
            if not counted:
                counted = True
                began()

    async def one(session: aiohttp.ClientSession, i: int, url: str | None) -> None:
        content: list[dict[str, object]] = [{"type": "text", "text": f"Describe picture {i}."}]
        if url is not None:
            content.append({"type": "image_url", "image_url": {"url": url}})
        body = {
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "min_tokens": tokens, "stream": True, "n": n,
        }  # fmt: skip
        async with session.post(f"http://{address}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"stream {i}: HTTP {response.status}: {await response.text()}")
            counted = False
            async for line in response.content:
                if not counted and line.startswith(b"data:"):
                    counted = True
                    began()

    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel,
    ):
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        streams = [
            asyncio.ensure_future(over_grpc(stub, i, url) if api == "grpc" else one(session, i, url))
            for i, url in enumerate(urls)
        ]
        del urls[:]  # the requests hold them now
        waiting = asyncio.ensure_future(first.wait())
        await asyncio.wait([waiting, *streams], return_when=asyncio.FIRST_COMPLETED)
        for stream in streams:
            if stream.done():
                stream.result()  # its error, if it failed
        await asyncio.sleep(settle_s)
        mb = [anonymous_mb(pid) for pid in pids]
        for stream in streams:
            if stream.done():
                stream.result()  # its error, if it failed
        if any(stream.done() for stream in streams):
            raise RuntimeError(f"streams ended before the reading at {settle_s:g} s: raise --tokens")
        await asyncio.gather(*streams)
    return mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4000, help="tokens each stream makes (at most 4,096)")
    parser.add_argument("--image-mb", type=float, default=7.0, help="size of each image (base64 is 4/3 of it)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n", type=int, default=1, help="choices each stream asks for (n)")
    parser.add_argument("--settle-s", type=float, default=13.0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and the logs go")
    parser.add_argument("--model", type=Path, default=None, help="this model (with a chat template) instead")
    parser.add_argument("--inline", action="store_true", help="the tensors inline (each service's own /dev/shm)")
    parser.add_argument("--api", choices=("http", "grpc"), default="http", help="how the streams are sent")
    args = parser.parse_args()
    with scratch_dir(args.workdir) as workdir:
        kept = Path(os.environ[MODELS_DIR]) if os.environ.get(MODELS_DIR) else workdir
        model = args.model or build_once(
            kept / "model-tiny-chat-8k", cache_dir=ROOT / ".cache", chat_template=True, max_positions=CONTEXT
        )
        http = FreePort()
        extra: list[str | FreePort] = [
            "--http-port",
            http,
            "--heap-free-limit-bytes",
            str(1 << 20),
            "--preprocess-cache-bytes",
            "0",
        ]
        rows = []
        wrapper = OWN_DEV_SHM if args.inline else []
        scheduler_extra = ["--heap-free-limit-bytes", str(1 << 20), "--encoder-cache-bytes", "0"] if args.inline else []
        with running_pair(
            model, workdir, tp=1, tokenizer_extra=extra, scheduler_extra=scheduler_extra, wrapper=wrapper
        ) as pair:
            address = pair.tokenizer_address if args.api == "grpc" else f"127.0.0.1:{http.number}"
            pids = [pair.tokenizer.pid, *([pair.scheduler.pid] if args.inline else [])]
            for r in range(args.rounds):
                urls: list[str | None] = [
                    data_url(args.image_mb, seed=r * args.streams + i) for i in range(args.streams)
                ]
                body_mb = len(urls[0] or "") / 2**20 * (3 / 4 if args.api == "grpc" else 1)
                began = time.monotonic()
                hold = (model.name, pids)
                images = asyncio.run(held_mb(address, *hold, urls, args.tokens, args.settle_s, args.n, args.api))
                nothing: list[str | None] = [None] * args.streams
                text = asyncio.run(held_mb(address, *hold, nothing, args.tokens, args.settle_s, args.n, args.api))
                each = [(i - t) / args.streams for i, t in zip(images, text, strict=True)]
                row = [r + 1, f"{images[0]:.0f}", f"{text[0]:.0f}", f"{each[0]:.1f}", f"{each[0] / body_mb:.2f}"]
                if args.inline:
                    row += [f"{images[1]:.0f}", f"{text[1]:.0f}", f"{each[1]:.1f}", f"{each[1] / TENSOR_MB:.2f}"]
                rows.append(row)
                print(f"round {r + 1} took {time.monotonic() - began:.0f}s", flush=True)
        how = "inline (each service's own /dev/shm)" if args.inline else "in shared memory"
        what = f"gRPC streams ({args.n} x {args.tokens} tokens) at once, each with one {body_mb:.1f} MB PNG by value"
        if args.api == "http":
            what = (
                f"chat streams of {args.n} x {args.tokens} tokens at once, each with one {body_mb:.1f} MB data: URL "
                "(base64)"
            )
        print(
            f"\n{args.streams} {what}, against the same streams with text alone, tensors {how}; "
            f"anonymous memory {args.settle_s:g} s after the last stream's first chunk"
        )
        head = ["round", "tokenizer MB, images", "text alone", "MB held a stream", "/ its body"]
        if args.inline:
            head += ["scheduler MB, images", "text alone", "MB held a stream", f"/ its tensor ({TENSOR_MB:.2f} MB)"]
        print(table(head, rows))


if __name__ == "__main__":
    main()
