"""A mixture-of-experts model's experts split over TP ranks, against whole
on every rank (`--moe-experts split|whole`): tokens/s and the scheduler's
memory, both in one run.

A tiny Qwen3-VL-MoE with random weights (`mmsplit tiny-model --family
qwen3-vl-moe`, 8 text layers 1,024 wide by default: 4 experts a layer, 2
per token, ~400 MiB of experts in float32) is served at TP=2 by a pair of
services per setting, the two settings alternated round after round. Each
round sends N text requests, C at a time, each generating T tokens (greedy,
`min_tokens` = `max_tokens`). After a pair's rounds, the proportional set
size of its scheduler's processes (rank 0 and its forked ranks) is read,
split into anonymous memory and pages of files (on a CPU host the whole
experts stay pages of the checkpoint file that the ranks share; split, each
rank's share is a private copy). Prints each setting's tokens/s (median of
its rounds), its memory, and split / whole. The tokens of both settings are
compared: greedy, they must be the same.

    .venv/bin/python bench/moe.py [--rounds 3] [--n 16] [--concurrency 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, run_clients, scratch_dir, table

from mmsplit_cli.client import make_request
from mmsplit_cli.launch import running_pair
from mmsplit_cli.tiny_model import build_once

SETTINGS = ("split", "whole")


def memory_mib(pid: int) -> dict[str, int]:
    """Pss_Anon and Pss_File (MiB) of `pid` and its descendants."""
    total = {"Pss_Anon": 0, "Pss_File": 0}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
            for line in rollup:
                key = line.split(":")[0]
                if key in total:
                    total[key] += int(line.split()[1])
    return {key: kib // 1024 for key, kib in total.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=16, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="tokens each request makes")
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--text-hidden", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, help="keep the model and the services' logs here")
    args = parser.parse_args()

    with scratch_dir(args.workdir) as work:
        model = build_once(
            work / f"moe-{args.text_layers}x{args.text_hidden}",
            cache_dir=ROOT / ".cache",
            family="qwen3-vl-moe",
            text_layers=args.text_layers,
            text_hidden=args.text_hidden,
        )
        topics = ["rain", "owls", "salt", "maps", "tides", "glass", "bread", "rivers"]
        requests = [
            make_request(
                f"Tell me a story about {topics[i % len(topics)]}, number {i}.",
                [],
                max_tokens=args.tokens,
                min_tokens=args.tokens,
            )
            for i in range(args.n)
        ]
        rates: dict[str, list[float]] = {s: [] for s in SETTINGS}
        memory: dict[str, dict[str, int]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds):
            for setting in SETTINGS if round_ % 2 == 0 else reversed(SETTINGS):
                logs = work / f"logs-{setting}-{round_}"
                logs.mkdir(parents=True, exist_ok=True)
                with running_pair(model, logs, tp=2, scheduler_extra=["--moe-experts", setting]) as pair:
                    run_clients(pair.tokenizer_address, requests[: args.concurrency], args.concurrency)  # warm-up
                    lines, wall = run_clients(pair.tokenizer_address, requests, args.concurrency)
                    failed = [line.error for line in lines if line.error]
                    if failed:
                        print(f"{setting}: {len(failed)} requests failed: {failed[0]}", file=sys.stderr)
                        return 1
                    rates[setting].append(sum(len(line.token_ids) for line in lines) / wall)
                    memory[setting] = memory_mib(pair.scheduler.pid)
                    tokens.setdefault(setting, [line.token_ids for line in lines])
                    split_lines = (logs / "scheduler.log").read_text().count("MoE layers split over")
                    if split_lines != (2 if setting == "split" else 0):
                        print(f"{setting}: {split_lines} ranks logged a split", file=sys.stderr)
                        return 1
                print(f"round {round_ + 1} {setting}: {rates[setting][-1]:.0f} tokens/s", flush=True)

    same = sum(a == b for a, b in zip(tokens["split"], tokens["whole"], strict=True))
    rows = []
    for setting in SETTINGS:
        rows.append(
            [
                setting,
                f"{statistics.median(rates[setting]):.0f}",
                " ".join(f"{r:.0f}" for r in rates[setting]),
                memory[setting]["Pss_Anon"],
                memory[setting]["Pss_File"],
            ]
        )
    print()
    print(
        f"tiny Qwen3-VL-MoE {args.text_layers}x{args.text_hidden} at TP=2 on this host: {args.n} requests x "
        f"{args.tokens} tokens, {args.concurrency} at a time; the scheduler's memory (rank 0 and rank 1) after "
        "its last round"
    )
    print(table(["experts", "tokens/s", "rounds", "anon MiB", "file MiB"], rows))
    ratio = statistics.median(rates["split"]) / statistics.median(rates["whole"])
    anon = memory["split"]["Pss_Anon"] - memory["whole"]["Pss_Anon"]
    print(f"split / whole: {ratio:.2f}x tokens/s, {anon:+d} MiB anonymous memory; tokens equal: {same}/{args.n}")
    return 0 if same == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
