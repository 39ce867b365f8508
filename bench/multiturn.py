"""Multi-turn chat with images: what the scheduler's prefix cache saves, and
what it costs when nothing is shared.

In ONE run, on the 8-layer 512-wide tiny LLaVA, the scheduler's `Engine` in
this process (a group of one; its encoder cache on, as in service), with
the prefix cache on (`--prefix-cache-bytes`, default 1 GiB) and off, arms
interleaved over rounds:

- **multi-turn**: C conversations at once, 4 turns each. Turn 1 is a
  system prompt of S tokens, an image and a question; each later turn
  resends the whole conversation — every earlier prompt and answer — plus
  a new question, as chat clients do. The C conversations' turn t join in
  one step; a turn's time to first token is that step's time (its prefill
  and the first token). Printed per turn: TTFT with the cache on and off
  and their ratio, the share of the prompt taken from the cache, and
  tokens/s over the whole workload.
- **no shared prefix**: the same number of requests and tokens, every
  prompt its own random text (the cache looks up, misses, and keeps every
  request's blocks): tokens/s with the cache on and off, each arm run
  `--unshared-repeats` times a round (the cost looked for is a few %, a
  run's speed on this host scatters by a tenth), and the spread of on/off
  over the pairs of runs made one after the other.
- **shared system prompt, at once**: 4 x C requests queued together, each
  the same system prompt then its own image and question, through rank
  0's step loop (whose planner lets a request wait for a prefill of the
  text it starts with, `--wait-for-shared-prefix`, where its costs seen so
  far say computing it again costs more than a step; a first burst with
  another system prompt gives it those costs): time to first token
  p50/p90 and the time until all are done, with the cache on and waiting
  allowed (the default), on without waiting, and off.
- **shared system prompt, staggered**: 4 x C requests, one joining each
  step while the earlier ones still decode (answers 4x as long), each the
  same system prompt then its own image and question: the median time to
  first token of all but the first, with the cache on and off, and the
  share of their prompts taken from the cache. A prompt's blocks are kept
  the step after it is prefilled, so a request can take them while the
  one that made them runs.

- **identical prompts at once**: C (at least 2) requests of one prompt (the system
  prompt, an image and a question) queued together through rank 0's step
  loop, as the n choices of one request are: the time until each has its
  first token with their prefill shared (the planner admits them together,
  one row prefilled, the others copies of it: the default) and with each
  prefilled in its own row; and the same prompts prefilled in 4 chunks,
  the chunk also the step's prefill budget as in service (shared: one
  prompt's chunks and copies; not: each prompt's own chunks, one after
  another). A burst of another such prompt goes first, not counted.

Also whether both arms made the same tokens (greedy: they must); and,
unless `--no-chunked`, one round of `bench/chunked_prefill.py` (16 streams
decoding while a 6,000-token prompt joins, with chunked prefill and
without: the streams' inter-token latency p50 and p99), so that every
figure of the issue's Engine II targets comes from this one script.

    python bench/multiturn.py [--conversations 4] [--system 300] [--answer 8] [--rounds 3] [--no-chunked]
                              [--unshared-repeats 4] [--model 8x512] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import SoloGroup, build_model, inline_reader, percentile, scratch_dir, table

TURNS = 4
IMAGE_TOKENS = 64  # the tiny LLaVA's placeholders per image
IMAGE_TOKEN_ID = 32000
# The identical prompts' arm is run again prefilled in this many chunks.
CHUNKS = 4


def engine(model: Any, prefix_bytes: int, **options: Any) -> Any:
    """The scheduler's engine in this process, a group of one (`options`:
    more of `Engine`'s keywords, e.g. `cudnn_attention`)."""
    import torch

    from scheduler_svc.engine import Engine

    return Engine(model, SoloGroup(), inline_reader(), torch.device(model.device), eos_token_ids=frozenset(),
                  encoder_cache_bytes=256 << 20, prefix_cache_bytes=prefix_bytes, **options)  # fmt: skip


def image(seed: int) -> Any:
    import numpy as np

    from mmsplit.common.v1 import common_pb2
    from mmsplit_server.handoff.reference import TensorSpec

    array = np.random.default_rng(seed).standard_normal((1, 3, 224, 224), dtype=np.float32)
    return TensorSpec(common_pb2.DTYPE_FLOAT32, (1, 3, 224, 224), inline=array.tobytes())


def request(rid: str, ids: list[int], pictures: list[Any], answer: int) -> Any:
    from mmsplit.common.v1 import common_pb2
    from mmsplit_server.sampling import Sampling
    from scheduler_svc.plan import Item, NewRequest

    runs = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != IMAGE_TOKEN_ID)]
    # Each image's content hash, as the tokenizer sends it (its preprocessing key).
    items = tuple(
        Item(
            common_pb2.MODALITY_IMAGE,
            (("pixel_values", spec),),
            {},
            ((start, IMAGE_TOKENS),),
            hashlib.blake2b(spec.inline, digest_size=16).digest(),
        )
        for start, spec in zip(runs, pictures, strict=True)
    )
    return NewRequest(rid, tuple(ids), items, Sampling(max_tokens=answer, min_tokens=answer))


def took(made: dict[str, list[int]], sampled: dict[str, int], answer: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """A step's sampled tokens added to `made`: the requests to feed next,
    and those that made `answer` tokens (to drop, and keep)."""
    feeds, done = {}, []
    for rid, token in sampled.items():
        made.setdefault(rid, []).append(token)
        if len(made[rid]) >= answer:
            done.append(rid)
        else:
            feeds[rid] = token
    return feeds, tuple(done)


def run_turns(eng: Any, batches: list[list[Any]]) -> tuple[list[float], dict[str, list[int]], float, int]:
    """Each batch joins in one step and decodes to its end before the next
    joins. (the join steps' seconds, every request's tokens, the whole
    time, tokens made)."""
    from scheduler_svc.plan import Plan

    made: dict[str, list[int]] = {}
    joins: list[float] = []
    step = 0
    started = time.perf_counter()
    for batch in batches:
        feeds: dict[str, int] = {}
        drop: tuple[str, ...] = ()
        new = tuple(batch)
        while new or feeds or drop:
            t0 = time.perf_counter()
            outcome = eng.step(Plan(step=step, new=new, drop=drop, feed=tuple(feeds.items()), keep=drop))
            if new:
                joins.append(time.perf_counter() - t0)
            step += 1
            new = ()
            feeds, drop = took(made, outcome.sampled, batch[0].sampling.max_tokens)
    return joins, made, time.perf_counter() - started, sum(len(v) for v in made.values())


Workload = tuple[list[list[float]], dict[str, list[int]], float, int]


def conversations(eng: Any, n: int, system: int, answer: int, seed: int) -> Workload:
    """The multi-turn workload: per turn, each step's join time."""
    rng = random.Random(seed)
    prefix = [1, *(rng.randrange(100, 30000) for _ in range(system))]
    chats = [
        {"ids": [*prefix, *([IMAGE_TOKEN_ID] * IMAGE_TOKENS)], "pictures": [image(seed * 100 + c)]} for c in range(n)
    ]
    per_turn: list[list[float]] = []
    made: dict[str, list[int]] = {}
    total, tokens = 0.0, 0
    for turn in range(TURNS):
        batch = []
        for c, chat in enumerate(chats):
            chat["ids"] = [*chat["ids"], *(rng.randrange(100, 30000) for _ in range(rng.randrange(20, 40)))]
            batch.append(request(f"c{c}t{turn}", chat["ids"], chat["pictures"], answer))
        joins, out, seconds, count = run_turns(eng, [batch])
        per_turn.append(joins)
        made |= out
        total += seconds
        tokens += count
        for c, chat in enumerate(chats):
            chat["ids"] = [*chat["ids"], *out[f"c{c}t{turn}"]]
    return per_turn, made, total, tokens


def sharing_a_system_prompt(tag: str, n: int, system: int, answer: int, seed: int) -> list[Any]:
    """`n` requests, each the same `system` tokens, then its own image and
    30 tokens of question."""
    rng = random.Random(seed)
    prefix = [1, *(rng.randrange(100, 30000) for _ in range(system))]
    return [
        request(
            f"{tag}{k}",
            [*prefix, *([IMAGE_TOKEN_ID] * IMAGE_TOKENS), *(rng.randrange(100, 30000) for _ in range(30))],
            [image(seed * 100 + k)],
            answer,
        )
        for k in range(n)
    ]


def staggered(eng: Any, n: int, system: int, answer: int, seed: int) -> tuple[list[float], dict[str, list[int]]]:
    """`n` requests sharing a system prompt, one joining each step: the
    join steps' seconds (all but the first request's) and every request's tokens."""
    from scheduler_svc.plan import Plan

    arrivals = sharing_a_system_prompt("s", n, system, answer, seed + 11)
    made: dict[str, list[int]] = {}
    joins: list[float] = []
    feeds: dict[str, int] = {}
    drop: tuple[str, ...] = ()
    step = 0
    while step < n or feeds or drop:
        new = (arrivals[step],) if step < n else ()
        t0 = time.perf_counter()
        outcome = eng.step(Plan(step=step, new=new, drop=drop, feed=tuple(feeds.items()), keep=drop))
        if new and step:
            joins.append(time.perf_counter() - t0)
        step += 1
        feeds, drop = took(made, outcome.sampled, answer)
    return joins, made


@dataclass
class AtOnce:
    ttft: list[float]  # each request's, from the queueing of all
    seconds: float  # until the last one ended
    made: dict[str, list[int]]
    hit_tokens: int
    prompt_tokens: int


def at_once(model: Any, prefix_bytes: int, wait: int, n: int, system: int, answer: int, seed: int) -> AtOnce:
    """`n` requests queued together, each the same system prompt then its
    own image and question, through rank 0's step loop over the engine (its
    planner decides who waits for whose prefill: `--wait-for-shared-prefix`
    is `wait`). A burst with another system prompt goes first and is not
    counted: the planner weighs waiting against the step costs it has seen
    (at a cold start, with none seen, it waits)."""
    from scheduler_svc.settings import SchedulerSettings

    settings = SchedulerSettings(model_dir=Path("unused"), wait_for_shared_prefix=wait)
    bursts = [sharing_a_system_prompt(tag, n, system, answer, seed + s) for tag, s in (("warm", 29), ("a", 23))]
    return through_loop(engine(model, prefix_bytes), settings, bursts, answer)


def through_loop(eng: Any, settings: Any, bursts: list[list[Any]], answer: int) -> AtOnce:
    """Each burst's requests queued together through rank 0's step loop
    over `eng`, the next burst once all have ended: the last burst's
    figures (the ones before warm the planner's step costs up)."""
    import threading

    from scheduler_svc.loop import Admission, Event, Finished, StepLoop, Token

    made: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    ended = threading.Semaphore(0)
    failed: list[Event] = []
    started = 0.0

    def emit(event: Event, rid: str) -> None:
        if isinstance(event, Token):
            ttft.setdefault(rid, time.perf_counter() - started)
            made.setdefault(rid, []).append(event.token_id)
            return
        if not isinstance(event, Finished):
            failed.append(event)
        ended.release()

    loop = StepLoop(eng, SoloGroup(), settings, eos_token_ids=frozenset(), max_context=1 << 20,  # type: ignore[arg-type]
                    kv_budget_tokens=1 << 30, post=lambda fn: fn(), on_fatal=lambda exc: None)  # fmt: skip
    thread = threading.Thread(target=loop.run)
    store = eng.prefix_cache
    try:
        for requests in bursts:
            made.clear()
            ttft.clear()
            hit, prompt = store.hit_tokens, store.prompt_tokens
            started = time.perf_counter()
            # Queued within the loop's batch window (or before it starts): they join together.
            for req in requests:
                loop.submit(Admission(req, lambda e, r=req.request_id: emit(e, r), reserve=len(req.input_ids) + answer))
            if not thread.is_alive():
                thread.start()
            for _ in requests:
                ended.acquire()
            seconds = time.perf_counter() - started
    finally:
        loop.request_stop()
        thread.join()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    return AtOnce(list(ttft.values()), seconds, dict(made), store.hit_tokens - hit, store.prompt_tokens - prompt)


def identical(
    model: Any, n: int, system: int, answer: int, seed: int, *, share: bool, chunk: int
) -> tuple[float, dict[str, list[int]]]:
    """`n` requests of one prompt queued together through rank 0's step
    loop, as the n choices of one request are (a prompt of `chunk` tokens or
    more, with `chunk`, is prefilled in chunks of it, which is then the
    step's prefill budget, `--max-prefill-tokens`, as in service): the
    seconds until every one has its first token, and every request's
    tokens. A burst of another such prompt goes first, not counted."""
    from scheduler_svc.settings import SchedulerSettings

    def burst(tag: str, seed: int) -> list[Any]:
        rng = random.Random(seed)
        ids = [1, *(rng.randrange(100, 30000) for _ in range(system)), *[IMAGE_TOKEN_ID] * IMAGE_TOKENS]
        ids += [rng.randrange(100, 30000) for _ in range(30)]
        return [request(f"{tag}{c}", ids, [image(seed)], answer) for c in range(n)]

    settings = SchedulerSettings(model_dir=Path("unused"), **({"max_prefill_tokens": chunk} if chunk else {}))
    eng = engine(model, 1 << 30, share_prefills=share, prefill_chunk=chunk)
    run = through_loop(eng, settings, [burst("warm", seed + 31), burst("i", seed + 11)], answer)
    return max(run.ttft), run.made


def unshared(eng: Any, n: int, lengths: list[int], answer: int, seed: int) -> tuple[float, int, dict[str, list[int]]]:
    """As many requests as the multi-turn workload, of its prompt lengths,
    every prompt its own random text."""
    rng = random.Random(seed + 7)
    batches = [
        [
            request(f"u{t}-{c}", [1, *(rng.randrange(100, 30000) for _ in range(length - 1))], [], answer)
            for c in range(n)
        ]
        for t, length in enumerate(lengths)
    ]
    _, made, seconds, tokens = run_turns(eng, batches)
    return seconds, tokens, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--system", type=int, default=300, help="system prompt tokens")
    parser.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unshared-repeats", type=int, default=4,
                        help="runs of each arm of the no-shared-prefix workload per round")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--no-chunked", action="store_true", help="skip the chunked-prefill round")
    parser.add_argument("--model", default="8x512", help="tiny or 8x512 (the targets are for 8x512)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the chunked-prefill round is on the CPU)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 on a GPU, say)")
    args = parser.parse_args()
    if args.rounds < 1 or args.unshared_repeats < 1:
        parser.error("--rounds and --unshared-repeats: at least 1 (each figure is a median over them)")

    import torch
    from transformers import AutoModelForImageTextToText

    torch.set_grad_enabled(False)
    with scratch_dir(args.workdir) as workdir:
        model_dir = build_model(args.model, workdir)
        dtype = getattr(torch, args.dtype)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        arms = {"on": 1 << 30, "off": 0}
        ttft: dict[str, list[list[float]]] = {arm: [[] for _ in range(TURNS)] for arm in arms}
        rate: dict[str, list[float]] = {arm: [] for arm in arms}
        flat: dict[str, list[float]] = {arm: [] for arm in arms}
        stagger: dict[str, list[float]] = {arm: [] for arm in arms}
        stagger_hit = stagger_prompt = 0
        # The prefix cache on with the step loop's waiting for a shared prefill, on without it, and off.
        burst_arms = {"waits": (1 << 30, 64), "no wait": (1 << 30, 0), "off": (0, 0)}
        burst: dict[str, list[AtOnce]] = {arm: [] for arm in burst_arms}
        share_arms = {"shared": True, "each its own": False}
        alike_n = max(args.conversations, 2)
        chunk_size = -(-(args.system + IMAGE_TOKENS + 31) // CHUNKS)
        twins: dict[tuple[int, str], list[float]] = {(c, arm): [] for c in (0, chunk_size) for arm in share_arms}
        same = True
        hit = prompt = 0
        lengths: list[int] = []
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            # Each round runs the arms in another order, so that no arm is
            # always the one after a workload change (on an H200 one step's
            # time moved 6 -> 80 ms within seconds: stop 54).
            order = _rotated(list(arms.items()), r)
            made: dict[str, dict[str, list[int]]] = {}
            for arm, size in order:
                eng = engine(model, size)
                per_turn, made[arm], seconds, tokens = conversations(
                    eng, args.conversations, args.system, args.answer, r
                )
                if arm == "on":
                    hit += eng.prefix_cache.hit_tokens if r else 0
                    prompt += eng.prefix_cache.prompt_tokens if r else 0
                if r:
                    for t, joins in enumerate(per_turn):
                        ttft[arm][t] += joins
                    rate[arm].append(tokens / seconds)
            same &= made["on"] == made["off"]
            lengths = [args.system + IMAGE_TOKENS + 30 + t * (30 + args.answer) for t in range(TURNS)]
            # A few seconds a run, and this host's speed moves by a tenth
            # between runs seconds apart: the cost it looks for (a few %)
            # needs more samples than the other arms, each pair's arms in
            # turn, the order alternating.
            for repeat in range(args.unshared_repeats):
                unshared_made = {}
                for arm, size in _rotated(order, repeat):
                    eng = engine(model, size)
                    seconds, tokens, unshared_made[arm] = unshared(eng, args.conversations, lengths, args.answer, r)
                    if r:
                        flat[arm].append(tokens / seconds)
                same &= unshared_made["on"] == unshared_made["off"]
            staggered_made = {}
            for arm, size in order:
                eng = engine(model, size)
                joins, staggered_made[arm] = staggered(eng, 4 * args.conversations, args.system, 4 * args.answer, r)
                if r:
                    stagger[arm] += joins
                    if arm == "on":
                        # The first request's prompt found nothing: the others' are the measure.
                        stagger_hit += eng.prefix_cache.hit_tokens
                        stagger_prompt += eng.prefix_cache.prompt_tokens
            same &= staggered_made["on"] == staggered_made["off"]
            together = {}
            for arm, (size, wait) in _rotated(list(burst_arms.items()), r):
                together[arm] = at_once(model, size, wait, 4 * args.conversations, args.system, args.answer, r)
                if r:
                    burst[arm].append(together[arm])
            same &= together["waits"].made == together["no wait"].made == together["off"].made
            for chunk in (0, chunk_size):
                alike = {}
                for arm, share in _rotated(list(share_arms.items()), r):
                    join, alike[arm] = identical(model, alike_n, args.system, args.answer, r, share=share, chunk=chunk)
                    if r:
                        twins[chunk, arm].append(join)
                same &= alike["shared"] == alike["each its own"]
        rows = []
        for t in range(TURNS):
            on, off = statistics.median(ttft["on"][t]), statistics.median(ttft["off"][t])
            rows.append([t + 1, f"{off * 1000:.0f}", f"{on * 1000:.0f}", f"{on / off:.2f}x"])
        print(f"{args.conversations} conversations x {TURNS} turns: a {args.system}-token system prompt, an image "
              f"({IMAGE_TOKENS} tokens) and a question, then the whole conversation again each turn with a new "
              f"question; {args.answer}-token answers; {args.rounds} rounds, arms interleaved")  # fmt: skip
        print(table(["turn", "TTFT off ms", "TTFT on ms", "on/off"], rows))
        later = [statistics.median(ttft["on"][t]) / statistics.median(ttft["off"][t]) for t in range(1, TURNS)]
        print(f"turns 2-{TURNS}: TTFT with the cache {max(later):.2f}x of without at worst (target <= 0.25x)")
        print(f"prompt tokens taken from the cache: {hit / max(prompt, 1):.0%} of all (turn 1 included)")
        on, off = statistics.median(rate["on"]), statistics.median(rate["off"])
        print(f"multi-turn tokens/s: on {on:.0f}, off {off:.0f} ({on / off:.2f}x)")
        on, off = statistics.median(flat["on"]), statistics.median(flat["off"])
        pairs = sorted(a / b for a, b in zip(flat["on"], flat["off"], strict=True))
        print(f"no shared prefix ({args.conversations} x {TURNS} requests of {lengths[0]}-{lengths[-1]} tokens, "
              f"{len(pairs)} runs of each arm): tokens/s on {on:.0f}, off {off:.0f} ({on / off:.3f}x; "
              f"target >= 0.97x); on/off of each pair run together: median {statistics.median(pairs):.3f}, "
              f"{pairs[0]:.2f}-{pairs[-1]:.2f}")  # fmt: skip
        on, off = statistics.median(stagger["on"]), statistics.median(stagger["off"])
        print(f"shared system prompt, staggered ({4 * args.conversations} requests, one joining each step while the "
              f"others decode {4 * args.answer} tokens; each its own image and question): TTFT after the first "
              f"off {off * 1000:.0f} ms, on {on * 1000:.0f} ms ({on / off:.2f}x), "
              f"prompt tokens from the cache {stagger_hit / max(stagger_prompt, 1):.0%}")  # fmt: skip
        print(f"shared system prompt, at once ({4 * args.conversations} requests queued together through the step "
              f"loop, each its own image and question, {args.answer}-token answers):")  # fmt: skip
        rows = []
        for arm, runs in burst.items():
            ttft_ms = [t * 1000 for run in runs for t in run.ttft]
            hits = sum(run.hit_tokens for run in runs) / max(sum(run.prompt_tokens for run in runs), 1)
            rows.append([arm, f"{statistics.median(ttft_ms):.0f}", f"{percentile(ttft_ms, 0.9):.0f}",
                         f"{statistics.median(run.seconds for run in runs) * 1000:.0f}", f"{hits:.0%}"])  # fmt: skip
        print(table(["prefix cache", "TTFT p50 ms", "TTFT p90 ms", "all done ms", "prompt from cache"], rows))
        waits, no_wait = (statistics.median(run.seconds for run in burst[arm]) for arm in ("waits", "no wait"))
        print(f"  waiting for the shared prefill: all done in {waits / no_wait:.2f}x the time of not waiting")
        for chunk in (0, chunk_size):
            shared, own = (statistics.median(twins[chunk, arm]) for arm in share_arms)
            how = f", prefilled in chunks of {chunk}" if chunk else ""
            print(f"identical prompts at once ({alike_n} requests of one {args.system + IMAGE_TOKENS + 31}-token "
                  f"prompt with an image, queued together through the step loop, as n choices are{how}): TTFT "
                  f"prefilled once "
                  f"{shared * 1000:.0f} ms, each its own {own * 1000:.0f} ms ({shared / own:.2f}x)")  # fmt: skip
        print(f"same tokens with the cache on and off, shared or not (every request, every round): {same}")
        if not args.no_chunked:
            chunked(workdir)


def _rotated(arms: list[Any], r: int) -> list[Any]:
    """`arms` rotated by `r` places: over rounds each arm runs first as often."""
    k = r % len(arms)
    return arms[k:] + arms[:k]


def chunked(workdir: Path) -> None:
    """One round of bench/chunked_prefill.py's comparison, its figures."""
    import chunked_prefill
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(chunked_prefill.build(workdir), dtype=torch.float32).eval()
    steps, _, _, _ = chunked_prefill.run(model, 16, 6000, 512, 0, seed=0)
    whole, _, _, _ = chunked_prefill.run(model, 16, 6000, 0, len(steps), seed=0)
    for name, gaps in (("chunked (512)", steps), ("whole", whole)):
        p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
        print(f"16 streams while a 6000-token prompt joins, {name}: ITL p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms ({p99 / p50:.1f}x; target <= 3x with chunking)")  # fmt: skip


if __name__ == "__main__":
    main()
