"""The scheduler's prefix cache at TP=2 through real servers (tiny Qwen2-VL,
whose M-RoPE positions a reused prefix must get right), with a store of a
few dozen blocks so that it evicts all along: conversations resent whole
each turn over gRPC get the greedy tokens of `generate` while they take
their earlier turns' blocks, joining the batch at whatever step; chats over
the OpenAI SDK report the cached tokens in their usage, tenants with
different `cache_salt` share nothing; and after a randomized workload both
ranks hold the same blocks in the same order (their debug logs compared
step by step)."""

from __future__ import annotations

import base64
import random
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from mmsplit.client import ImagePart, build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2_grpc
from mmsplit_cli import samples
from mmsplit_cli.client import Outcome, run_request
from tests.e2e.helpers import rank_active_requests, scheduler_info
from tests.support import greedy, hf_family
from tests.support.leaks import wait_until
from tests.support.services import Arg, FreePort, Pair, running_pair

pytestmark = pytest.mark.e2e
KEY = "sk-prefix-0123456789"
MAX_TOKENS = 6
# The tiny Qwen2-VL at TP=2 holds 4 KiB of KV per 16-token block on each rank.
STORE_BYTES = 48 * 4096
LINE = re.compile(r"rank (\d) after step (\d+): prefix cache (\d+) blocks, (\d+) bytes, keys (\w+)")


@dataclass
class Served:
    pair: Pair
    url: str
    metrics: str


@pytest.fixture(scope="module")
def served(chat_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    logs = tmp_path_factory.mktemp("prefix")
    (logs / "key").write_text(KEY + "\n")
    http, metrics = FreePort(), FreePort()
    scheduler = ["--tp", "2", "--prefix-cache-bytes", str(STORE_BYTES), "--log-level", "DEBUG"]
    scheduler += ["--batch-window-s", "0.02", "--metrics-port", metrics]
    tokenizer: list[Arg] = ["--http-port", http, "--api-key-file", str(logs / "key")]
    with running_pair(
        chat_models("qwen2-vl"), logs, scheduler_extra=scheduler, tokenizer_extra=tokenizer
    ) as pair:  # fmt: skip
        yield Served(pair, f"http://127.0.0.1:{http.number}/v1", f"http://127.0.0.1:{metrics.number}/metrics")


def as_hf(messages: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in ([content] if isinstance(content, str) else content)
            ],
        }
        for role, content in messages
    ]


def test_conversations_joining_at_any_step_keep_the_tokens_of_generate(served: Served) -> None:
    """Three chats at once, three turns each, images in the first and last
    turns: every turn's tokens equal `generate` on the whole conversation,
    and the later turns take blocks of the earlier ones."""
    from tokenizer_svc.decode import decode_image

    pair = served.pair
    pictures = [samples.good_png(seed=70 + i) for i in range(4)]
    results: dict[int, list[tuple[list[tuple[str, Any]], Outcome]]] = {}

    def chat(k: int) -> None:
        rng = random.Random(k)
        messages: list[tuple[str, Any]] = [("system", "You describe pictures.")]
        words = " ".join(rng.choice(["more", "about", "the", "light", "please"]) for _ in range(rng.randrange(4, 20)))
        turns = [
            [f"Chat {k}: what is in this picture? Tell me its colors and its shapes.", ImagePart(pictures[k])],
            [words],
            [ImagePart(pictures[3]), "And this one: is it the same as the first?"],
        ]
        done = results.setdefault(k, [])
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            for turn in turns:
                messages.append(("user", turn))
                request = build_request(messages=messages, max_tokens=MAX_TOKENS)
                request.sampling.logprobs = True
                out = run_request(stub, request, timeout=120)
                assert out.ok, out
                done.append((list(messages), out))
                messages.append(("assistant", out.text))

    threads = [threading.Thread(target=chat, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc = hf_family.processor(pair.model)
    assert sorted(results) == [0, 1, 2]
    for k, turns in results.items():
        assert len(turns) == 3, k
        for i, (messages, out) in enumerate(turns):
            text = proc.apply_chat_template(as_hf(messages), tokenize=False, add_generation_prompt=True)
            shown = [p.source for _, c in messages if not isinstance(c, str) for p in c if isinstance(p, ImagePart)]
            images = [decode_image(x, max_pixels=10**8) for x in shown]  # type: ignore[arg-type]
            tokens, logprobs = hf_family.scored(pair.model, proc, text, images, MAX_TOKENS)
            assert out.token_ids == tokens, (k, i, out.cached_tokens)
            # Blocks reused at any step give what a whole prefill gives, to float noise.
            assert out.logprobs == pytest.approx(logprobs, abs=greedy.LOGPROB_TOLERANCE), (k, i, out.cached_tokens)
        assert sum(out.cached_tokens for _, out in turns[1:]) > 0, (k, [out.cached_tokens for _, out in turns])
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)


def test_n_choices_joining_together_share_one_prefill_and_keep_the_tokens_of_generate(served: Served) -> None:
    """A chat with a picture asked for n = 4 greedy choices: each is its own
    scheduler request, with the same prompt and pixels. Those that join in
    one step are prefilled once at TP=2 (each rank logs it; a new picture
    each try until a try's choices joined together, as they do unless the
    tokenizer's work spreads them), and every choice's tokens are
    `generate`'s."""
    from tokenizer_svc.decode import decode_image

    pair = served.pair
    proc = hf_family.processor(pair.model)
    log = pair.scheduler.log_path

    def shared() -> int:
        return sum("take the prefill of an identical prompt" in line for line in log.read_text().splitlines())

    before = shared()
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for attempt in range(8):
            picture = samples.good_png(seed=300 + attempt)
            messages: list[tuple[str, Any]] = [("user", [ImagePart(picture), "What colors are in this picture?"])]
            request = build_request(messages=messages, max_tokens=MAX_TOKENS, n=4)
            texts: dict[int, list[int]] = {}
            for event in stub.Generate(request, timeout=120):
                if event.HasField("delta"):
                    texts.setdefault(event.index, []).extend(event.delta.token_ids)
            text = proc.apply_chat_template(as_hf(messages), tokenize=False, add_generation_prompt=True)
            tokens, _ = hf_family.scored(pair.model, proc, text, [decode_image(picture, max_pixels=10**8)], MAX_TOKENS)
            assert texts == dict.fromkeys(range(4), tokens), attempt
            if shared() - before >= 2:  # rank 0's line and rank 1's
                break
        else:
            pytest.fail("in 8 tries no two choices joined one step: nothing was shared")
    lines = [line for line in log.read_text().splitlines() if "take the prefill of an identical prompt" in line]
    assert {line.split("rank ")[1][0] for line in lines} == {"0", "1"}, lines
    scraped = urllib.request.urlopen(served.metrics, timeout=10).read().decode()
    (counted,) = [x for x in scraped.splitlines() if x.startswith("mmsplit_scheduler_shared_prefills_total ")]
    copies = sum(int(line.split("rank 0: ")[1].split()[0]) for line in lines if "rank 0: " in line)
    assert float(counted.split()[1]) == copies, (counted, lines)


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], salt: str | None) -> tuple[str, int]:
    extra = {"cache_salt": salt} if salt else None
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body=extra)  # type: ignore[arg-type]
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    assert details is not None
    return reply.choices[0].message.content or "", details.cached_tokens or 0


def test_the_openai_usage_reports_cached_tokens_and_salts_share_nothing(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    picture = data_url(samples.good_png(seed=81))
    text = "Look closely at this picture and tell me, in some detail, what its colors and its shapes are."
    image = {"type": "image_url", "image_url": {"url": picture}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": text}]}]
    first = ask(client, messages, "tenant-a")
    again = ask(client, messages, "tenant-a")
    other = ask(client, messages, "tenant-b")
    assert first[1] == 0
    assert again[1] > 64, "through the image (64 placeholders) for the same tenant"
    assert other[1] == 0, "another tenant's salt shares no block"
    assert first[0] == again[0] == other[0]
    bad = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        ask(bad, messages, "x" * 257)
    assert caught.value.body["param"] == "cache_salt"  # type: ignore[index]


SYSTEM = " ".join(["You answer questions about the pictures you are shown, briefly and plainly."] * 6)


def test_after_a_randomized_workload_both_ranks_hold_the_same_blocks(served: Served) -> None:
    """Twenty chats of one to three turns, over three pictures and two
    tenants (half of them with one long system prompt), eight at a time,
    through a store that evicts: every one
    succeeds; the store never holds more than its bytes; and at every step
    that changed it, rank 1's store has rank 0's keys in rank 0's order."""
    client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    pictures = [data_url(samples.good_png(seed=90 + i)) for i in range(3)]
    hits_before = scheduler_info(served.pair.scheduler_address).prefix_cache_hits
    cached: list[int] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def chat(k: int) -> None:
        rng = random.Random(1000 + k)
        salt = rng.choice([None, "tenant-2"])
        messages: list[dict[str, Any]] = []
        if k % 2:  # half of each wave start alike: the later ones may wait for the first's prefill
            messages.append({"role": "system", "content": SYSTEM})
        try:
            for _ in range(rng.randrange(1, 4)):
                content: list[dict[str, Any]] = []
                if rng.random() < 0.6:
                    content.append({"type": "image_url", "image_url": {"url": rng.choice(pictures)}})
                words = " ".join(
                    rng.choice(["tell", "me", "about", "it", "now", "again", "why"])
                    for _ in range(rng.randrange(3, 30))
                )
                content.append({"type": "text", "text": words})
                messages.append({"role": "user", "content": content})
                answer, hit = ask(client, messages, salt)
                messages.append({"role": "assistant", "content": answer})
                with lock:
                    cached.append(hit)
        except BaseException as exc:
            with lock:
                failures.append(exc)

    for wave in range(0, 20, 8):
        threads = [threading.Thread(target=chat, args=(k,)) for k in range(wave, min(wave + 8, 20))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
    assert sum(1 for c in cached if c) > 0
    info = scheduler_info(served.pair.scheduler_address)
    assert info.prefix_cache_hits > hits_before
    assert 0 < info.prefix_cache_bytes <= STORE_BYTES
    scraped = urllib.request.urlopen(served.metrics, timeout=10).read().decode()
    evictions = [line for line in scraped.splitlines() if line.startswith("mmsplit_scheduler_prefix_cache_evictions")]
    assert evictions, scraped
    assert float(evictions[0].rsplit(" ", 1)[1]) > 0, "the store never filled: the test proves nothing about eviction"
    agreed = [line for line in scraped.splitlines() if line.startswith("mmsplit_scheduler_prefix_cache_agreed ")]
    assert agreed == ["mmsplit_scheduler_prefix_cache_agreed 1.0"], "the ranks' prefix caches went apart"

    def logged() -> dict[int, dict[int, tuple[str, ...]]]:
        by_step: dict[int, dict[int, tuple[str, ...]]] = {}
        for line in served.pair.scheduler.log_path.read_text().splitlines():
            found = LINE.search(line)
            if found:
                rank, step = int(found[1]), int(found[2])
                by_step.setdefault(step, {})[rank] = (found[3], found[4], found[5])
                assert int(found[4]) <= STORE_BYTES, line
        return by_step

    # Rank 1 logs a step's store a moment after rank 0 may have: the last
    # steps' lines can still be on their way when the last chat ends.
    wait_until(lambda: all(len(ranks) == 2 for ranks in logged().values()), timeout=10)
    by_step = logged()
    both = {step: ranks for step, ranks in by_step.items() if len(ranks) == 2}
    assert len(both) >= 20, f"only {len(both)} steps logged by both ranks"
    differ = {step: ranks for step, ranks in both.items() if ranks[0] != ranks[1]}
    assert not differ, differ
    assert all(len(ranks) == 2 for ranks in by_step.values()), "a step's store was logged by one rank only"
    # Identical stores prove little if a change failed on both ranks alike:
    # a failed keep turns the prefix cache off for the group.
    assert "the prefix cache is off" not in served.pair.scheduler.log_path.read_text()
