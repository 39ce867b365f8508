"""What structured output (`SamplingParams.json_schema`) costs rank 0, in one run.

1. A sampling step (`Sampler.sample_rows`) of R greedy rows, each under a
   small JSON Schema, against R rows under none, interleaved over --rounds,
   medians, over the tiny LLaVA model's vocabulary (32,064 columns of
   logits; its tokenizer is a real one). The constrained rows are half-way
   into a document (one drawn under the schema from random logits first),
   and every timed step starts from that state (the timed steps' tokens
   are not taken).
2. What a request costs as it joins (the matcher made on the step thread)
   and as both services check it (the schema compiled), for a small schema
   and a 48 KB one (600 properties with patterns).

    python bench/structured.py [--rows 32] [--reps 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import build_model, table

from mmsplit_server import structured
from mmsplit_server.sampling import Sampling
from mmsplit_server.structured import Grammars
from scheduler_svc.sampler import RowSampling, Sampler

SMALL = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
LARGE = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,8}-(x|y|z)+[0-9]{2}$"} for i in range(600)},
    "required": [f"p{i}" for i in range(600)],
}
VOCAB = 32064


def per_call_ms(call, reps: int) -> float:  # type: ignore[no-untyped-def]
    call()
    began = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - began) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the scheduler's on this host)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="mmsplit-bench-") as tmp:
        model = build_model("tiny", Path(tmp))
        eos = frozenset([2])
        grammars = Grammars(model, eos)
        sampler = Sampler(eos)
        schema = json.dumps(SMALL)
        params = Sampling(max_tokens=256, structure=("json_schema", schema))
        gen = torch.Generator().manual_seed(3)
        first = RowSampling("first", params, 0, None, constraint=grammars.constraint(("json_schema", schema)))
        document: list[int] = []
        while len(document) < 64:
            token = sampler.sample(torch.randn(1, VOCAB, generator=gen), [first])[0]
            assert isinstance(token, int), token
            if token in eos:
                break
            first.took(token)
            document.append(token)
        steps = len(document) // 2
        constrained = [
            RowSampling(f"c{i}", params, 0, None, constraint=grammars.constraint(("json_schema", schema)))
            for i in range(args.rows)
        ]
        for row in constrained:
            for token in document[:steps]:
                row.took(token)
        plain = [RowSampling(f"p{i}", Sampling(max_tokens=256), 0, None) for i in range(args.rows)]
        logits = torch.randn(args.rows, VOCAB, generator=gen)
        times: dict[str, list[float]] = {"none": [], "schema": []}
        for _ in range(args.rounds):
            for arm, rows in (("none", plain), ("schema", constrained)):
                times[arm].append(per_call_ms(lambda r=rows: sampler.sample_rows(logits.clone(), r), args.reps))
        base, new = (statistics.median(times[k]) for k in ("none", "schema"))
        print(
            f"a sampling step of {args.rows} greedy rows, {VOCAB} columns, {steps} tokens into a"
            f" {len(document)}-token document"
            f" (medians of {args.rounds} rounds x {args.reps}):"
        )
        rows_out = [["none", f"{base:.2f}", "1.00x"], ["json_schema", f"{new:.2f}", f"{new / base:.2f}x"]]
        print(table(["rows", "ms a step", "/ none"], rows_out))
        out = []
        for name, doc in (("small", SMALL), ("48 KB, 600 patterns", LARGE)):
            text = json.dumps(doc)
            spec = ("json_schema", text)
            compile_ms = per_call_ms(lambda s=spec: structured._compiled.__wrapped__(s), 5)
            structured.grammar(spec)  # as both services leave it: cached
            join_ms = per_call_ms(lambda s=spec: grammars.constraint(s), 5)
            out.append([name, f"{len(text)}", f"{compile_ms:.1f}", f"{join_ms:.1f}"])
        print("\nwhat one request costs (means of 5)")
        print(table(["schema", "bytes", "compiling ms (each service)", "matcher at join ms (step thread)"], out))


if __name__ == "__main__":
    main()
