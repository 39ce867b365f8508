"""Multi-turn chats with images through both services and the
OpenAI-compatible API, with the scheduler's prefix cache on and off.

`bench/multiturn.py` measures the prefix cache in the engine alone, with
token ids made by hand. This is the same workload as a chat client makes
it: the official `openai` SDK streams chat completions from two service
pairs running at once (TP=1, the tiny LLaVA of `--model` with the chat
template its family's checkpoints ship), one with the default
`--prefix-cache-bytes` and one with `--prefix-cache-bytes 0`; both keep
every other cache (the tokenizer's preprocessing, the scheduler's encoder
outputs). C conversations run at once, each 4 turns: a system message
(the same for all), then a question with its own image (a JPEG data URL);
each later turn resends the whole conversation, the answers as the
client read them, plus a new question. Each conversation goes on to its
next turn when its answer ends, as clients do. The answer's text is
re-tokenized by the chat template on the next turn, so a cached prefix
ends where that text's tokens part from the ids the model made.

Printed per turn: the time to first token (the first streamed chunk that
carries a token id, `return_token_ids`) with the cache on and off, their
ratio, and the share of the prompt tokens the API's usage reports as
cached (`prompt_tokens_details.cached_tokens`); and whether both arms gave
the same answers (greedy: they must). Each round has its own images and
text, the same for both arms; the arms alternate which goes first; round
0 warms up and is not counted.

    python bench/chat_turns.py [--model 8x512] [--conversations 4] [--system 250] [--answer 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import build_model, scratch_dir, table

from mmsplit_cli import samples
from mmsplit_cli.launch import running_pair
from mmsplit_server.serving import free_port

TURNS = 4
# The words of the system message and the questions: common English ones.
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "an",
    "be",
    "this",
    "from",
    "or",
    "have",
    "are",
]
ARMS = {"on": [], "off": ["--prefix-cache-bytes", "0"]}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(
    api: Any, model: str, system: str, image: bytes, questions: list[str], answer: int
) -> list[dict[str, Any]]:
    """One chat of len(questions) turns; per turn its TTFT (s), prompt and
    cached tokens (the usage's) and answer."""
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    turns = []
    for t, question in enumerate(questions):
        content: Any = question
        if t == 0:
            content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}]
        messages.append({"role": "user", "content": content})
        sent, first, text, usage = time.perf_counter(), None, [], None
        stream = await api.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=answer,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": answer, "return_token_ids": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if first is None and getattr(choice, "token_ids", None):
                    first = time.perf_counter()
                text.append(choice.delta.content or "")
        if first is None or usage is None:
            raise RuntimeError(f"turn {t + 1}: no token or no usage in the stream")
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None and details.cached_tokens else 0
        reply = "".join(text)
        messages.append({"role": "assistant", "content": reply})
        turns.append({"ttft": first - sent, "prompt": usage.prompt_tokens, "cached": cached, "answer": reply})
    return turns


async def one_arm(port: int, system: str, images: list[bytes], questions: list[list[str]], answer: int) -> list[Any]:
    import openai

    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        model = (await api.models.list()).data[0].id
        chats = (
            conversation(api, model, system, image, qs, answer) for image, qs in zip(images, questions, strict=True)
        )
        return list(await asyncio.gather(*chats))
    finally:
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8x512", help="tiny or 8x512")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--system", type=int, default=250, help="words of the system message")
    parser.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and the logs go")
    args = parser.parse_args()
    if args.rounds < 1 or args.conversations < 1:
        parser.error("--rounds and --conversations: at least 1")

    ttft: dict[str, list[list[float]]] = {arm: [[] for _ in range(TURNS)] for arm in ARMS}
    cached = {arm: [[0, 0] for _ in range(TURNS)] for arm in ARMS}
    same = True
    with scratch_dir(args.workdir) as workdir, contextlib.ExitStack() as stack:
        model = build_model(args.model, workdir, chat=True)
        ports = {}
        for arm, extra in ARMS.items():
            logs = workdir / f"logs-{arm}"
            logs.mkdir(exist_ok=True)
            ports[arm] = free_port()
            http = ["--http-port", str(ports[arm])]
            stack.enter_context(running_pair(model, logs, tp=1, scheduler_extra=extra, tokenizer_extra=http))
        for r in range(args.rounds + 1):
            rng = random.Random(r)
            system = words(rng, args.system)
            images = [samples.good_jpeg(seed=1000 * r + c) for c in range(args.conversations)]
            questions = [[words(rng, 20) + "?" for _ in range(TURNS)] for _ in range(args.conversations)]
            answers = {}
            for arm in list(ARMS)[r % 2 :] + list(ARMS)[: r % 2]:
                chats = asyncio.run(one_arm(ports[arm], system, images, questions, args.answer))
                answers[arm] = [[turn["answer"] for turn in chat] for chat in chats]
                for chat in chats if r else ():
                    for t, turn in enumerate(chat):
                        ttft[arm][t].append(turn["ttft"])
                        cached[arm][t][0] += turn["cached"]
                        cached[arm][t][1] += turn["prompt"]
            same &= answers["on"] == answers["off"]
    rows = []
    for t in range(TURNS):
        on, off = statistics.median(ttft["on"][t]), statistics.median(ttft["off"][t])
        hit, prompt = cached["on"][t]
        rows.append([t + 1, f"{off * 1000:.0f}", f"{on * 1000:.0f}", f"{on / off:.2f}x", f"{hit / prompt:.0%}"])
    print(f"{args.conversations} conversations x {TURNS} turns at once through the OpenAI-compatible API (openai SDK, "
          f"streamed), the {args.model} LLaVA at TP=1: a {args.system}-word system message, a question and an image, "
          f"then the whole conversation again each turn with a new question; {args.answer}-token answers; "
          f"{args.rounds} rounds, medians")  # fmt: skip
    print(table(["turn", "TTFT off ms", "TTFT on ms", "on/off", "prompt from cache"], rows))
    later = [statistics.median(ttft["on"][t]) / statistics.median(ttft["off"][t]) for t in range(1, TURNS)]
    print(f"turns 2-{TURNS}: TTFT with the cache {min(later):.2f}-{max(later):.2f}x of without")
    print(f"cached tokens reported with the cache off: {sum(c[0] for c in cached['off'])}")
    print(f"same answers with the cache on and off (every conversation, every round): {same}")


if __name__ == "__main__":
    main()
