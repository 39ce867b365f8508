"""Throughput of the serving engine against plain in-process `generate`.

In ONE run, for each model (the tiny LLaVA, and one with an 8-layer 512-wide
text model) and each TP size:
  HF serial  — in-process Hugging Face `generate`, one request at a time
  HF batch   — in-process `generate` on one left-padded batch of all N
  services   — the real tokenizer + scheduler, N requests sent by 1, 8 and N
               concurrent clients
N one-image requests of different prompt lengths, each making exactly T
greedy tokens (min_new_tokens = max_new_tokens in HF, min_tokens =
max_tokens through the services, so every arm makes the same tokens).
Throughput is generated tokens / wall time. The HF arms time `generate` only
(pixel tensors and ids made beforehand); the services are timed end to end
from the client (preprocessing, transport and streaming included), so the
comparison is strict on the services. HF runs at TP=1 in process; the TP=2
services are compared with it too. Also printed: time to first token and
inter-token gaps (p50/p99) at N concurrent, and how many requests' tokens
equal HF serial's.

    python bench/engine.py [--models tiny,8x512] [--tp 1,2] [--n 32] [--tokens 32] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Timeline, build_model, percentile, run_clients, table

from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import running_pair

CONCURRENCY = (1, 8)  # and N


@dataclass
class Prompt:
    text: str
    image: bytes


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"Describe picture {i}." + " Be precise." * (i % 7), samples.good_jpeg(seed=i)) for i in range(n)]


@dataclass
class HfResult:
    serial_tps: float
    batch_tps: float
    # The same arms with the preprocessing a plain script does first (decode +
    # image processor + prompt ids, serially) counted in: context only.
    serial_e2e_tps: float
    batch_e2e_tps: float
    serial_tokens: list[list[int]]


def hf_arms(model_dir: Path, items: list[Prompt], tokens: int, device: str, dtype: str) -> HfResult:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tokenizer_svc.decode import decode_image
    from tokenizer_svc.prompt import PromptBuilder

    processor = AutoProcessor.from_pretrained(model_dir)
    builder = PromptBuilder(processor)
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    ids, pixels = [], []
    start = time.perf_counter()
    for item in items:
        image = decode_image(item.image, max_pixels=10**8)
        pixel = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
        pixels.append(pixel.to(device, torch_dtype))
        ids.append(builder.build(item.text, [tuple(pixel.shape[1:])]))
    prep_s = time.perf_counter() - start
    gen = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}

    def one(i: int) -> list[int]:
        seq = torch.tensor([ids[i]], device=device)
        out = model.generate(input_ids=seq, attention_mask=torch.ones_like(seq), pixel_values=pixels[i], **gen)
        return [int(t) for t in out[0, seq.shape[1] :]]

    width = max(map(len, ids))
    batch_ids = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(batch_ids)
    for i, row in enumerate(ids):  # left padding, as generate expects
        batch_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    batch_ids, mask, batch_pixels = batch_ids.to(device), mask.to(device), torch.cat(pixels)

    with torch.inference_mode():
        one(0)  # warm up
        start = time.perf_counter()
        serial = [one(i) for i in range(len(ids))]
        serial_s = time.perf_counter() - start
        model.generate(input_ids=batch_ids[:2], attention_mask=mask[:2], pixel_values=batch_pixels[:2], **gen)
        start = time.perf_counter()
        model.generate(input_ids=batch_ids, attention_mask=mask, pixel_values=batch_pixels, **gen)
        if device != "cpu":
            torch.cuda.synchronize()
        batch_s = time.perf_counter() - start
    total = len(ids) * tokens
    return HfResult(total / serial_s, total / batch_s, total / (serial_s + prep_s), total / (batch_s + prep_s), serial)


@dataclass
class ServiceRun:
    concurrency: int
    tps: float
    timelines: list[Timeline]


def service_arms(
    model_dir: Path, tp: int, items: list[Prompt], tokens: int, logs: Path, device: str, dtype: str
) -> list[ServiceRun]:
    requests = [make_request(p.text, [p.image], max_tokens=tokens, min_tokens=tokens) for p in items]
    runs = []
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--device", device, "--dtype", dtype]
    with running_pair(model_dir, logs, tp=tp, scheduler_extra=extra) as pair:
        run_clients(pair.tokenizer_address, requests[:8], 8)  # warm up
        for concurrency in (*CONCURRENCY, len(items)):
            timelines, wall = run_clients(pair.tokenizer_address, requests, concurrency)
            failed = [t.error for t in timelines if t.error]
            if failed:
                raise RuntimeError(f"{len(failed)} requests failed at concurrency {concurrency}: {failed[:3]}")
            made = sum(len(t.token_ids) for t in timelines)
            runs.append(ServiceRun(concurrency, made / wall, timelines))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,8x512")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--n", type=int, default=32, help="requests per arm")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request makes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both arms)")
    parser.add_argument("--dtype", default="float32", help="model dtype of both arms")
    args = parser.parse_args()
    items = prompts(args.n)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        for name in args.models.split(","):
            model_dir = build_model(name, Path(tmp))
            hf = hf_arms(model_dir, items, args.tokens, args.device, args.dtype)
            print(
                f"{name}: HF serial {hf.serial_tps:.0f} tok/s, HF batch {hf.batch_tps:.0f} tok/s "
                f"(with preprocessing: {hf.serial_e2e_tps:.0f}, {hf.batch_e2e_tps:.0f})",
                flush=True,
            )
            for tp in (int(t) for t in args.tp.split(",")):
                logs = Path(tmp) / f"logs-{name}-{tp}"
                runs = service_arms(model_dir, tp, items, args.tokens, logs, args.device, args.dtype)
                by_c = {r.concurrency: r for r in runs}
                full = by_c[args.n]
                same = sum(t.token_ids == ref for t, ref in zip(full.timelines, hf.serial_tokens, strict=True))
                gaps = [g for t in full.timelines for g in t.gaps]
                ttft = [t.ttft for t in full.timelines]
                print(
                    f"{name} TP={tp}: "
                    + ", ".join(f"{c} concurrent {r.tps:.0f} tok/s" for c, r in by_c.items())
                    + f"; tokens equal to HF serial: {same}/{args.n}",
                    flush=True,
                )
                rows.append(
                    [
                        name,
                        tp,
                        f"{hf.serial_tps:.0f}",
                        f"{hf.batch_tps:.0f}",
                        *(f"{by_c[c].tps:.0f}" for c in (*CONCURRENCY, args.n)),
                        f"{by_c[1].tps / hf.serial_tps:.2f}",
                        f"{by_c[8].tps / hf.batch_tps:.2f}",
                        f"{full.tps / hf.batch_tps:.2f}",
                        f"{by_c[1].tps / hf.serial_e2e_tps:.2f}",
                        f"{full.tps / hf.batch_e2e_tps:.2f}",
                        f"{1000 * percentile(ttft, 50):.0f}/{1000 * percentile(ttft, 99):.0f}",
                        f"{1000 * percentile(gaps, 50):.1f}/{1000 * percentile(gaps, 99):.1f}",
                        f"{same}/{args.n}",
                    ]
                )
    n = args.n
    header = [
        "model",
        "TP",
        "HF serial",
        "HF batch",
        "svc c=1",
        "svc c=8",
        f"svc c={n}",
        "c=1 / serial",
        "c=8 / batch",
        f"c={n} / batch",
        "c=1 / serial+prep",
        f"c={n} / batch+prep",
        f"TTFT ms p50/p99 c={n}",
        f"ITL ms p50/p99 c={n}",
        "= HF",
    ]
    print(
        f"\n{n} one-image requests x {args.tokens} greedy tokens on {args.device} in {args.dtype}; tokens/s; "
        "HF in process at TP=1, timing "
        "generate only (+prep: with its preprocessing counted in); services timed end to end from the client"
    )
    print(table(header, rows))


if __name__ == "__main__":
    main()
