"""Throughput of the serving engine against plain in-process `generate`.

In ONE run, for each model (the tiny LLaVA, and one with an 8-layer 512-wide
text model) and each TP size:
  HF serial  — in-process Hugging Face `generate`, one request at a time
  HF batch   — in-process `generate` on one left-padded batch of all N
  services   — the real tokenizer + scheduler, N requests sent by 1, 8 and N
               concurrent clients
N one-image requests (640x480 JPEGs) of different prompt lengths, each making
exactly T greedy tokens (min_new_tokens = max_new_tokens in HF, min_tokens =
max_tokens through the services, so every arm makes the same tokens).

The services run as deployed, their caches on, but every services run sends
images never sent before (same prompts, new pixels: the same work), so no
cache spares them work the HF arms do: the preprocessing, encoder and prefix
caches' hits over the timed runs are printed, and are 0. One run (the first
at N concurrent) sends the HF arms' own images, and its tokens are compared
with HF serial's.

Throughput is generated tokens / wall time. The HF arms time `generate` only
(pixel tensors and ids made beforehand); the services are timed end to end
from the client (preprocessing, transport and streaming included), so the
comparison is strict on the services. For context the HF arms are also
shown with their preprocessing (decode + image processor, serially, as a
plain script does it) counted in. HF runs at TP=1 in process; the TP=2
services are compared with it too.

The speed of a shared machine drifts (2x within minutes was seen here), so
the arms are interleaved in rounds — HF serial, engine serial, services 1,
HF batch, engine batch, services 8, services N — while the services stand
idle during the in-process arms, and each arm's median over the rounds is
reported. The engine arms run the scheduler's `Engine` in this process (a
group of one, no services, the HF arms' ids and pixels): they separate the
engine's own speed from what the services add around it. Also printed: time to
first token and inter-token gaps (p50/p99) at N concurrent, the CPU seconds
each part of the system used at N concurrent (against what the cores give,
and what HF batch's `generate` used), and how many requests' tokens equal
HF serial's.

    python bench/engine.py [--models tiny,8x512] [--tp 1,2] [--n 32] [--tokens 32] [--rounds 3]
                           [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    SoloGroup,
    Timeline,
    build_model,
    cache_hits,
    cpu_seconds,
    inline_reader,
    percentile,
    run_clients,
    table,
)

from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import Pair, running_pair

CONCURRENCY = (1, 8)  # and N


@dataclass
class Prompt:
    text: str
    image: bytes


def prompts(n: int, batch: int = 0) -> list[Prompt]:
    """`n` prompts of different lengths; each `batch` has its own images."""
    return [
        Prompt(f"Describe picture {i}." + " Be precise." * (i % 7), samples.good_jpeg(seed=batch * n + i))
        for i in range(n)
    ]


class HfArms:
    """The in-process baseline: the model, ids and pixel tensors made once."""

    def __init__(self, model_dir: Path, items: list[Prompt], tokens: int, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from tokenizer_svc.decode import decode_image

        self.torch = torch
        self.device = device
        self.model_dir = model_dir
        processor = AutoProcessor.from_pretrained(model_dir)
        torch_dtype = getattr(torch, dtype)
        self.model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype)
        self.model = self.model.to(device).eval()
        self.ids: list[list[int]] = []
        self.pixels = []
        start = time.perf_counter()
        for item in items:
            image = decode_image(item.image, max_pixels=10**8)
            text = item.text if processor.image_token in item.text else f"{processor.image_token}\n{item.text}"
            made = processor(images=[image], text=text, return_tensors="pt")
            self.pixels.append(made["pixel_values"].to(device, torch_dtype))
            self.ids.append(made["input_ids"][0].tolist())
        # What a plain script spends before its first generate (serially).
        self.prep_s = time.perf_counter() - start
        self.gen = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
        self.total = len(items) * tokens
        width = max(map(len, self.ids))
        batch_ids = torch.zeros((len(self.ids), width), dtype=torch.long)
        mask = torch.zeros_like(batch_ids)
        for i, row in enumerate(self.ids):  # left padding, as generate expects
            batch_ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        self.batch_ids, self.mask = batch_ids.to(device), mask.to(device)
        self.batch_pixels = torch.cat(self.pixels)
        self.serial_tokens = [self._one(0)]  # warm up
        self._batch(2)
        # CPU seconds this process used in each timed batch `generate` (every thread).
        self.batch_cpu: list[float] = []

    def _one(self, i: int) -> list[int]:
        torch = self.torch
        with torch.inference_mode():
            seq = torch.tensor([self.ids[i]], device=self.device)
            kwargs = {"attention_mask": torch.ones_like(seq), "pixel_values": self.pixels[i]}
            out = self.model.generate(input_ids=seq, **kwargs, **self.gen)
        return [int(t) for t in out[0, seq.shape[1] :]]

    def _batch(self, n: int) -> None:
        with self.torch.inference_mode():
            ids, mask, pixels = self.batch_ids[:n], self.mask[:n], self.batch_pixels[:n]
            self.model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, **self.gen)
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def serial(self) -> float:
        start = time.perf_counter()
        self.serial_tokens = [self._one(i) for i in range(len(self.ids))]
        return self.total / (time.perf_counter() - start)

    def batch(self) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        self._batch(len(self.ids))
        self.batch_cpu.append(time.process_time() - cpu)
        return self.total / (time.perf_counter() - start)

    def with_prep(self, tps: float) -> float:
        return self.total / (self.total / tps + self.prep_s)


class EngineArms:
    """The scheduler's engine in this process (a group of one, no services,
    the HF arms' ids and pixels): what the engine costs without the
    transport, the streaming and the preprocessing around it."""

    def __init__(self, hf: HfArms, tokens: int, **options: Any) -> None:
        from mmsplit.common.v1 import common_pb2
        from mmsplit_server.handoff.reference import TensorSpec
        from mmsplit_server.sampling import Sampling
        from scheduler_svc.engine import Engine
        from scheduler_svc.plan import Item, NewRequest

        torch = hf.torch
        # A model of its own: the engine may lay out its weights for speed
        # (`head_layout`), which must not change the HF arms' model.
        model = type(hf.model).from_pretrained(hf.model_dir, dtype=hf.model.dtype).to(hf.device).eval()
        self.engine = Engine(
            model, SoloGroup(), inline_reader(), torch.device(hf.device), eos_token_ids=frozenset(), **options
        )
        self.requests = []
        for i, (ids, pixel) in enumerate(zip(hf.ids, hf.pixels, strict=True)):
            data = pixel[0].float().cpu().numpy().tobytes()
            spec = TensorSpec(common_pb2.DTYPE_FLOAT32, tuple(pixel.shape), inline=data)
            sampling = Sampling(max_tokens=tokens, min_tokens=tokens)
            image_token = int(model.config.image_token_id)
            start = ids.index(image_token)
            run = ((start, ids.count(image_token)),)
            item = Item(common_pb2.MODALITY_IMAGE, (("pixel_values", spec),), {}, run)
            self.requests.append(NewRequest(f"e{i}", tuple(ids), (item,), sampling))
        self.tokens = tokens
        self.total = len(self.requests) * tokens
        self.step = 0
        self._run(self.requests[:2])  # warm up

    def _run(self, requests: list[Any]) -> None:
        from scheduler_svc.plan import Plan

        self.step += 1
        outcome = self.engine.step(Plan(step=self.step, new=tuple(requests)))
        for _ in range(self.tokens - 1):
            self.step += 1
            outcome = self.engine.step(Plan(step=self.step, feed=tuple(outcome.sampled.items())))
        self.step += 1
        self.engine.step(Plan(step=self.step, drop=tuple(outcome.sampled)))

    def serial(self) -> float:
        start = time.perf_counter()
        for request in self.requests:
            self._run([request])
        return self.total / (time.perf_counter() - start)

    def batch(self) -> float:
        start = time.perf_counter()
        self._run(self.requests)
        return self.total / (time.perf_counter() - start)


@dataclass
class ServiceRun:
    tps: float
    timelines: list[Timeline]
    wall_s: float
    # CPU seconds each part of the system used during the run.
    cpu: dict[str, float]


def serve(pair: Pair, requests: list[Any], concurrency: int) -> ServiceRun:
    before = cpu_seconds(pair.scheduler.pid, pair.tokenizer.pid)
    timelines, wall = run_clients(pair.tokenizer_address, requests, concurrency)
    after = cpu_seconds(pair.scheduler.pid, pair.tokenizer.pid)
    failed = [t.error for t in timelines if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed at concurrency {concurrency}: {failed[:3]}")
    made = sum(len(t.token_ids) for t in timelines)
    return ServiceRun(made / wall, timelines, wall, {part: after[part] - before[part] for part in before})


@dataclass
class Rounds:
    """Each arm's results over the rounds."""

    arms: dict[str, list[float]] = field(default_factory=dict)
    runs: dict[int, list[ServiceRun]] = field(default_factory=dict)
    # The run that sent the HF arms' own images (its tokens are compared with HF's).
    check: ServiceRun | None = None
    # The services' cache hits over the timed runs, by cache.
    hits: dict[str, int] = field(default_factory=dict)

    def add(self, arm: str, tps: float) -> float:
        self.arms.setdefault(arm, []).append(tps)
        return tps

    def median(self, arm: str) -> float:
        return statistics.median(self.arms[arm])

    def median_run(self, concurrency: int) -> ServiceRun:
        runs = sorted(self.runs[concurrency], key=lambda r: r.tps)
        return runs[len(runs) // 2]


def cpu_budget(run: ServiceRun, hf_cpu: float, hf_wall: float, n: int) -> str:
    """Where the CPU of the median run at `n` concurrent went, against the
    cores this process may use, and what HF batch's `generate` spends.
    The last figure is an estimate, not a measurement: c=n / HF batch if the
    scheduler were as fast as HF batch and what the other parts spend came
    from the same cores (the tokenizer, its workers and the clients are
    work the HF arm does not do; on a host with spare cores they overlap)."""
    cores = len(os.sched_getaffinity(0))
    total = sum(run.cpu.values())
    rest = total - run.cpu["scheduler"]
    return (
        f"CPU at {n} concurrent: {total:.2f} CPU-s in {run.wall_s:.2f} s on {cores} cores "
        f"({total / (cores * run.wall_s):.0%} of what they give); the scheduler {run.cpu['scheduler']:.2f} against "
        f"HF batch's generate {hf_cpu:.2f} CPU-s in {hf_wall:.2f} s; the other parts {rest:.2f} CPU-s "
        f"({rest / cores:.2f} s of all {cores} cores): with the scheduler at HF batch's speed and those on the "
        f"same cores, c={n} / HF batch would be {hf_wall / (hf_wall + rest / cores):.2f}"
    )


def measure(hf: HfArms, engine: EngineArms | None, pair: Pair, items: list[Prompt], tokens: int, rounds: int) -> Rounds:
    batches = itertools.count(1)

    def requests(batch: int | None = None) -> list[Any]:
        """The prompts of `items` with a batch of images (by default, never sent before)."""
        fresh = items if batch == 0 else prompts(len(items), next(batches) if batch is None else batch)
        return [make_request(p.text, [p.image], max_tokens=tokens, min_tokens=tokens) for p in fresh]

    serve(pair, requests()[:8], 8)  # warm up
    before = cache_hits(pair.tokenizer_address, pair.scheduler_address)
    out = Rounds()
    for r in range(rounds):
        out.add("hf serial", hf.serial())
        if engine is not None:
            out.add("engine serial", engine.serial())
        for concurrency in (1, None, *CONCURRENCY[1:], len(items)):
            if concurrency is None:
                out.add("hf batch", hf.batch())
                if engine is not None:
                    out.add("engine batch", engine.batch())
                continue
            check = r == 0 and concurrency == len(items)
            run = serve(pair, requests(0 if check else None), concurrency)
            out.check = run if check else out.check
            out.runs.setdefault(concurrency, []).append(run)
            out.add(f"c={concurrency}", run.tps)
    after = cache_hits(pair.tokenizer_address, pair.scheduler_address)
    out.hits = {cache: after[cache] - before[cache] for cache in after}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,8x512")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--n", type=int, default=32, help="requests per arm")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request makes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both arms)")
    parser.add_argument("--dtype", default="float32", help="model dtype of both arms")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the scheduler's --stream-interval (tokens per message)"
    )
    parser.add_argument(
        "--cudnn-attention", action="store_true", help="the scheduler's --cudnn-attention (the engine's arms too)"
    )
    parser.add_argument("--decode-kv-multiple", type=int, default=1, help="the scheduler's --decode-kv-multiple")
    parser.add_argument(
        "--scheduler-args", default="", help="more arguments for the scheduler, e.g. '--stats-interval-s 1'"
    )
    parser.add_argument("--logs", type=Path, help="keep the services' logs in this directory")
    args = parser.parse_args()
    items = prompts(args.n)
    n = args.n
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        for name in args.models.split(","):
            model_dir = build_model(name, Path(tmp))
            hf = HfArms(model_dir, items, args.tokens, args.device, args.dtype)
            engine = EngineArms(
                hf, args.tokens, cudnn_attention=args.cudnn_attention, decode_kv_multiple=args.decode_kv_multiple
            )
            tps = [int(t) for t in args.tp.split(",")]
            for tp in tps:
                logs = (args.logs or Path(tmp)) / f"logs-{name}-{tp}"
                logs.mkdir(parents=True)
                extra = ["--device", args.device, "--dtype", args.dtype, "--stream-interval", str(args.stream_interval)]
                extra += ["--decode-kv-multiple", str(args.decode_kv_multiple)]
                extra += ["--cudnn-attention"] if args.cudnn_attention else []
                extra += shlex.split(args.scheduler_args)
                with running_pair(model_dir, logs, tp=tp, scheduler_extra=extra) as pair:
                    # The in-process engine is TP=1: measured with the first TP size only.
                    r = measure(hf, engine if tp == tps[0] else None, pair, items, args.tokens, args.rounds)
                if "engine batch" in r.arms:
                    engine_serial, engine_batch = r.median("engine serial"), r.median("engine batch")
                    print(
                        f"{name} engine in process: {engine_serial:.0f} tok/s one at a time "
                        f"({engine_serial / r.median('hf serial'):.2f}x HF serial), {engine_batch:.0f} tok/s on "
                        f"all {n} at once ({engine_batch / r.median('hf batch'):.2f}x HF batch)",
                        flush=True,
                    )
                full = r.median_run(n)
                assert r.check is not None
                same = sum(t.token_ids == ref for t, ref in zip(r.check.timelines, hf.serial_tokens, strict=True))
                serial, batch = r.median("hf serial"), r.median("hf batch")
                svc = {c: r.median(f"c={c}") for c in (*CONCURRENCY, n)}
                print(
                    f"{name} TP={tp}: HF serial {serial:.0f} tok/s, HF batch {batch:.0f}; services "
                    + ", ".join(f"{c} concurrent {tps:.0f}" for c, tps in svc.items())
                    + f"; every arm's rounds: { ({k: [round(x) for x in v] for k, v in r.arms.items()}) }",
                    flush=True,
                )
                # Each round's services run against the same round's HF batch: this host's speed drifts
                # between rounds more than within one, so the paired ratios are the sharper reading.
                paired = [c / b for c, b in zip(r.arms[f"c={n}"], r.arms["hf batch"], strict=True)]
                print(
                    f"  c={n} / HF batch round by round: {', '.join(f'{x:.2f}' for x in paired)} "
                    f"(median {statistics.median(paired):.2f}; the table's is the ratio of the medians)",
                    flush=True,
                )
                hits = ", ".join(f"{cache} {count}" for cache, count in r.hits.items())
                print(f"  cache hits over the timed services runs (new images in each): {hits}", flush=True)
                parts = ", ".join(f"{part} {seconds:.2f}" for part, seconds in full.cpu.items())
                print(f"  CPU seconds at {n} concurrent, {full.wall_s:.2f} s of wall time: {parts}", flush=True)
                print(f"  {cpu_budget(full, statistics.median(hf.batch_cpu), hf.total / batch, n)}", flush=True)
                gaps = [g for t in full.timelines for g in t.gaps]
                ttft = [t.ttft for t in full.timelines]
                rows.append(
                    [
                        name,
                        tp,
                        f"{serial:.0f}",
                        f"{batch:.0f}",
                        *(f"{svc[c]:.0f}" for c in (*CONCURRENCY, n)),
                        f"{svc[1] / serial:.2f}",
                        f"{svc[8] / batch:.2f}",
                        f"{svc[n] / batch:.2f}",
                        f"{svc[1] / hf.with_prep(serial):.2f}",
                        f"{svc[n] / hf.with_prep(batch):.2f}",
                        f"{r.median('engine serial') / serial:.2f}" if "engine serial" in r.arms else "",
                        f"{r.median('engine batch') / batch:.2f}" if "engine batch" in r.arms else "",
                        f"{1000 * percentile(ttft, 50):.0f}/{1000 * percentile(ttft, 99):.0f}",
                        f"{1000 * percentile(gaps, 50):.1f}/{1000 * percentile(gaps, 99):.1f}",
                        f"{same}/{n}",
                    ]
                )
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
        "engine / serial",
        "engine / batch",
        f"TTFT ms p50/p99 c={n}",
        f"ITL ms p50/p99 c={n}",
        "= HF",
    ]
    print(
        f"\n{n} one-image requests x {args.tokens} greedy tokens on {args.device} in {args.dtype}; tokens/s, "
        f"medians of {args.rounds} interleaved rounds; HF in process at TP=1 timing generate only "
        "(+prep: with its preprocessing counted in); services timed end to end from the client"
        + (f"; the scheduler streams {args.stream_interval} tokens a message" if args.stream_interval > 1 else "")
    )
    print(table(header, rows))


if __name__ == "__main__":
    main()
