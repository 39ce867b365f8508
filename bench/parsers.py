"""What reading an answer's tool calls and a prompt's thinking costs the
tokenizer's event loop, in one run.

Tool calls: `--tool-call-parser hermes` and `qwen3_coder` split a whole
answer at its end (`tool_calls.Hermes._calls`): ms per split of an answer
of 20 calls after a line of text, and of an answer of N unclosed
``<tool_call>`` openings in ~22,000 characters (what a model cut short
while repeating itself writes), against the lazy regex `hermes` used
before (``<tool_call>\\s*(.*?)\\s*</tool_call>``, which scans to the end
from every opening), with the ratio. Both find the same calls.

Reasoning: `Think.opens` per request (with --reasoning-parser and the tags
tokens of their own): µs for prompts of 1,000 to 100,000 ids with no tag
(a scan of the whole prompt), ending with ``<think>`` (the last ids
looked at one by one) and an assistant turn continued 600 ids into its
thinking (the whole prompt scanned for the last tag), against the tail
check a tokenizer that spells the tags in pieces gets (a decode of 8 ids).

    python bench/parsers.py [--reps 20] [--rounds 3] [--openings 1500]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import per_call_us, table

from mmsplit_server import strict_json
from tokenizer_svc.reasoning import Think
from tokenizer_svc.tool_calls import PARSERS, _arguments, _tool_call

LAZY = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def lazy_hermes(text: str) -> list[str] | None:
    """The names of the calls as `hermes` found them before: a lazy regex
    from the first opening, then the same reading and the same call
    objects as now."""
    at = text.find("<tool_call>")
    if at < 0:
        return None
    calls = []
    for found in LAZY.finditer(text, at):
        try:
            call = strict_json.loads(found.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append(_tool_call(call["name"], _arguments(call.get("arguments", {}))))
    return [c["function"]["name"] for c in calls] or None


def names(split: tuple[object, list[dict] | None]) -> list[str] | None:
    calls = split[1]
    return None if calls is None else [c["function"]["name"] for c in calls]


def ms_per_call(call: Callable[[], object], reps: int) -> float:
    return per_call_us(call, reps) / 1e3


class Ids:
    """A tokenizer whose tags are tokens of their own (ids 1 and 2)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [1], "</think>": [2]}.get(text, [7, 7])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join({1: "<think>", 2: "</think>"}.get(i, "x") for i in ids)


class Pieces(Ids):
    """The same, spelling the tags in pieces (the tail check)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [7] * len(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--openings", type=int, default=1500, help="unclosed <tool_call> openings in the long answer")
    args = parser.parse_args()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    coder = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n"
    unclosed = "Let me see. " + "<tool_call>{" * args.openings + "a" * 4000
    answers = {
        "20 calls": ("Let me look.\n" + call * 20, "Let me look.\n" + coder * 20),
        f"{args.openings} unclosed, {len(unclosed):,} chars": (unclosed, unclosed),
    }
    rows = []
    for label, (hermes_text, coder_text) in answers.items():
        hermes, qwen3_coder = PARSERS["hermes"](), PARSERS["qwen3_coder"]()
        assert names(hermes.split(hermes_text)) == lazy_hermes(hermes_text), label
        times: dict[str, list[float]] = {"lazy": [], "hermes": [], "qwen3_coder": []}
        for _ in range(args.rounds):  # interleaved
            times["lazy"].append(ms_per_call(lambda t=hermes_text: lazy_hermes(t), args.reps))
            times["hermes"].append(ms_per_call(lambda t=hermes_text, p=hermes: p.split(t), args.reps))
            times["qwen3_coder"].append(ms_per_call(lambda t=coder_text, p=qwen3_coder: p.split(t), args.reps))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append([label, f"{med['lazy']:.3f}", f"{med['hermes']:.3f}", f"{med['hermes'] / med['lazy']:.4f}",
                     f"{med['qwen3_coder']:.3f}"])  # fmt: skip
    print(f"tool calls, ms per whole-answer split (medians of {args.rounds} interleaved rounds of {args.reps})")
    print(table(["answer", "lazy regex (before)", "hermes", "hermes / before", "qwen3_coder"], rows))

    own, pieces = Think(Ids()), Think(Pieces())
    rows = []
    for n in (1_000, 10_000, 100_000):
        plain = [7] * n
        opened = [7] * (n - 2) + [1, 7]
        continued = [7] * (n - 600) + [1] + [7] * 599  # an assistant turn continued 600 ids into its thinking
        assert [own.opens(plain), own.opens(opened), own.opens(continued), pieces.opens(opened[:-1])] == [
            False,
            True,
            True,
            True,
        ]
        us = {
            name: statistics.median(
                ms_per_call(lambda p=prompt, t=think: t.opens(p), args.reps) * 1e3 for _ in range(args.rounds)
            )
            for name, prompt, think in (
                ("no tag", plain, own),
                ("ends with <think>", opened, own),
                ("continued", continued, own),
                ("tail check", plain, pieces),
            )
        }
        rows.append([f"{n:,}", *(f"{us[k]:.1f}" for k in ("no tag", "ends with <think>", "continued", "tail check"))])
    print()
    print("reasoning: Think.opens per request, µs (tags tokens of their own; a tokenizer that spells them in pieces)")
    print(table(["prompt ids", "no tag", "ends with <think>", "continued 600 ids", "tail check (pieces)"], rows))


if __name__ == "__main__":
    main()
