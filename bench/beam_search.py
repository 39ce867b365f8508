"""Beam search through the services (`GenerateRequest.beam_search`, one
scheduler request per live beam and step) against transformers' own beam
search in process, and against the services making as many tokens by
sampling (`n` choices), in the same run.

One image prompt; each round, in turn: the services' beam search of width
W over T tokens (`ignore_eos`: every search runs T steps), the services'
n = W sampled choices of T tokens each, and `generate(num_beams=W,
num_return_sequences=W)` in this process on the same ids and pixels (no
end-of-sequence id: its beams run T steps too). Printed: seconds a request,
medians over the rounds, the ratios, and whether the services' beams are
transformers' (they should be: tests/e2e/test_http_api.py checks it).

    python bench/beam_search.py [--model 8x512] [--width 4] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from harness import build_model, scratch_dir, table

from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import make_request
from mmsplit_cli.launch import running_pair

PROMPT = "Describe the picture in detail."


def served(stub: Any, request: tokenizer_pb2.GenerateRequest, width: int) -> tuple[float, list[list[int]]]:
    """Seconds for the whole answer, and each choice's token ids."""
    choices: list[list[int]] = [[] for _ in range(width)]
    start = time.perf_counter()
    for event in stub.Generate(request, timeout=600):
        if event.HasField("delta"):
            choices[event.index].extend(event.delta.token_ids)
    return time.perf_counter() - start, choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8x512", help="tiny or 8x512")
    parser.add_argument("--width", type=int, default=4, help="beams (and sampled choices)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens each beam or choice makes")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (one more warms up)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tokenizer_svc.decode import decode_image

    torch.set_grad_enabled(False)
    image = samples.good_jpeg(seed=7)
    width, tokens = args.width, args.tokens
    with scratch_dir(args.workdir) as workdir:
        model_dir = build_model(args.model, workdir)
        processor = AutoProcessor.from_pretrained(model_dir)
        model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # the beams run every step, as with ignore_eos
        made = processor(
            images=[decode_image(image, max_pixels=10**8)],
            text=f"{processor.image_token}\n{PROMPT}",
            return_tensors="pt",
        )
        prompt_len = made["input_ids"].shape[1]

        def in_process() -> tuple[float, list[list[int]]]:
            start = time.perf_counter()
            out = model.generate(
                **made, max_new_tokens=tokens, num_beams=width, num_return_sequences=width, do_sample=False,
                early_stopping=False, pad_token_id=0,
            )  # fmt: skip
            return time.perf_counter() - start, [row[prompt_len:] for row in out.tolist()]

        beam = make_request(f"<image>\n{PROMPT}", [image], max_tokens=tokens, ignore_eos=True)
        beam.n = width
        beam.beam_search.SetInParent()
        sampled = make_request(
            f"<image>\n{PROMPT}", [image], max_tokens=tokens, min_tokens=tokens, temperature=1.0, seed=1
        )
        sampled.n = width
        logs = workdir / "logs"
        logs.mkdir(exist_ok=True)
        with running_pair(model_dir, logs, tp=1) as pair, grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            arms = {
                "services, beam search": lambda: served(stub, beam, width),
                f"services, n={width} sampled": lambda: served(stub, sampled, width),
                "transformers' beam search, in process": in_process,
            }
            seconds: dict[str, list[float]] = {arm: [] for arm in arms}
            beams: dict[str, list[list[int]]] = {}
            for round_ in range(args.rounds + 1):
                for arm, run in arms.items():
                    took, beams[arm] = run()
                    if round_:  # the first round warms up
                        seconds[arm].append(took)
    median = {arm: statistics.median(s) for arm, s in seconds.items()}
    mine, theirs = beams["services, beam search"], beams["transformers' beam search, in process"]
    print(f"{args.model}: width {width}, {tokens} tokens a beam, prompt {prompt_len} tokens, {args.rounds} rounds")
    rows = [[arm, f"{1000 * s:.0f}", f"{width * tokens / s:.0f}"] for arm, s in median.items()]
    print(table(["arm", "ms a request (median)", "tokens/s"], rows))
    base = median["services, beam search"]
    hf, sampling = median["transformers' beam search, in process"], median[f"services, n={width} sampled"]
    print(f"beam search, services / transformers in process: {base / hf:.2f}x the time")
    print(f"beam search / n={width} sampled, both through the services: {base / sampling:.2f}x the time")
    same = sum(a == b for a, b in zip(mine, theirs, strict=True))
    print(f"the services' beams are transformers': {same}/{width}")


if __name__ == "__main__":
    main()
