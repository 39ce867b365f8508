"""Completions' answers with `echo` and log probabilities over random
outputs (`openai_answers.Choices` and `Shape`), seeded: for any number of
prompts and choices, with or without echo, logprobs and vLLM's
prompt_logprobs, and deltas of any size, a stream's chunks make each
choice's whole text (its prompt's first when echoed) and its log
probabilities (the prompt's first, the first null, when echoed with
logprobs), text offsets counting the choice's tokens before each across
chunks, as the whole object has them; and random completions bodies end in
a request or a typed refusal (the session's throwaway fuzz, kept small)."""

from __future__ import annotations

import random
from typing import Any

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import MmsplitError
from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from tokenizer_svc import openai_api
from tokenizer_svc.openai_answers import Choices, Echo, Shape

WORDS = ["a", "bb", " ccc", "é", "", "\n", "zz z"]


class Names:
    """A stand-in tokenizer: token t reads WORDS[t % len(WORDS)]."""

    def decode(self, ids: list[int]) -> str:
        return "".join(WORDS[t % len(WORDS)] for t in ids)


def _logprob(rng: random.Random, top: int) -> common_pb2.TokenLogprob:
    ids = rng.sample(range(50), top)
    return common_pb2.TokenLogprob(
        logprob=-rng.random() * 5, top_token_ids=ids, top_logprobs=sorted((-rng.random() for _ in ids), reverse=True),
        rank=rng.randint(1, 50),
    )  # fmt: skip


def _run(rng: random.Random) -> None:
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    n = rng.randint(1, 3)
    echo = rng.random() < 0.6
    logprobs = rng.choice([None, 0, 2])
    asked = rng.choice([None, None, 0, 3])
    scored = asked is not None or (echo and logprobs is not None)
    top = max(t for t in (asked, logprobs if echo else None, 0) if t is not None)
    texts = tuple(Names().decode(p) for p in prompts) if echo else ()
    setting = Echo(texts, logprobs if echo else None, asked)
    whole, streamed = Choices(n * len(prompts), Names(), n, setting), Choices(n * len(prompts), Names(), n, setting)
    shape = Shape.of(False, "r", "m")
    chunks: dict[int, list[dict[str, Any]]] = {}
    for i in range(n * len(prompts)):
        prompt = prompts[i // n]
        events = []
        if scored:
            lps = [_logprob(rng, top) for _ in prompt[1:]]
            events.append(pb.GenerateResponse(prompt_logprobs=pb.PromptLogprobs(token_ids=prompt, logprobs=lps)))
        for _ in range(rng.randint(0, 4)):
            ids = [rng.randrange(50) for _ in range(rng.randint(0, 3))]
            text = Names().decode(ids) if rng.random() < 0.8 else ""  # text held back sometimes
            lps = [_logprob(rng, logprobs) for _ in ids] if logprobs is not None else []
            events.append(pb.GenerateResponse(delta=pb.TextDelta(text=text, token_ids=ids, logprobs=lps)))
        events.append(pb.GenerateResponse(finished=pb.Finished(finish_reason=1, prompt_tokens=len(prompt))))
        for event in events:
            whole.add(i, event)
            shown = streamed.add(i, event)
            if shown is not None:
                chunks.setdefault(i, []).extend(shape.step(i, shown, streamed.text[i]))
    answer = shape.complete(whole, logprobs=logprobs is not None)
    for i, choice in enumerate(answer["choices"]):
        mine = [c["choices"][0] for c in chunks.get(i, [])]
        assert "".join(c["text"] for c in mine) == choice["text"]
        if echo:
            assert choice["text"].startswith(texts[i // n])
        if asked is not None:
            entries = choice["prompt_logprobs"]
            assert entries[0] is None
            assert len(entries) == len(prompts[i // n])
            assert all(len(e) <= 1 + asked for e in entries[1:])
        if logprobs is None:
            continue
        lp = choice["logprobs"]
        got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in mine:
            for key in got:
                got[key] += (c["logprobs"] or {}).get(key, [])
        assert got == {key: lp[key] for key in got}
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
        if echo:
            assert lp["token_logprobs"][0] is None
            assert lp["top_logprobs"][0] is None
            assert len([t for t in lp["top_logprobs"][1 : len(prompts[i // n])] if len(t) > logprobs]) == 0


def test_streamed_chunks_always_make_the_whole_completion() -> None:
    rng = random.Random(59)
    for _ in range(1500):
        _run(rng)


def _value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, 1, -1, 2**32, 21, 3, "x", "", [], [[]], [1, 2], [[1], [2, 3]], [1, "a"], ["a", [1]],
        [True], {"a": 1}, 1.5, ["p"] * 17, [[0]] * 3,
    ])  # fmt: skip


def test_random_completions_bodies_map_or_are_refused_typed() -> None:
    rng = random.Random(60)
    fields = ["prompt", "echo", "logprobs", "prompt_logprobs", "stream", "n", "max_tokens", "suffix", "best_of"]
    for _ in range(3000):
        body = {name: _value(rng) for name in rng.sample(fields, rng.randint(1, len(fields)))}
        try:
            call = openai_api.parse_completion(body)
        except MmsplitError:
            continue
        for request in call.requests:
            assert bool(request.prompt) != bool(request.prompt_token_ids)
        s = call.request.sampling
        if s.HasField("prompt_logprobs"):
            assert call.prompt_logprobs is not None or (call.echo and s.logprobs)
