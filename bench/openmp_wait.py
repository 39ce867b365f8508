"""How the scheduler's OpenMP threads wait between parallel regions, and how
many of them a step runs on, through the real services.

In ONE run, for each model and concurrency, the services (TP=1) started once
per setting, the settings interleaved over rounds:
  spin      GOMP_SPINCOUNT=20000 (what `mmsplit` sets: ~0.2 ms of spinning
            before a thread sleeps), every step on all threads (--tune-threads false)
  tuned     the same spin, each step on all threads or one fewer, whichever
            has been faster lately for its kind of step (`mmsplit`'s default)
  1 thread  OMP_NUM_THREADS=1: no parallel regions at all
  passive   OMP_WAIT_POLICY=PASSIVE: a thread sleeps as soon as a region ends
            (`mmsplit`'s default before 2026-12-03), all threads
(others with --settings "NAME=VAR=VALUE,--flag=VALUE,...;..."; an assignment
starting with -- is a scheduler argument). N one-image requests x T greedy
tokens by C concurrent clients; tokens/s, each setting's median over the
rounds and its ratio to the first setting.

    python bench/openmp_wait.py [--models tiny,8x512] [--concurrency 1,32] [--n 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import prompts
from harness import build_model, run_clients, table

from mmsplit_cli.client import make_request
from mmsplit_cli.launch import running_pair

SETTINGS = (
    "spin=GOMP_SPINCOUNT=20000,--tune-threads=false;tuned=GOMP_SPINCOUNT=20000;1 thread=OMP_NUM_THREADS=1;"
    "passive=OMP_WAIT_POLICY=PASSIVE,--tune-threads=false"
)


def parse(settings: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """Each setting's environment and scheduler arguments."""
    out = {}
    for item in settings.split(";"):
        name, _, assignments = item.partition("=")
        pairs = [a.split("=", 1) for a in assignments.split(",") if a]
        env = {k: v for k, v in pairs if not k.startswith("--")}
        out[name] = (env, [part for k, v in pairs if k.startswith("--") for part in (k, v)])
    return out


def measure(
    model: Path,
    name: str,
    concurrency: int,
    settings: dict[str, tuple[dict[str, str], list[str]]],
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, list[float]]:
    """Each setting's tokens/s in every round (the settings interleaved)."""
    n = max(args.n, concurrency)
    # The warm-up's images are not the timed run's (no cache hit in it).
    warm_up, requests = (
        [make_request(p.text, [p.image], max_tokens=args.tokens, min_tokens=args.tokens) for p in prompts(n, batch)]
        for batch in (1, 0)
    )
    tps: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for k, (setting, (env, extra)) in enumerate(settings.items()):
            logs = tmp / f"logs-{name}-{concurrency}-{r}-{k}"
            logs.mkdir()
            with running_pair(model, logs, tp=1, env=env, scheduler_extra=extra) as pair:
                run_clients(pair.tokenizer_address, warm_up[:4], 4)
                timelines, wall = run_clients(pair.tokenizer_address, requests, concurrency)
            failed = [t.error for t in timelines if t.error]
            if failed:
                raise SystemExit(f"{len(failed)} requests failed: {failed[:3]}")
            tps[setting].append(sum(len(t.token_ids) for t in timelines) / wall)
            print(f"{name} c={concurrency} round {r + 1} {setting}: {tps[setting][-1]:.0f} tok/s", flush=True)
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,8x512")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--n", type=int, default=16, help="requests per run (as many as the concurrency at least)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default=SETTINGS)
    args = parser.parse_args()
    settings = parse(args.settings)
    first = next(iter(settings))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        for name in args.models.split(","):
            model = build_model(name, Path(tmp))
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                tps = measure(model, name, concurrency, settings, args, Path(tmp))
                base = statistics.median(tps[first])
                for setting, runs in tps.items():
                    median = statistics.median(runs)
                    rows.append([name, concurrency, setting, f"{median:.0f}", " ".join(f"{x:.0f}" for x in runs),
                                 f"{median / base:.2f}"])  # fmt: skip
    print(f"\n{args.tokens} greedy tokens per one-image request, TP=1; tokens/s, medians of {args.rounds} rounds")
    print(table(["model", "c", "setting", "tok/s", "rounds", f"/ {first}"], rows))


if __name__ == "__main__":
    main()
