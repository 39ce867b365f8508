"""The tokenizer's resident memory under requests with big data: URLs, its
heaps' free memory given back past `--heap-free-limit-bytes` (the default)
against never given back (`--heap-free-limit-bytes 0`).

Two service pairs run at once (TP=1, the tiny LLaVA), one per arm. Each
round sends each arm the same requests through the OpenAI-compatible API,
C at a time: chat completions of one image as a data: URL of a few MB (an
uncompressed PNG of random pixels), half of them valid images and half the
same size of base64 that is not (answered 400: a client's mistake costs
the server the same body). Then it waits past the watch's interval (the
free memory is given back at most every 10 s, checked every 2 s) and reads
each tokenizer's resident memory from /proc/PID/smaps_rollup (walked page
by page: the kernel's running counters can lag a thread that gave memory
back). The arms alternate which goes first each round.

`--api grpc`: the same images through gRPC's Generate, by value (the
invalid half: bytes that are no image, failed by the CPU workers); a
failed call's frames once stayed in reference cycles with its request's
bytes until a full collection (docs/development.md).

Printed per round: both tokenizers' resident MB and their ratio, and each
one's MB at rest before the first round.

`--service scheduler`: the same for the scheduler (rank 0 at TP=1), its
heaps' free memory given back in its idle steps past its own
`--heap-free-limit-bytes` against never. The model is the tiny Qwen2-VL
with 8,192 positions and a 1920x1092 pixel budget, so each request's image,
a new 1920x1080 JPEG of random pixels, is ~5,300 patches (a ~50 MB model
input in float32) and ~2,600 prompt tokens; the tensors inline (each
service in a mount namespace with a /dev/shm of its own: run as root), and
both caches off in both arms (they fill toward their own bounds and would
hide what the heaps keep).

    python bench/heap_bound.py [--rounds 4] [--requests 48] [--concurrency 24] [--image-mb 7] [--api grpc]
    python bench/heap_bound.py --service scheduler [--rounds 4] [--requests 16] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import concurrent.futures
import contextlib
import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import MODELS_DIR, ROOT, build_model, scratch_dir, table
from mmsplit.client import build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli.launch import running_pair
from mmsplit_cli.tiny_model import build_once
from mmsplit_server.serving import free_port

ARMS = {"given back": [], "kept": ["--heap-free-limit-bytes", "0"]}
# The scheduler's part: its caches off in both arms, and each service in a
# mount namespace with a /dev/shm of its own (root only), as in pods that
# share none: the tensors go inline, in gRPC messages the scheduler's heap
# receives. Through shared memory a rank reads them in place: a run with
# 512 MiB slabs held 1,195 MB in both arms, mostly the slab's pages.
CACHES_OFF = ["--encoder-cache-bytes", "0", "--prefix-cache-bytes", "0"]
OWN_DEV_SHM = [sys.executable, "-m", "tests.support.mountns", "256m"]
# A 1920x1080 image whole: the pixel budget of the scheduler's part's model.
BIG_PIXELS = 1920 * 1092
# The watch checks every 2 s and gives memory back at most every 10 s: a round's is back by then.
SETTLE_S = 14.0
# Room for the gRPC part's images by value.
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]


def data_url(seed: int, mb: float, valid: bool) -> str:
    side = int((mb * 1e6 / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    encoded = base64.b64encode(out.getvalue()).decode()
    return "data:image/png;base64," + (encoded if valid else encoded[:-8] + "!" * 8)


def jpeg_url(seed: int, width: int, height: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=30)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def big_image_model(workdir: Path) -> Path:
    """The tiny Qwen2-VL, 8,192 positions, its processor's budget a whole 1920x1080 image."""
    base = Path(os.environ[MODELS_DIR]) if os.environ.get(MODELS_DIR) else workdir
    model = build_once(base / "model-qwen2-vl-1080p", cache_dir=ROOT / ".cache", family="qwen2-vl", max_positions=8192)
    config = model / "preprocessor_config.json"
    processor = json.loads(config.read_text())
    if processor["size"]["longest_edge"] != BIG_PIXELS:  # once, atomically: other runs may read it
        processor["size"]["longest_edge"] = BIG_PIXELS
        written = config.with_suffix(f".{os.getpid()}")
        written.write_text(json.dumps(processor, indent=2))
        written.replace(config)
    return model


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Rss in /proc/{pid}/smaps_rollup")


def image_bytes(url: str) -> bytes:
    """A data: URL's image as bytes for the gRPC API; not base64 (the
    invalid half): bytes of the same size that are no image."""
    encoded = url.partition(",")[2]
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error:
        return np.random.default_rng(len(encoded)).bytes(len(encoded) * 3 // 4)


def send_grpc(stub: tokenizer_pb2_grpc.TokenizerServiceStub, image: bytes, i: int) -> str:
    """One Generate call through the gRPC API, its image by value; its status's name."""
    request = build_request(f"request {i}", images=[image], max_tokens=2)
    try:
        for _ in stub.Generate(request, timeout=300):
            pass
    except grpc.RpcError as failed:
        return str(failed.code().name)
    return "OK"


def send(port: int, model: str, url: str, i: int) -> int:
    body = {
        "model": model,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": f"request {i}"}]}],
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", choices=("tokenizer", "scheduler"), default="tokenizer")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=0, help="requests a round, to each arm (48; scheduler 16)")
    parser.add_argument("--concurrency", type=int, default=0, help="(24; scheduler 8)")
    parser.add_argument("--image-mb", type=float, default=7.0, help="size of each image (base64 is 4/3 of it)")
    parser.add_argument("--distinct", type=int, default=4, help="distinct images a round (valid and not)")
    parser.add_argument("--image-size", default="1920x1080", help="scheduler: each request's new JPEG, WIDTHxHEIGHT")
    parser.add_argument("--model", type=Path, default=None, help="scheduler: this model instead of the one built")
    parser.add_argument(
        "--api",
        choices=("http", "grpc"),
        default="http",
        help="tokenizer: the OpenAI-compatible API or gRPC's Generate",
    )
    parser.add_argument("--settle-s", type=float, default=SETTLE_S, help="wait after each round before reading")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and the logs go")
    args = parser.parse_args()
    scheduler = args.service == "scheduler"
    args.requests = args.requests or (16 if scheduler else 48)
    args.concurrency = args.concurrency or (8 if scheduler else 24)
    width, _, height = args.image_size.partition("x")
    if min(args.rounds, args.requests, args.concurrency, args.distinct) < 1:
        parser.error("--rounds, --requests, --concurrency and --distinct: at least 1")

    with scratch_dir(args.workdir) as workdir, contextlib.ExitStack() as stack:
        model = (args.model or big_image_model(workdir)) if scheduler else build_model("tiny", workdir, chat=True)
        ports, pids, stubs = {}, {}, {}
        for arm, extra in ARMS.items():
            logs = workdir / f"logs-{arm.replace(' ', '-')}"
            logs.mkdir(exist_ok=True)
            ports[arm] = free_port()
            tokenizer = ["--http-port", str(ports[arm]), *([] if scheduler else extra)]
            sched = [*CACHES_OFF, *extra] if scheduler else []
            pair = stack.enter_context(
                running_pair(
                    model,
                    logs,
                    tp=1,
                    scheduler_extra=sched,
                    tokenizer_extra=tokenizer,
                    wrapper=OWN_DEV_SHM if scheduler else (),
                )
            )
            pids[arm] = pair.scheduler.pid if scheduler else pair.tokenizer.pid
            if args.api == "grpc":
                channel = stack.enter_context(grpc.insecure_channel(pair.tokenizer_address, options=GRPC_OPTIONS))
                stubs[arm] = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        at_rest = {arm: resident_mb(pid) for arm, pid in pids.items()}
        rows, answers = [], {arm: {} for arm in ARMS}
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(args.concurrency))
        for r in range(args.rounds):
            urls = (
                [jpeg_url(1000 * r + k, int(width), int(height)) for k in range(args.requests)]  # each new
                if scheduler
                else [data_url(1000 * r + k, args.image_mb, valid=k % 2 == 0) for k in range(args.distinct)]
            )
            images = [image_bytes(url) for url in urls] if args.api == "grpc" else []
            for arm in list(ARMS)[r % 2 :] + list(ARMS)[: r % 2]:
                got = pool.map(
                    (lambda i, a=arm, m=images: send_grpc(stubs[a], m[i % len(m)], i))
                    if args.api == "grpc"
                    else (lambda i, a=arm, u=urls: send(ports[a], model.name, u[i % len(u)], i)),
                    range(args.requests),
                )
                for status in got:
                    answers[arm][status] = answers[arm].get(status, 0) + 1
            time.sleep(args.settle_s)
            mb = {arm: resident_mb(pid) for arm, pid in pids.items()}
            rows.append([r + 1, f"{mb['given back']:.0f}", f"{mb['kept']:.0f}", f"{mb['given back'] / mb['kept']:.2f}"])
    if scheduler:
        print(
            f"the scheduler's resident MB (rank 0, TP=1) {args.settle_s:g} s after each round of {args.requests} "
            f"chat completions, {args.concurrency} at a time, each with a new {args.image_size} JPEG (tiny "
            f"Qwen2-VL, {model.name}), tensors inline, both caches off; its heaps' free memory given back in "
            f"idle steps past the default --heap-free-limit-bytes against never (0)"
        )
    else:
        print(
            f"the tokenizer's resident MB {args.settle_s:g} s after each round of {args.requests} "
            + ("chat completions" if args.api == "http" else "gRPC Generate calls")
            + f", {args.concurrency} at a time, each with a {args.image_mb:g} MB image "
            + (
                f"as a data: URL ({args.distinct} distinct a round, half of them not base64: 400)"
                if args.api == "http"
                else f"by value ({args.distinct} distinct a round, half of them bytes that are no image)"
            )
            + ", tiny LLaVA at TP=1; its heaps' free memory given back past the default "
            "--heap-free-limit-bytes against never (0)"
        )
    print(f"at rest: given back {at_rest['given back']:.0f} MB, kept {at_rest['kept']:.0f} MB")
    print(table(["round", "given back MB", "kept MB", "given back / kept"], rows))
    print("answers: " + "; ".join(f"{arm}: {dict(sorted(statuses.items()))}" for arm, statuses in answers.items()))


if __name__ == "__main__":
    main()
