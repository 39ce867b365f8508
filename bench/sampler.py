"""Rank 0's greedy pick: `torch.max(dim=1)` against `row_argmax`, in one run.

Every step rank 0 takes each row's maximum and its index over the whole
vocabulary (`scheduler_svc.sampler.Sampler.sample_rows`). On CPU torch's
index-tracking reduction is not vectorized; `row_argmax` reduces blocks of
columns with the vectorized plain maximum first. For 1, 8 and 32 rows over
LLaVA-1.5's vocabulary (32,064), the tiny test models' and the HF LLaVA-1.5
conversion's (32,001: no block width divides it) and Qwen2-VL's (151,936): µs per call of
each, interleaved over --rounds, medians, and the ratio; every call's
indices and values are checked equal to torch's. Also the whole
`Sampler.sample_rows` step for 32 greedy rows under min_tokens (EOS banned
on every row), as the benchmark's requests run; and what logit_bias and
the penalties add to it: 32 greedy rows each asking for all of them
(repetition_penalty over a 600-token prompt, frequency and presence
penalties, 8 biased ids), 64 tokens into their output, against 32 rows
asking for none, interleaved.

    python bench/sampler.py [--reps 200] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import per_call_us, table

from mmsplit_server.sampling import Sampling
from scheduler_svc.sampler import LogitAdjust, RowSampling, Sampler, row_argmax

VOCABULARIES = {"llava-1.5": 32064, "llava-hf": 32001, "qwen2-vl": 151936}


def torch_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, index = logits.max(dim=1)
    return top, index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the scheduler's on this host)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    for name, vocab in VOCABULARIES.items():
        for rows in (1, 8, 32):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
            want, got = torch_max(logits), row_argmax(logits)
            assert torch.equal(want[1], got[1]), (name, rows)
            assert torch.equal(want[0], got[0]), (name, rows)
            times: dict[str, list[float]] = {"torch.max": [], "row_argmax": []}
            for _ in range(args.rounds):
                times["torch.max"].append(per_call_us(lambda x=logits: torch_max(x), args.reps))
                times["row_argmax"].append(per_call_us(lambda x=logits: row_argmax(x), args.reps))
            base, new = (statistics.median(times[k]) for k in ("torch.max", "row_argmax"))
            rows_out.append([f"{name} {rows} rows", f"{base:.0f}", f"{new:.0f}", f"{base / new:.2f}x"])
    print(table(["logits", "torch.max µs", "row_argmax µs", "speed-up"], rows_out))

    sampler = Sampler(frozenset([2]))
    greedy = [RowSampling(f"r{i}", Sampling(max_tokens=32, min_tokens=32), 0, None) for i in range(32)]
    for name, vocab in VOCABULARIES.items():
        logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(7))
        step = statistics.median(
            per_call_us(lambda x=logits: sampler.sample_rows(x, greedy), args.reps) for _ in range(3)
        )
        print(f"Sampler.sample_rows, 32 greedy rows under min_tokens, {name}: {step:.0f} µs per step")
    penalties(sampler, args)


def penalties(sampler: Sampler, args: argparse.Namespace) -> None:
    asks = Sampling(
        max_tokens=4096,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias=tuple((t, 1.0) for t in range(100, 900, 100)),
    )
    prompt = tuple(range(1000, 1600))
    out = []
    for name, vocab in VOCABULARIES.items():
        gen = torch.Generator().manual_seed(11)
        plain = [RowSampling(f"p{i}", Sampling(max_tokens=4096), 0, None) for i in range(32)]
        adjusted = [RowSampling(f"a{i}", asks, 0, None, LogitAdjust(asks, prompt)) for i in range(32)]
        for _ in range(64):  # 64 tokens of output each, some repeated
            tokens = sampler.sample(torch.randn(32, vocab, generator=gen), adjusted)
            for row, token in zip(adjusted, tokens, strict=True):
                row.took(token)  # type: ignore[arg-type]
        logits = torch.randn(32, vocab, generator=gen)
        times: dict[str, list[float]] = {"none": [], "all": []}
        for _ in range(args.rounds):
            for arm, rows in (("none", plain), ("all", adjusted)):
                times[arm].append(per_call_us(lambda x=logits, r=rows: sampler.sample_rows(x.clone(), r), args.reps))
        base, new = (statistics.median(times[k]) for k in ("none", "all"))
        out.append([name, f"{base:.0f}", f"{new:.0f}", f"{new / base:.2f}x", f"{(new - base) / 32:.1f}"])
    print("\nSampler.sample_rows, 32 greedy rows: none asking for a penalty or bias, against all asking for all")
    print(table(["vocabulary", "none µs", "all µs", "all / none", "µs more per row"], out))


if __name__ == "__main__":
    main()
