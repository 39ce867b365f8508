"""What a full garbage collection costs each service, with the start-up's
objects frozen out of its reach (`mmsplit_server.gcheap.freeze`) and not.

CPython's generation-2 collection walks every tracked object with the GIL
held: no stream gets a token meanwhile. Each service's heap is mostly what
it imported and loaded. In one run:

1. For each service, a new interpreter builds that service's heap (the
   tokenizer: its server module and the model's tokenizer; the scheduler:
   its server module and the model, loaded as a rank loads it), then times
   a full collection (median of --reps), calls `gcheap.freeze()` as the
   service does, and times it again: the pause before / after. The two
   build at once; they time one after the other, the other one waiting.
2. The real services (TP=1, the tiny model) under --rounds rounds of 32
   concurrent one-image requests: the collections each made and their wall
   time, by generation, from their /metrics (wall time: on a busy host it
   includes the collecting thread's waits for a core).

    python bench/gc_pause.py [--model 8x512] [--reps 5] [--rounds 40]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, run_clients, table
from prometheus_client.parser import text_string_to_metric_families

from mmsplit_cli.client import make_request
from mmsplit_cli.launch import FreePort, running_pair

HEAPS = ("tokenizer", "scheduler")


def build_heap(service: str, model_dir: Path) -> object:
    """What the service holds once started, kept alive by the return value."""
    if service == "tokenizer":
        from transformers import AutoTokenizer

        import tokenizer_svc.server  # noqa: F401

        return AutoTokenizer.from_pretrained(model_dir)
    import torch

    import scheduler_svc.server  # noqa: F401
    from scheduler_svc.model import load_model

    return load_model(model_dir, world_size=1, device=torch.device("cpu"), dtype=torch.float32)


def full_collection_ms(reps: int) -> float:
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def measure_heap(service: str, model_dir: Path, reps: int) -> dict[str, float]:
    """In this (new) interpreter: the full collection's pause before and
    after freezing, timed once a line on standard input says to."""
    from mmsplit_server import gcheap

    kept = build_heap(service, model_dir)
    print("built", flush=True)
    sys.stdin.readline()
    objects = len(gc.get_objects())
    before = full_collection_ms(reps)
    gcheap.freeze()
    frozen = gc.get_freeze_count()
    after = full_collection_ms(reps)
    del kept
    return {"objects": objects, "frozen": frozen, "before_ms": before, "after_ms": after}


def in_new_interpreters(model_dir: Path, reps: int) -> dict[str, dict[str, float]]:
    """Every service's heap, each in an interpreter of its own: built at
    once (their imports are most of this part's time), timed in turn."""
    argv = [sys.executable, __file__, "--model-dir", str(model_dir), "--reps", str(reps), "--heap"]
    procs = {
        service: subprocess.Popen([*argv, service], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for service in HEAPS
    }
    try:
        for service, proc in procs.items():
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "built":
                raise SystemExit(f"the {service} heap was not built (exit status {proc.wait()})")
        found = {}
        for service, proc in procs.items():
            out, _ = proc.communicate("go\n")
            if proc.returncode:
                raise SystemExit(f"timing the {service} heap failed (exit status {proc.returncode})")
            found[service] = dict(json.loads(out.strip().splitlines()[-1]))
        return found
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def gc_samples(port: int) -> dict[tuple[str, str], float]:
    """(metric, generation) -> value of the gc counters on a /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels.get("generation", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "_gc_" in sample.name
    }


def metrics_port(log: Path) -> int:
    found = re.search(r"metrics on port (\d+)", log.read_text())
    assert found, f"no metrics port in {log}"
    return int(found.group(1))


def in_service(model_dir: Path, rounds: int, workdir: Path) -> dict[str, dict[tuple[str, str], float]]:
    """Each service's gc counters over `rounds` rounds of 32 concurrent requests (after a warm-up)."""
    from mmsplit_cli import samples

    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    metrics = ["--metrics-port", FreePort()]
    with running_pair(model_dir, logs, tp=1, scheduler_extra=metrics, tokenizer_extra=metrics) as pair:
        ports = {
            "tokenizer": metrics_port(pair.tokenizer.log_path),
            "scheduler": metrics_port(pair.scheduler.log_path),
        }

        def round_of(k: int) -> None:
            requests = [
                make_request(f"Describe picture {i}.", [samples.good_jpeg(seed=k * 32 + i)], max_tokens=32)
                for i in range(32)
            ]
            run_clients(pair.tokenizer_address, requests, 32)

        round_of(0)
        before = {name: gc_samples(port) for name, port in ports.items()}
        for k in range(1, rounds + 1):
            round_of(k)
        after = {name: gc_samples(port) for name, port in ports.items()}
    return {name: {key: after[name][key] - before[name].get(key, 0.0) for key in after[name]} for name in ports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8x512", help="the model whose heap part 1 builds (harness.MODELS)")
    parser.add_argument("--reps", type=int, default=5, help="full collections timed per arm")
    parser.add_argument(
        "--rounds", type=int, default=40, help="rounds of 32 requests through the services (0: skip that part)"
    )
    parser.add_argument("--heap", choices=HEAPS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.heap:
        print(json.dumps(measure_heap(args.heap, args.model_dir, args.reps)))
        return
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        heaps = in_new_interpreters(build_model(args.model, Path(tmp)), args.reps)
        served = in_service(build_model("tiny", Path(tmp)), args.rounds, Path(tmp)) if args.rounds else {}
    print(f"a full collection (median of {args.reps}), each service's heap as started ({args.model} model)")
    rows = [
        [
            service,
            f"{h['objects']:.0f}",
            f"{h['frozen']:.0f}",
            f"{h['before_ms']:.1f}",
            f"{h['after_ms']:.2f}",
            f"{h['after_ms'] / h['before_ms']:.3f}",
        ]
        for service, h in heaps.items()
    ]
    print(table(["heap", "objects", "frozen", "not frozen ms", "frozen ms", "frozen / not"], rows))
    if not served:
        return
    print(
        f"\nthe services (TP=1, tiny model, start-up frozen), {args.rounds} rounds"
        " of 32 concurrent requests x 32 tokens"
    )
    rows = []
    for service, found in served.items():
        for generation in ("0", "1", "2"):
            n = found.get((f"mmsplit_{service}_gc_collections_total", generation), 0.0)
            s = found.get((f"mmsplit_{service}_gc_pause_seconds_total", generation), 0.0)
            rows.append([service, generation, f"{n:.0f}", f"{1000 * s:.1f}", f"{1000 * s / n:.2f}" if n else "-"])
    print(table(["service", "generation", "collections", "ms in all", "ms each"], rows))


if __name__ == "__main__":
    main()
