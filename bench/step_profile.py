"""Where one decode step's time goes, on the device the engine runs on.

The scheduler's `Engine` in this process (a group of one, as
`bench/multiturn.py` makes it) takes R one-image requests in one step, then
decodes them. Timed first without the profiler (the step's wall time, the
baseline), then `torch.profiler` over S more decode steps. Printed:

- the decode step's wall time, median, without and with the profiler;
- the decode step with the model's own forward (`--lean-decode false`)
  and with the engine's lean one (the default where the model's text
  model is one it copies: `scheduler_svc/lean_decode.py`), alternating
  over `--rounds`, each from a new join of the same rows: the time the
  module calls around the model's operations cost (`--no-lean-arms` skips it);
- the ops with the most self CPU time (on a GPU: the host's launch and
  bookkeeping cost), and on a GPU the kernels with the most device time;
- the share of the step's wall time the ops account for on the host (the
  rest is Python: the engine's bookkeeping, transformers' module calls);
- on a GPU, the step's wall time with cuDNN's attention kernel off (the
  scheduler's default) and on (`--cudnn-attention`; torch prefers it on
  sm90 with cuDNN >= 9.9, and it plans a graph for each new shape), each
  with the step's keys as they are and padded to a multiple of 64
  (`--decode-kv-multiple`; a decode step's keys grow by one every step
  unless padded);
- on a GPU, every call that makes the host wait for the device
  (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`,
  a synchronous `cudaMemcpy`) with the Python frames it came from: the
  stop-54 GPU run's py-spy profile put 62 % of the scheduler's samples
  inside transformers' SDPA call, which looks like such a wait.

- how near the step is to what the host allows (`--floor`, on by
  default): the bytes of the weights its matrix products read (the text
  model's projections and the LM head; the vision tower takes no part in
  a decode step) and their arithmetic, against the device's read
  bandwidth (a sum over 256 MiB: the size of a small model's weights,
  which on a host with a large shared cache may sit in it, as the
  weights do) and its rate on one large matrix product
  (2048 x 2048 x 2048), both measured here on the step's threads, best
  of 5: the step's time over the larger of the two floors. A step
  near 1.0x of its bandwidth floor can only be made faster by reading
  fewer bytes (a smaller dtype), one near its arithmetic floor by doing
  less arithmetic.

With `--trace FILE` the profiler's Chrome trace is written there too.

    python bench/step_profile.py [--model tiny] [--rows 32] [--steps 10] [--no-floor]
                                 [--device cuda --dtype bfloat16] [--trace step.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, scratch_dir, table
from multiturn import IMAGE_TOKEN_ID, IMAGE_TOKENS, engine, image, request

# CUDA runtime calls that block the host until the device catches up.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class Decoder:
    """R requests joined in one step, then one decode step per `step()`."""

    def __init__(self, eng: Any, rows: int, prompt: int, answer: int) -> None:
        from scheduler_svc.plan import Plan

        self._eng, self._plan, self._n = eng, Plan, 0
        ids = [1, *range(100, 100 + prompt), *[IMAGE_TOKEN_ID] * IMAGE_TOKENS, 2000]
        new = tuple(request(f"r{i}", ids, [image(i)], answer) for i in range(rows))
        self._feed = self._advance(Plan(step=0, new=new))

    def _advance(self, plan: Any) -> tuple[tuple[str, int], ...]:
        outcome = self._eng.step(plan)
        if outcome.failed or outcome.rejected:
            raise RuntimeError(f"the engine failed requests: {outcome.failed or outcome.rejected}")
        self._n += 1
        return tuple(outcome.sampled.items())

    def step(self) -> None:
        self._feed = self._advance(self._plan(step=self._n, feed=self._feed))


def timed(decoder: Decoder, steps: int, sync: Any) -> float:
    """The median decode step, in ms."""
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        decoder.step()
        sync()
        times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def waits(events: Any) -> list[tuple[str, int, float, str]]:
    """(call, count, host ms, the innermost Python frames) of each blocking CUDA call, by place."""
    found = []
    for event in events:
        if not event.key.startswith(WAITS) or "Async" in event.key:
            continue
        frames = [frame for frame in event.stack if ".py(" in frame][:4]
        found.append((event.key, event.count, event.cpu_time_total / 1000, " <- ".join(frames) or "(no Python frame)"))
    return sorted(found, key=lambda w: -w[2])


def arms(model: Any, args: argparse.Namespace, warm: int, sync: Any) -> None:
    """The decode step with cuDNN's attention kernel off (the scheduler's
    default) and on (`--cudnn-attention`: torch's first choice on sm90 with
    cuDNN >= 9.9, which plans a graph for each new shape), each with its
    keys as they are and padded (masked) to a multiple of `args.pad`
    (`--decode-kv-multiple`, so that their shape repeats: a decode step's
    keys grow by one every step unless padded). Each arm from a new join,
    alternating over `args.rounds` rounds."""
    import torch

    print(f"cuDNN {torch.backends.cudnn.version()}")
    options = {
        "cuDNN off (default)": {},
        "cuDNN on": {"cudnn_attention": True},
        f"cuDNN off, keys padded to {args.pad}": {"decode_kv_multiple": args.pad},
        f"cuDNN on, keys padded to {args.pad}": {"cudnn_attention": True, "decode_kv_multiple": args.pad},
    }
    times: dict[str, list[float]] = {arm: [] for arm in options}
    for _ in range(args.rounds):
        for arm, seen in times.items():
            trial = Decoder(engine(model, 0, **options[arm]), args.rows, args.prompt, answer=1 + warm + args.steps + 1)
            timed(trial, warm, sync)
            seen.append(timed(trial, args.steps, sync))
    medians = {arm: statistics.median(seen) for arm, seen in times.items()}
    base = medians["cuDNN off (default)"]
    said = ", ".join(f"{arm} {ms:.2f} ({ms / base:.2f}x)" for arm, ms in medians.items())
    print(f"decode step wall ms, median of {args.rounds} rounds: {said}")


def lean_arms(model: Any, args: argparse.Namespace, warm: int, sync: Any) -> None:
    """The decode step with the model's own forward and with the lean one,
    alternating over `args.rounds` rounds, each from a new join."""
    from scheduler_svc.lean_decode import LeanLlama

    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for lean, seen in times.items():
            eng = engine(model, 0, lean_decode=lean)
            if lean and not isinstance(eng._decode_body, LeanLlama):
                print("lean decode: not used for this model (scheduler_svc.lean_decode logged why)")
                return
            trial = Decoder(eng, args.rows, args.prompt, answer=1 + warm + args.steps + 1)
            timed(trial, warm, sync)
            seen.append(timed(trial, args.steps, sync))
    own, lean_ms = statistics.median(times[False]), statistics.median(times[True])
    print(f"decode step wall ms, median of {args.rounds} rounds: the model's own forward {own:.2f}, "
          f"lean {lean_ms:.2f} ({lean_ms / own:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny or 8x512")
    parser.add_argument("--rows", type=int, default=32, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=10, help="decode steps profiled (and as many timed before)")
    parser.add_argument("--prompt", type=int, default=40, help="text tokens before each request's image")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--arms", action=argparse.BooleanOptionalAction, default=None,
                        help="time the step with cuDNN's attention off and on, keys padded and not "
                        "(default: on a GPU only)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds of those arms, and of the lean ones")
    parser.add_argument(
        "--lean-arms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the decode step with the model's own forward and with the lean one",
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the step against what the device's read bandwidth and matrix product rate allow",
    )
    parser.add_argument("--pad", type=int, default=64, help="the padded arm's multiple of keys")
    parser.add_argument("--trace", type=Path, default=None, help="write the profiler's Chrome trace here")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForImageTextToText

    torch.set_grad_enabled(False)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with scratch_dir(args.workdir) as workdir:
        model_dir = build_model(args.model, workdir)
        dtype = getattr(torch, args.dtype)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    warm, steps = 3, args.steps
    if args.arms if args.arms is not None else cuda:
        arms(model, args, warm, sync)
    if args.lean_arms:
        lean_arms(model, args, warm, sync)
    decoder = Decoder(engine(model, 0), args.rows, args.prompt, answer=1 + warm + 2 * steps + 1)
    timed(decoder, warm, sync)
    plain = timed(decoder, steps, sync)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, with_stack=True) as prof:
        profiled = timed(decoder, steps, sync)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))

    events = [e for e in prof.key_averages() if ".py(" not in e.key and not e.key.startswith("<built-in")]
    print(f"{args.model} on {args.device} in {args.dtype}: {args.rows} rows, {steps} decode steps profiled")
    print(f"decode step wall ms, median: {plain:.2f} without the profiler, {profiled:.2f} with it")
    ops_ms = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1000 / steps
    print(f"aten ops' self CPU time per step: {ops_ms:.2f} ms ({100 * ops_ms / profiled:.0f} % of the step's wall)")
    print("\nthe ops with the most self CPU time, per step:")
    print(ranked(events, "self_cpu_time_total", steps))
    if cuda:
        print("\nthe kernels with the most device time, per step:")
        print(ranked(events, "self_device_time_total", steps))
        found = waits(prof.key_averages(group_by_stack_n=8))
        print("\ncalls that make the host wait for the device, by where they were made:")
        for call, count, ms, where in found or [("(none)", 0, 0.0, "")]:
            print(f"  {call}: {count} calls, {ms:.1f} ms on the host: {where}")
    else:
        print("(on a CPU no call waits for a device; run with --device cuda for the GPU's kernels and waits)")
    if args.floor:
        floors(model, args.rows, plain, args.device, dtype, sync)


def floors(model: Any, rows: int, step_ms: float, device: str, dtype: Any, sync: Any) -> None:
    """The decode step against the two floors its matrix products have on
    this device: reading their weights at its read bandwidth, and their
    arithmetic at its large matrix product's rate (see the module's doc)."""
    import torch

    linears = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    linears.append(model.get_output_embeddings())
    params = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in linears)
    weight_bytes = sum(p.numel() * p.element_size() for m in linears for p in m.parameters(recurse=False))
    flops = 2 * rows * params

    def best_of(fn: Any, reps: int = 5) -> float:
        fn()
        sync()
        seconds = []
        for _ in range(reps):
            began = time.perf_counter()
            fn()
            sync()
            seconds.append(time.perf_counter() - began)
        return min(seconds)

    big = torch.ones((256 << 20) // torch.empty(0, dtype=dtype).element_size(), dtype=dtype, device=device)
    bandwidth = big.numel() * big.element_size() / best_of(big.sum)
    del big
    a = torch.randn(2048, 2048, dtype=dtype, device=device)
    b = torch.randn(2048, 2048, dtype=dtype, device=device)
    rate = 2 * 2048**3 / best_of(lambda: a @ b)
    read_ms, math_ms = 1000 * weight_bytes / bandwidth, 1000 * flops / rate
    print(f"\nthe step's floors on {torch.get_num_threads()} threads: its matrix products read "
          f"{weight_bytes / 1e6:.1f} MB of weights ({len(linears)} of them) and do {flops / 1e9:.2f} GFLOP; "
          f"this device reads {bandwidth / 1e9:.1f} GB/s and multiplies large matrices at "
          f"{rate / 1e9:.0f} GFLOP/s: the weights alone take {read_ms:.2f} ms to read and the products "
          f"{math_ms:.2f} ms at that rate; the step {step_ms:.2f} ms is {step_ms / max(read_ms, math_ms):.2f}x "
          f"the larger floor ({'reading' if read_ms >= math_ms else 'arithmetic'})")  # fmt: skip


def ranked(events: list[Any], attribute: str, steps: int, n: int = 15) -> str:
    """The `n` events with the most `attribute` (microseconds), in ms per step."""
    top = sorted(events, key=lambda e: -getattr(e, attribute, 0))[:n]
    rows = [[e.key[:70], f"{e.count / steps:.0f}", f"{getattr(e, attribute, 0) / 1000 / steps:.3f}"] for e in top]
    return table(["op", "calls/step", "ms/step"], rows)


if __name__ == "__main__":
    main()
