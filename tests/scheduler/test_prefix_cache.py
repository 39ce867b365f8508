"""The prefix cache in the engine of a group of one (the tiny LLaVA):
conversations resent whole, images included, take their earlier turns'
blocks and make the greedy tokens they make with the cache off; a key never
lets a new image, another position or another tenant's salt reuse a block;
the store stays within its bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scheduler_svc.engine import Engine
from scheduler_svc.plan import NewRequest, Plan
from scheduler_svc.prefix_cache import BLOCK_TOKENS, PrefixCache, Runs, chain, outside_items, root, tail_key
from tests.support.engine_kit import drive, pixels, reference, request, solo_engine

IMAGE_TOKENS = 64  # the tiny LLaVA's placeholders per image


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()


def make_engine(model: torch.nn.Module, *, prefix: int, encoder: int = 64 << 20, chunk: int = 0) -> Engine:
    return solo_engine(model, encoder_cache_bytes=encoder, prefix_cache_bytes=prefix, prefill_chunk=chunk)


# ---- keys ----
def runs_of(req: NewRequest, digests: list[bytes]) -> Runs:
    return Runs(tuple(digests), tuple(item.placeholders for item in req.items))


def test_a_key_covers_the_item_the_salt_and_everything_before() -> None:
    text = list(range(100, 100 + 3 * BLOCK_TOKENS))
    ids = [*text[:20], *([7] * 40), *text[:20]]  # an image run at 20..59
    runs_a = Runs((b"A" * 16,), (((20, 40),),))
    runs_b = Runs((b"B" * 16,), (((20, 40),),))
    a, b = chain(ids, runs_a), chain(ids, runs_b)
    assert len(a) == len(ids) // BLOCK_TOKENS == 5
    assert a[0] == b[0], "the block before the image is the same text"
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True)), "another image: no block from its first on"
    moved = chain([*text[:4], *ids[:-4]], Runs((b"A" * 16,), (((24, 40),),)))
    assert not set(moved) & set(a), "the same image at another position shares nothing"
    assert not set(chain(ids, runs_a, "tenant-2")) & set(a), "another salt shares nothing"
    assert chain(ids, runs_a) == a, "keys are a function of their inputs"
    # Going on from a chain's first keys (a row's, made when it joined) gives the same chain.
    assert all(chain(ids, runs_a, known=a[:k]) == a for k in range(len(a) + 1))
    assert chain(ids, runs_a, blocks=2, known=a) == a[:2]
    # A match ends outside the image's span and leaves the last token to prefill.
    assert outside_items((len(ids) - 1) // BLOCK_TOKENS, runs_a) == 4  # 64: past the image
    assert outside_items(49 // BLOCK_TOKENS, runs_a) == 1  # 16 (32 and 48 are inside 20..60)
    assert outside_items(64 // BLOCK_TOKENS, Runs()) == 4
    assert outside_items(63 // BLOCK_TOKENS, Runs()) == 3


def test_the_store_keeps_within_its_bytes_and_evicts_deepest_blocks_first() -> None:
    block = torch.zeros(2, 2, 1, BLOCK_TOKENS, 4)  # 2 layers: 1 KiB a block
    size = block.numel() * block.element_size()
    store = PrefixCache(3 * size)
    ids = list(range(4 * BLOCK_TOKENS + 1))
    keys = chain(ids, Runs())
    blocks = [torch.zeros(2, 2, 1, BLOCK_TOKENS, 4) for _ in range(4)]
    assert store.keep(keys, blocks) == 3, "only what the budget holds"
    assert store.nbytes == 3 * size
    assert store.held(keys) == 3
    other = chain([9, *ids[1:]], Runs())
    store.keep(other[:1], [torch.ones(2, 2, 1, BLOCK_TOKENS, 4)])
    assert store.nbytes <= store.capacity
    assert store.held(keys) == 2, "the deepest block went first; the chain's root stays"
    match = store.match(ids, Runs())
    assert match.tokens == 2 * BLOCK_TOKENS
    kv = store.take(match, len(ids))
    assert kv is not None
    assert tuple(kv.shape) == (2, 2, 1, 2 * BLOCK_TOKENS, 4)


def test_a_chain_that_grows_in_a_full_store_keeps_its_stored_parents() -> None:
    """A running request's prompt blocks were kept when it joined; others'
    blocks came after, so at its end they are the least recent. Storing
    its new blocks then evicts other chains' blocks, never its own parents
    (which once raised, and a rank whose keep raises turns the prefix
    cache off for the group)."""
    size = 2 * 2 * BLOCK_TOKENS * 4 * 4  # [2 layers, k/v, 1 head, BLOCK_TOKENS, 4] float32

    def block(value: float) -> torch.Tensor:
        return torch.full((2, 2, 1, BLOCK_TOKENS, 4), value)

    store = PrefixCache(4 * size)
    ids = list(range(4 * BLOCK_TOKENS + 1))
    keys = chain(ids, Runs())
    store.keep(keys[:2], [block(0.0), block(0.0)])
    other = chain([9, *ids[1:]], Runs())
    store.keep(other[:2], [block(1.0), block(1.0)])  # full; the first chain is the least recent
    assert store.keep(keys, [block(2.0), block(2.0)], first=2) == 2
    assert store.held(keys) == 4
    assert store.held(other) == 0, "the other chain's blocks made the room"
    assert store.nbytes == store.capacity


def test_a_tail_is_taken_by_a_prompt_that_goes_past_it_and_evicted_before_its_parents() -> None:
    """A leaving row's last partial block: a longer prompt with the same
    tokens takes the full blocks and then the tail, leaving its last token
    to prefill; a prompt that stops inside the tail, or differs in it, or
    has another salt, or whose match would end inside an item, takes the
    full blocks only. The store evicts the tail before its parents, and
    keeps no tail whose chain does not fit."""

    def block(tokens: int) -> torch.Tensor:
        return torch.zeros(2, 2, 1, tokens, 4)

    size = block(BLOCK_TOKENS).numel() * 4
    store = PrefixCache(4 * size)
    ids = list(range(100, 100 + 2 * BLOCK_TOKENS + 5))  # 2 blocks and a tail of 5
    keys = chain(ids, Runs())
    tail = tail_key(keys[-1], ids, 2 * BLOCK_TOKENS, 5, Runs())
    assert store.keep(keys, [block(BLOCK_TOKENS)] * 2, tail=(tail, block(5))) == 3
    assert store.nbytes == 2 * size + 5 * size // BLOCK_TOKENS
    longer = [*ids, 7, 8]
    match = store.match(longer, Runs())
    assert (match.tokens, match.tail) == (2 * BLOCK_TOKENS + 5, tail)
    kv = store.take(match, len(longer))
    assert kv is not None
    assert kv.shape[3] == 2 * BLOCK_TOKENS + 5
    assert store.match([*ids, 7], Runs()).tokens == 2 * BLOCK_TOKENS + 5, "the last token left to prefill"
    assert store.match(ids, Runs()).tokens == 2 * BLOCK_TOKENS, "a prompt that ends in the tail: not all of it"
    assert store.match([*ids[:-1], 9, 7], Runs()).tokens == 2 * BLOCK_TOKENS, "another last token: not the tail"
    assert store.match(longer, Runs(), "tenant-2").tokens == 0, "another salt shares nothing"
    image = Runs((b"A" * 16,), (((2 * BLOCK_TOKENS + 3, 4),),))  # an item from inside the tail past its end
    assert store.match(longer, image).tail == b"", "a match never ends inside an item"
    # A tail with no full block before it hangs from the chain's root.
    short = [5, 6, 7]
    short_tail = tail_key(root(), short, 0, 3, Runs())
    store.keep([], [], tail=(short_tail, block(3)))
    assert store.match([*short, 1], Runs()).tokens == 3
    # The next chain's blocks evict the least recent: the first chain's tail before its blocks.
    other = chain(list(range(500, 500 + 2 * BLOCK_TOKENS)), Runs())
    store.keep(other, [block(BLOCK_TOKENS)] * 2)
    assert store.nbytes <= store.capacity
    assert not store.holds(tail)
    assert store.held(keys) >= 1, "the first chain's root outlived its tail"
    # A chain that fills the store keeps no tail.
    full = PrefixCache(2 * size)
    assert full.keep(keys, [block(BLOCK_TOKENS)] * 2, tail=(tail, block(5))) == 2
    assert not full.holds(tail)


# ---- the engine ----
def conversation(model: torch.nn.Module, engine: Engine, turns: list[tuple[int, list[int]]], tag: str):
    """Turns of one chat resent whole: each prompt is the last one, its
    answer, and the next turn (an image or not, then text). Returns each
    turn's tokens and its cached prompt tokens."""
    eos = int(model.config.text_config.eos_token_id)
    ids: list[int] = [1]
    images = []
    outputs, cached = [], []
    for t, (image_seed, text) in enumerate(turns):
        if image_seed >= 0:
            ids += [model.config.image_token_id] * IMAGE_TOKENS
            images.append(pixels(image_seed))
        ids += text
        req = request(f"{tag}{t}", ids, list(images), max_tokens=6)
        seen: dict[str, int] = {}
        out = drive(engine, {0: [req]}, eos, seen)[req.request_id]
        assert isinstance(out, list), out
        outputs.append(out)
        cached.append(seen[req.request_id])
        ids = [*ids, *out]
    return outputs, cached


def turns(seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    return [
        (
            rng.choice([-1, seed * 10 + t, seed * 10 + t]),
            [rng.randrange(100, 30000) for _ in range(rng.randrange(3, 40))],
        )
        for t in range(4)
    ]


@pytest.mark.parametrize("encoder", [64 << 20, 0], ids=["encoded", "media"])
def test_multi_turn_conversations_with_images_hit_and_keep_their_greedy_tokens(
    model: torch.nn.Module, encoder: int
) -> None:
    on, off = make_engine(model, prefix=64 << 20, encoder=encoder), make_engine(model, prefix=0, encoder=encoder)
    for seed in range(3):
        # An image in the first turn at least, and text enough after it that
        # a block ends past it (a match never ends inside an image).
        chat = [(seed * 10, list(range(500, 520))), *turns(seed)[1:]]
        with_cache, cached = conversation(model, on, chat, f"on{seed}")
        without, none = conversation(model, off, chat, f"off{seed}")
        assert with_cache == without, seed
        assert none == [0, 0, 0, 0]
        assert cached[0] == 0
        # Each later turn takes the whole of the turn before from the store
        # (its last token, never fed, aside): full blocks and the tail.
        lengths = [1]
        for (image_seed, text), out in zip(chat, with_cache, strict=True):
            lengths.append(lengths[-1] + (IMAGE_TOKENS if image_seed >= 0 else 0) + len(text) + len(out))
        assert cached[1:] == [n - 1 for n in lengths[1:-1]], cached
    assert on.prefix_cache.hits >= 9
    assert on.prefix_cache.nbytes > 0


@pytest.mark.parametrize("encoder", [64 << 20, 0], ids=["encoded", "media"])
def test_a_prompt_one_token_longer_each_time_prefills_one_token(model: torch.nn.Module, encoder: int) -> None:
    """What a beam search sends (and a conversation's next turn, in
    part): each request is the last one's prompt and its first token. A
    leaving row keeps its tail, so each takes every token but its last
    from the store, not only whole blocks; its greedy token is the
    uncached one, with an image before the tail too."""
    eos = int(model.config.text_config.eos_token_id)
    engine = make_engine(model, prefix=64 << 20, encoder=encoder)
    ids = [1, *range(700, 720), *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 810)]
    seen: dict[str, int] = {}
    for step in range(BLOCK_TOKENS + 3):  # across a block boundary
        req = request(f"step{step}", list(ids), [pixels(3)], max_tokens=1)
        out = drive(engine, {0: [req]}, eos, seen)[req.request_id]
        assert out == reference(model, req), step
        assert seen[req.request_id] == (0 if step == 0 else len(ids) - 1), step
        ids.append(out[0] if out[0] != eos else 900 + step)  # type: ignore[index]
    assert engine.prefix_cache.nbytes <= engine.prefix_cache.capacity


@pytest.mark.parametrize("prefix", [64 << 20, 0], ids=["cached", "uncached"])
def test_identical_prompts_joining_together_are_prefilled_once(model: torch.nn.Module, prefix: int) -> None:
    """Four requests with one prompt and image (n choices, or one prompt
    sent by many at once) and another join in one step: one forward
    prefills two rows, the twins get copies of the first's row, and each
    keeps the tokens it gets alone, greedy or seeded; with prompt log
    probabilities asked, a request prefills its own."""
    eos = int(model.config.text_config.eos_token_id)
    ids = [1, *range(700, 720), *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 810)]
    greedy = [request(f"g{i}", ids, [pixels(7)], max_tokens=6) for i in range(2)]
    seeded = [request(f"s{i}", ids, [pixels(7)], max_tokens=6, temperature=1.0, seed=40 + i) for i in range(2)]
    other = request("other", [1, *range(900, 930)], max_tokens=6)
    scored = request("scored", ids, [pixels(7)], max_tokens=2, prompt_logprobs=0)
    joined = [*greedy, *seeded, other, scored]
    engine = make_engine(model, prefix=prefix)
    rows: list[int] = []
    forward = engine._forward
    engine._forward = lambda joiners: (rows.append(len(joiners)), forward(joiners))[1]  # type: ignore[method-assign]
    together = drive(engine, {0: joined}, eos)
    assert rows[0] == 3, "one prompt's row each for the first of the four, the other, and the scored one"
    for req in joined:
        alone = drive(make_engine(model, prefix=0), {0: [req]}, eos)[req.request_id]
        assert together[req.request_id] == alone, req.request_id
    assert together["g0"] == reference(model, greedy[0])
    assert together["s0"] != together["s1"], "each twin samples with its own seed"


@pytest.mark.parametrize("prefix", [64 << 20, 0], ids=["cached", "uncached"])
def test_identical_long_prompts_joining_together_are_prefilled_in_chunks_once(
    model: torch.nn.Module, prefix: int
) -> None:
    """n choices of a prompt longer than a chunk: the first is prefilled a
    chunk a step, the others wait for it and join with copies of its row
    and logits, one that comes a step later too (its chunks are under way);
    each makes the tokens it makes alone, greedy or seeded. A long prompt
    of its own, joining with them, is chunked after them."""
    eos = int(model.config.text_config.eos_token_id)
    ids = [1, *range(700, 720), *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 810)]  # 95: 4 chunks
    greedy = [request(f"g{i}", ids, [pixels(7)], max_tokens=6) for i in range(2)]
    seeded = [request(f"s{i}", ids, [pixels(7)], max_tokens=6, temperature=1.0, seed=40 + i) for i in range(2)]
    other = request("other", [1, *range(900, 950)], max_tokens=6)  # 51: 3 chunks
    late = request("late", ids, [pixels(7)], max_tokens=6)
    joined = [*greedy, *seeded, other]
    engine = make_engine(model, prefix=prefix, chunk=24)
    chunks: list[str] = []
    forward = engine._chunk_forward
    engine._chunk_forward = lambda c, *span: (chunks.append(c.joiner.request.request_id), forward(c, *span))[1]  # type: ignore[method-assign]
    together = drive(engine, {0: joined, 2: [late]}, eos)
    assert chunks == ["g0"] * 4 + ["other"] * 3, chunks
    assert engine.shared_prefills == 4
    for req in [*joined, late]:
        alone = drive(make_engine(model, prefix=0, chunk=24), {0: [req]}, eos)[req.request_id]
        assert together[req.request_id] == alone, req.request_id
    assert together["g0"] == reference(model, greedy[0])
    assert together["s0"] != together["s1"], "each twin samples with its own seed"
    assert engine.cache.rows == 0


class _FailsFor:
    """An engine hook: the prefill forwards of one request raise."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    @contextlib.contextmanager
    def in_prefill_forward(self, rank: int, requests: list[NewRequest], model: torch.nn.Module) -> Iterator[None]:
        if any(r.request_id == self.rid for r in requests):
            raise RuntimeError(f"injected into {self.rid}'s prefill")
        yield


@pytest.mark.parametrize("how", ["raises", "dropped"])
def test_twins_of_a_long_prompt_go_on_when_the_one_prefilling_it_leaves(model: torch.nn.Module, how: str) -> None:
    """The one prefilling a long prompt for its twins fails in a chunk, or
    is cancelled between chunks: the next twin prefills it from its start,
    the last still takes a copy, and both make their tokens alone."""
    ids = [1, *range(700, 720), *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 810)]
    twins = [request(f"g{i}", ids, [pixels(7)], max_tokens=4) for i in range(3)]
    hook = _FailsFor("g0") if how == "raises" else None
    engine = solo_engine(model, encoder_cache_bytes=64 << 20, prefill_chunk=24, hook=hook)
    chunks: list[str] = []
    forward = engine._chunk_forward
    engine._chunk_forward = lambda c, *span: (chunks.append(c.joiner.request.request_id), forward(c, *span))[1]  # type: ignore[method-assign]
    out = engine.step(Plan(step=0, new=tuple(twins)))
    assert set(out.ended) == ({"g0"} if how == "raises" else set())
    assert not out.sampled
    out = engine.step(Plan(step=1, drop=("g0",)))  # what the loop sends either way
    tokens: dict[str, list[int]] = {"g1": [], "g2": []}
    step = 2
    while len(tokens["g1"]) < 4:
        assert not out.ended, out
        assert not out.failed, out
        for rid, token in out.sampled.items():
            tokens[rid].append(token)
        done = [rid for rid in out.sampled if len(tokens[rid]) == 4]
        feed = tuple((rid, t) for rid, t in out.sampled.items() if rid not in done)
        out = engine.step(Plan(step=step, drop=tuple(done), feed=feed))
        step += 1
    alone = reference(model, twins[1])
    assert tokens == {"g1": alone, "g2": alone}
    assert chunks.count("g1") == 4, chunks
    assert "g2" not in chunks, chunks
    assert engine.shared_prefills == 1
    engine.step(Plan(step=step, drop=tuple(out.sampled)))
    assert engine.cache.rows == 0


def test_a_hit_then_chunks_gives_the_tokens_of_one_prefill(model: torch.nn.Module) -> None:
    """A turn whose new part is longer than a chunk goes on in chunks from
    the end of its cached prefix."""
    on = make_engine(model, prefix=64 << 20, chunk=24)
    off = make_engine(model, prefix=0)
    rng = random.Random(5)
    chat = [
        (1, list(range(510, 530))),  # text enough after the image that a block ends past it
        (2, [rng.randrange(100, 30000) for _ in range(30)]),
        (-1, [rng.randrange(100, 30000) for _ in range(60)]),
    ]
    with_cache, cached = conversation(model, on, chat, "chunk")
    without, _ = conversation(model, off, chat, "plain")
    assert with_cache == without
    assert all(c > 0 for c in cached[1:]), cached


def test_no_block_is_shared_past_a_different_image_or_across_salts(model: torch.nn.Module) -> None:
    eos = int(model.config.text_config.eos_token_id)
    engine = make_engine(model, prefix=64 << 20)
    text = [rng for rng in range(700, 700 + 40)]
    first = request(
        "first", [*text, *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 830)], [pixels(1)], max_tokens=4
    )
    other_image = request("other", list(first.input_ids), [pixels(2)], max_tokens=4)
    same_image = request("same", list(first.input_ids), [pixels(1)], max_tokens=4)
    salted = dataclasses.replace(same_image, request_id="salted", cache_salt="tenant-2")
    # The same image 5 tokens later (after the same first 32 tokens), then the same text.
    ids = [*text, 701, 702, 703, 704, 705, *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 830)]
    moved = request("moved", ids, [pixels(1)], max_tokens=4)
    seen: dict[str, int] = {}
    arrivals = {0: [first], 8: [other_image], 16: [same_image], 24: [salted], 32: [moved]}
    results = drive(engine, arrivals, eos, seen)
    assert seen["first"] == 0
    assert seen["other"] == 32, "the text before the image, not past its first placeholder"
    assert seen["same"] == 133, "through the image (40..104) to the last token but one of the 134-token prompt"
    assert seen["salted"] == 0
    assert seen["moved"] == 32, "the image elsewhere: only the text before it"
    for req in (first, other_image, same_image, salted, moved):
        assert results[req.request_id] == reference(model, req), req.request_id


@pytest.mark.parametrize("encoder", [64 << 20, 0], ids=["encoded", "media"])
def test_a_match_that_stops_inside_an_image_backs_off_to_before_it(model: torch.nn.Module, encoder: int) -> None:
    """The same text and image, then other text: the stored blocks match
    up to the one holding the image's end and the new text, inside the
    image's span. The match ends before the image instead, so the prefill
    takes whole items (with the encoder cache off the model encodes the
    image's pixels in its forward: a cut one failed the request)."""
    eos = int(model.config.text_config.eos_token_id)
    engine = make_engine(model, prefix=64 << 20, encoder=encoder)
    head = [*range(700, 740), *([model.config.image_token_id] * IMAGE_TOKENS)]  # the image at 40..104
    first = request("first", [*head, *range(800, 830)], [pixels(1)], max_tokens=4)
    second = request("second", [*head, *range(900, 930)], [pixels(1)], max_tokens=4)
    seen: dict[str, int] = {}
    results = drive(engine, {0: [first], 8: [second]}, eos, seen)
    assert seen["second"] == 32, "the blocks before the image (48 to 96 end inside it)"
    assert results["second"] == reference(model, second)
    assert results["first"] == reference(model, first)


def test_a_request_takes_the_blocks_of_one_still_running(model: torch.nn.Module) -> None:
    """A prompt's blocks are kept the step after it joined: a request that
    starts the same way (the same text and image) and arrives while the
    first still decodes takes them; both keep their greedy tokens."""
    eos = int(model.config.text_config.eos_token_id)
    engine = make_engine(model, prefix=64 << 20)
    ids = [*range(700, 740), *([model.config.image_token_id] * IMAGE_TOKENS), *range(800, 830)]  # 134 tokens
    first = request("first", ids, [pixels(1)], max_tokens=10)
    second = request("second", [*ids[:120], 901, 902, 903], [pixels(1)], max_tokens=4)
    seen: dict[str, int] = {}
    results = drive(engine, {0: [first], 2: [second]}, eos, seen)
    assert results["first"] == reference(model, first)
    assert len(results["first"]) > 3, "the first finished before the second came: the test proves nothing"
    assert seen["second"] == 112, "the first's 7 blocks through the image and past it"
    assert results["second"] == reference(model, second)


def test_a_full_store_evicts_and_stays_within_its_bytes(model: torch.nn.Module) -> None:
    """A store of a few blocks under a stream of conversations: it never
    holds more than its bytes, and every answer equals the uncached one."""
    probe = make_engine(model, prefix=64 << 20)
    conversation(model, probe, [(-1, list(range(300, 340)))], "probe")
    block = probe.prefix_cache.nbytes // len(probe.prefix_cache)
    on, off = make_engine(model, prefix=12 * block), make_engine(model, prefix=0)
    for seed in range(4):
        chat = turns(100 + seed)
        assert conversation(model, on, chat, f"s{seed}")[0] == conversation(model, off, chat, f"u{seed}")[0]
        assert on.prefix_cache.nbytes <= on.prefix_cache.capacity
    assert on.prefix_cache.evictions > 0


def test_a_block_copy_that_fails_costs_nothing_but_its_blocks(model: torch.nn.Module) -> None:
    """Keeping a leaving row's blocks runs out of memory, then taking a
    match does: the row leaves all the same and the batch goes on; the
    request whose prefix could not be copied fails alone (OVERLOADED,
    retriable), and the next one is served from the store."""
    from mmsplit.errors import E

    eos = int(model.config.text_config.eos_token_id)
    engine = make_engine(model, prefix=64 << 20)
    ids = [1, *range(300, 360)]
    first, second, third, fourth = (request(f"r{i}", ids, max_tokens=3) for i in range(4))
    real_blocks, real_take = engine.cache.row_blocks, engine.prefix_cache.take
    engine.cache.row_blocks = lambda *a: (_ for _ in ()).throw(MemoryError())  # type: ignore[method-assign]
    seen: dict[str, int] = {}
    results = drive(engine, {0: [first]}, eos, seen)
    assert len(engine.prefix_cache) == 0, "nothing was kept"
    engine.cache.row_blocks = real_blocks  # type: ignore[method-assign]
    results |= drive(engine, {0: [second]}, eos, seen)
    engine.prefix_cache.take = lambda *a: (_ for _ in ()).throw(MemoryError())  # type: ignore[method-assign]
    results |= drive(engine, {0: [third]}, eos, seen)
    engine.prefix_cache.take = real_take  # type: ignore[method-assign]
    results |= drive(engine, {0: [fourth]}, eos, seen)
    expected = reference(model, first)
    assert results == {"r0": expected, "r1": expected, "r2": f"failed:{E.ERROR_CODE_OVERLOADED}", "r3": expected}
    assert (seen["r0"], seen["r1"], seen["r3"]) == (0, 0, 60), "the same 61-token prompt: all but its last token"


def through_loop(
    engine: Engine, prompts: list[NewRequest], eos: int, **settings: object
) -> tuple[dict[str, list[int]], dict[str, object], object]:
    """`prompts` queued together (before the first plan) through rank 0's
    step loop over a real engine: each request's tokens, its Finished, and
    the loop."""
    import threading

    from scheduler_svc.loop import Admission, Event, Finished, StepLoop, Token
    from scheduler_svc.settings import SchedulerSettings
    from tests.support.engine_kit import SoloGroup

    ended = threading.Semaphore(0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, object] = {}

    def emit(event: Event, rid: str) -> None:
        if isinstance(event, Token):
            tokens.setdefault(rid, []).append(event.token_id)
            return
        if isinstance(event, Finished):
            finished[rid] = event
        ended.release()

    loop = StepLoop(
        engine, SoloGroup(), SchedulerSettings(model_dir=Path("unused"), heartbeat_s=0.05, **settings),  # type: ignore[arg-type]
        eos_token_ids=frozenset([eos]), max_context=1024, kv_budget_tokens=10**6, post=lambda fn: fn(),
        on_fatal=lambda exc: None,
    )  # fmt: skip
    for req in prompts:
        reserve = len(req.input_ids) + req.sampling.max_tokens
        loop.submit(Admission(req, lambda e, rid=req.request_id: emit(e, rid), reserve=reserve))
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        for _ in prompts:
            assert ended.acquire(timeout=60)
    finally:
        loop.request_stop()
        thread.join(30)
    return tokens, finished, loop


def test_requests_arriving_together_with_one_system_prompt_prefill_it_once(model: torch.nn.Module) -> None:
    """Rank 0's step loop over a real engine: four requests queued at once,
    each the same 100 tokens of system prompt, then its own image and
    question. The first prefills the system prompt; the other three wait a
    step and take its 6 blocks from the store; every one keeps its greedy
    tokens. With --wait-for-shared-prefix 0 all four compute it."""
    eos = int(model.config.text_config.eos_token_id)
    system = list(range(500, 600))
    prompts = [
        request(f"r{i}", [*system, *([model.config.image_token_id] * IMAGE_TOKENS), 900 + i], [pixels(i)], max_tokens=3)
        for i in range(4)
    ]
    expected = {req.request_id: reference(model, req) for req in prompts}
    for wait, cached in ((64, [0, 96, 96, 96]), (0, [0, 0, 0, 0])):
        engine = make_engine(model, prefix=64 << 20)
        tokens, finished, loop = through_loop(engine, prompts, eos, wait_for_shared_prefix=wait)
        assert tokens == expected, wait
        assert [finished[req.request_id].cached_tokens for req in prompts] == cached, wait  # type: ignore[attr-defined]
        assert loop.waited_for_prefix == (3 if wait else 0)  # type: ignore[attr-defined]


def test_the_n_choices_of_a_prompt_join_one_step_and_are_prefilled_once(model: torch.nn.Module) -> None:
    """Rank 0's step loop over a real engine: four requests of one prompt
    (100 tokens of text, an image, a question; each item with the
    tokenizer's content hash, as n choices reach the scheduler) and one
    with another image, queued at once, under a prefill budget that two of
    those prompts would pass. The four join one step, one of them
    prefilled and three copies, without waiting for the text they share;
    the other image's request waits for that text and joins the next step,
    taking it from the store. Every request keeps its greedy tokens."""
    eos = int(model.config.text_config.eos_token_id)
    ids = [*range(500, 600), *([model.config.image_token_id] * IMAGE_TOKENS), 900]

    def hashed(rid: str, seed: int) -> NewRequest:
        req = request(rid, ids, [pixels(seed)], max_tokens=3)
        items = tuple(dataclasses.replace(item, content_hash=f"image {seed}".encode()) for item in req.items)
        return dataclasses.replace(req, items=items)

    prompts = [*(hashed(f"n{i}", 1) for i in range(4)), hashed("other", 2)]
    engine = make_engine(model, prefix=64 << 20)
    joins: list[list[str]] = []
    step = engine.step
    engine.step = lambda plan: (joins.append([r.request_id for r in plan.new]) if plan.new else None, step(plan))[1]  # type: ignore[method-assign]
    tokens, finished, loop = through_loop(engine, prompts, eos, max_prefill_tokens=len(ids) + 10)
    assert joins == [["n0", "n1", "n2", "n3"], ["other"]]
    assert engine.shared_prefills == 3
    assert loop.waited_for_prefix == 1  # type: ignore[attr-defined]
    assert finished["other"].cached_tokens == 96  # type: ignore[attr-defined]
    assert tokens == {req.request_id: reference(model, req) for req in prompts}
