"""The engine in this process (a group of one, the tiny LLaVA): continuous
batching with images equals plain greedy decoding, and bad requests fail
alone — before the forward when every rank can see it, after it on rank 0
when only the logits show it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmsplit.errors import E
from mmsplit_server.handoff.reference import TensorSpec
from scheduler_svc.encoder_cache import EncoderCache
from scheduler_svc.engine import Engine
from scheduler_svc.intake import all_finite
from scheduler_svc.plan import NewRequest, Plan, StepOutcome
from tests.support.engine_kit import (
    InlineReader,
    SoloGroup,
    drive,
    image_prompt,
    pixels,
    reference,
    request,
    solo_engine,
)
from tests.support.logprobs import rank_within_ties


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture
def engine(model: torch.nn.Module) -> Engine:
    eos = frozenset([int(model.config.text_config.eos_token_id)])
    return Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=eos, token_chunk=32)


def test_continuous_batching_with_images_equals_greedy_decoding(model: torch.nn.Module, engine: Engine) -> None:
    rng = random.Random(7)
    arrivals: dict[int, list[NewRequest]] = {}
    requests = []
    for i in range(14):
        n_images = rng.choice([0, 1, 1, 2])
        ids = image_prompt(model, n_images, [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 30))])
        req = request(f"r{i}", ids, [pixels(100 * i + k) for k in range(n_images)], max_tokens=rng.randrange(1, 16))
        requests.append(req)
        arrivals.setdefault(rng.randrange(0, 12), []).append(req)
    results = drive(engine, arrivals, model.config.text_config.eos_token_id)
    assert results == {req.request_id: reference(model, req) for req in requests}
    assert engine.cache.rows == 0
    assert engine.cache.nbytes() == 0, "the cache's memory is freed when the batch empties"


def test_non_finite_pixels_fail_before_the_forward_and_the_step_goes_on(model: torch.nn.Module, engine: Engine) -> None:
    good = request("good", image_prompt(model, 1, [500, 600]), [pixels(1)], max_tokens=6)
    nan = request("nan", image_prompt(model, 1, [500]), [pixels(2, fill=float("nan"))], temperature=0.8)
    inf = request("inf", image_prompt(model, 1, [500]), [pixels(3, fill=float("inf"))], temperature=0.8)
    results = drive(engine, {0: [nan, good, inf]}, model.config.text_config.eos_token_id)
    assert results["nan"] == results["inf"] == f"failed:{E.ERROR_CODE_INVALID_REQUEST}"
    assert results["good"] == reference(model, good)


def test_non_finite_logits_fail_only_that_request(model: torch.nn.Module, engine: Engine) -> None:
    """Huge but finite pixels pass every input check and make the model's
    logits NaN: only rank 0 sees it, fails that request, and the next plan
    drops it; the others in the same step make their usual tokens."""
    eos = model.config.text_config.eos_token_id
    others = [
        request(f"ok{i}", image_prompt(model, 1, [700 + i, 800]), [pixels(10 + i)], max_tokens=8) for i in range(3)
    ]
    huge = request("huge", image_prompt(model, 1, [900]), [pixels(4, fill=3e38)], max_tokens=8)
    late = request("late", image_prompt(model, 1, [901, 902]), [pixels(5)], max_tokens=5)
    results = drive(engine, {0: [others[0], huge, others[1]], 2: [others[2], late]}, eos)
    rejected = results["huge"]
    assert isinstance(rejected, str)
    assert rejected.startswith("rejected:")
    assert "non-finite" in rejected
    for req in [*others, late]:
        assert results[req.request_id] == reference(model, req), req.request_id


@pytest.mark.parametrize("encoder_cache_bytes", [0, 64 << 20], ids=["media", "encoded"])
def test_the_model_never_gets_the_bytes_the_reader_lent(model: torch.nn.Module, encoder_cache_bytes: int) -> None:
    """What the reader lends (here: inline bytes in place) is read-only and
    ends with the step; the vision tower gets a tensor of the engine's own
    on both paths (inputs joined for the forward, or encoded apart for the
    encoder cache), and the reader hears of every step's end."""
    eos = frozenset([int(model.config.text_config.eos_token_id)])
    reader = InlineReader()
    engine = Engine(
        model,
        SoloGroup(),
        reader,
        torch.device("cpu"),
        eos_token_ids=eos,
        token_chunk=32,
        encoder_cache_bytes=encoder_cache_bytes,
    )
    reqs = [request(f"r{i}", image_prompt(model, 1, [500 + i]), [pixels(20 + i)], max_tokens=2) for i in range(2)]
    lent = []
    for req in reqs:
        assert req.specs[0].inline is not None
        start = int(np.frombuffer(req.specs[0].inline, dtype=np.uint8).ctypes.data)
        lent.append((start, start + len(req.specs[0].inline)))
    seen: list[int] = []

    def check(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        ptr = args[0].data_ptr()
        seen.append(ptr)
        assert not any(lo <= ptr < hi for lo, hi in lent), "the tower got the reader's bytes"

    hook = model.model.vision_tower.register_forward_pre_hook(check)  # type: ignore[union-attr,operator]
    try:
        results = drive(engine, {0: reqs[:1], 1: reqs[1:]}, model.config.text_config.eos_token_id)
    finally:
        hook.remove()
    assert seen, "the tower ran"
    assert all(results[req.request_id] == reference(model, req) for req in reqs)
    engine.step(Plan(step=99, new=(request("x", [1, 2, 3]),), drop=(), feed=()))
    steps = reader.steps_ended
    with pytest.raises(RuntimeError, match="fed no token"):
        engine.step(Plan(step=100, new=(), drop=(), feed=()))  # nobody fed "x"
    assert reader.steps_ended == steps + 1, "a step that raised still ended its reads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_non_finite_value_anywhere_is_found(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(3)
    pixels_ = torch.from_numpy(rng.standard_normal((5, 3, 64, 64), dtype=np.float32)).to(dtype)
    assert all_finite(pixels_)
    assert all_finite(torch.full((4, 4), torch.finfo(dtype).max, dtype=dtype)), "huge but finite passes"
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in rng.integers(0, pixels_.numel(), 5):
            spoiled = pixels_.clone()
            spoiled.view(-1)[int(at)] = bad
            assert not all_finite(spoiled), (bad, int(at))


def encoding_engine(model: torch.nn.Module, hook: object = None) -> Engine:
    """An engine of a group of one whose family's encoder outputs are cached
    (so the vision tower runs apart from the prefill forward)."""
    return solo_engine(model, encoder_cache_bytes=64 << 20, hook=hook)


def test_items_of_one_step_are_keyed_together_and_hit_the_encoder_cache(model: torch.nn.Module) -> None:
    """Several requests with one or two images join in one step (their
    items hashed on several threads); the same images later hit the
    encoder cache; every request makes the tokens plain decoding makes."""
    eos = int(model.config.text_config.eos_token_id)
    engine = encoding_engine(model)
    images = [pixels(40 + i) for i in range(3)]

    def batch(tag: str) -> list[NewRequest]:
        return [
            request(f"{tag}0", image_prompt(model, 1, [510]), [images[0]], max_tokens=3),
            request(f"{tag}1", image_prompt(model, 2, [511]), [images[1], images[2]], max_tokens=3),
            request(f"{tag}2", image_prompt(model, 1, [512]), [images[2]], max_tokens=3),
        ]

    first, again = batch("a"), batch("b")
    results = drive(engine, {0: first}, eos)
    assert engine.encoder_cache.hits == 0
    results |= drive(engine, {0: again}, eos)
    assert engine.encoder_cache.hits == 4, "every item of the second batch was encoded before"
    for req in first + again:
        assert results[req.request_id] == reference(model, req), req.request_id


class Faults:
    """An engine hook (what the `engine_hook` setting names: here an object
    with the same functions) that fails the requests it names: in the
    preparation of their prefill, or by an encoder output one row short of
    their placeholders."""

    def __init__(self, *, raising: set[str], short: set[str]) -> None:
        self.raising, self.short = raising, short

    def before_prefill(self, rank: int, req: NewRequest) -> None:
        if req.request_id in self.raising:
            raise RuntimeError("injected into the prefill's preparation")

    def on_encoded(self, rank: int, req: NewRequest, index: int, output: torch.Tensor) -> torch.Tensor:
        return output[:-1] if req.request_id in self.short else output


def test_a_request_whose_prefill_cannot_be_prepared_fails_alone(model: torch.nn.Module) -> None:
    """Two of ten joiners of one step fail in their prefill's making (an
    encoder output that does not fit its placeholders, an error while
    preparing): each fails alone with a typed error, the eight others make
    the tokens they make alone, and the batch goes on."""
    eos = int(model.config.text_config.eos_token_id)
    engine = encoding_engine(model, hook=Faults(raising={"raises"}, short={"short"}))
    good = [request(f"ok{i}", image_prompt(model, 1, [520 + i]), [pixels(60 + i)], max_tokens=4) for i in range(8)]
    short = request("short", image_prompt(model, 1, [530]), [pixels(70)], max_tokens=4)
    raises = request("raises", image_prompt(model, 1, [531]), [pixels(71)], max_tokens=4)
    running = request("running", image_prompt(model, 1, [532]), [pixels(72)], max_tokens=6)
    results = drive(engine, {0: [running], 1: [*good[:4], short, raises, *good[4:]]}, eos)
    assert results["short"] == results["raises"] == f"failed:{E.ERROR_CODE_INTERNAL}"
    for req in [*good, running]:
        assert results[req.request_id] == reference(model, req), req.request_id
    # Every item encoded was kept but the one that did not fit its placeholders.
    assert len(engine.encoder_cache) == 10, "the short output was kept"


class FailingEncoder:
    """A family whose encoder raises on a batch that holds a marked image
    (pixels all BAD: RuntimeError; all HUGE: MemoryError), as a vision
    tower would on an input it cannot take; the rest is the family's own."""

    BAD, HUGE = 0.25, 0.5

    def __init__(self, family: Any) -> None:
        self._family = family
        self.calls: list[int] = []  # the items of each call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)

    def encode(self, body: torch.nn.Module, modality: int, items: list[dict[str, torch.Tensor]]) -> Any:
        self.calls.append(len(items))
        for item in items:
            if any(bool((t == self.BAD).all()) for t in item.values()):
                raise RuntimeError("injected into the encoder")
            if any(bool((t == self.HUGE).all()) for t in item.values()):
                raise MemoryError
        return self._family.encode(body, modality, items)


def test_an_encoder_that_raises_on_one_request_s_image_fails_that_request_alone(model: torch.nn.Module) -> None:
    """The step's images are encoded in one call; when it raises, each
    request's images are encoded in a call of their own, so only the
    requests whose own call raises fail (out of memory: OVERLOADED,
    retriable; else INTERNAL), the others make the tokens they make
    alone, and rows already running go on."""
    eos = int(model.config.text_config.eos_token_id)
    engine = encoding_engine(model)
    encoder = FailingEncoder(engine._media.family)
    engine._media.family = encoder
    good = [request(f"ok{i}", image_prompt(model, 1, [560 + i]), [pixels(110 + i)], max_tokens=4) for i in range(6)]
    two = request("two", image_prompt(model, 2, [570]), [pixels(120), pixels(121)], max_tokens=4)
    bad = request("bad", image_prompt(model, 1, [571]), [pixels(122, fill=FailingEncoder.BAD)], max_tokens=4)
    huge = request("huge", image_prompt(model, 1, [572]), [pixels(123, fill=FailingEncoder.HUGE)], max_tokens=4)
    running = request("running", image_prompt(model, 1, [573]), [pixels(124)], max_tokens=8)
    joining = [*good[:3], bad, two, huge, *good[3:]]
    results = drive(engine, {0: [running], 1: joining}, eos)
    assert results["bad"] == f"failed:{E.ERROR_CODE_INTERNAL}"
    assert results["huge"] == f"failed:{E.ERROR_CODE_OVERLOADED}"
    for req in [*good, two, running]:
        assert results[req.request_id] == reference(model, req), req.request_id
    # The running request's image in a call of its own; then the step's ten
    # images in one, which raised; then each joiner's in a call of its own.
    assert encoder.calls == [1, 10, 1, 1, 1, 1, 2, 1, 1, 1, 1], encoder.calls
    assert len(engine.encoder_cache) == 1 + 6 + 2, "every good image's output was kept, and only those"


class BuggyReader(InlineReader):
    """The services' reader, with a bug (not a typed error) on the tensors
    of request "broken"."""

    def read(self, request_id: str, spec: TensorSpec) -> torch.Tensor:
        if request_id == "broken":
            raise ValueError("injected into the tensor reader")
        return super().read(request_id, spec)


def test_a_reader_or_hashing_bug_fails_only_that_request(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of ours while reading a request's tensors, or while hashing one
    of its items for the caches' keys, leaves this rank's vote with a typed
    error for that request alone (FEATURE_TRANSPORT_FAILED: its tensors are
    unusable here), so the others in its step, hashed on several threads,
    make their usual tokens."""
    eos = int(model.config.text_config.eos_token_id)
    unhashable = float(FailingEncoder.BAD)
    own_key = EncoderCache.key

    def key(encoder: dict[str, torch.Tensor], side: dict[str, Any]) -> bytes:
        if any(bool((t == unhashable).all()) for t in encoder.values()):
            raise RuntimeError("injected into an item's hashing")
        return own_key(encoder, side)

    monkeypatch.setattr(EncoderCache, "key", staticmethod(key))
    engine = Engine(
        model, SoloGroup(), BuggyReader(), torch.device("cpu"), eos_token_ids=frozenset([eos]), token_chunk=32,
        encoder_cache_bytes=64 << 20,
    )  # fmt: skip
    good = [request(f"ok{i}", image_prompt(model, 1, [580 + i]), [pixels(130 + i)], max_tokens=4) for i in range(4)]
    broken = request("broken", image_prompt(model, 1, [590]), [pixels(140)], max_tokens=4)
    # One whose second image cannot be hashed (the first one's key goes with
    # it), one whose first cannot (its second's key is not kept).
    last = request("last", image_prompt(model, 2, [591]), [pixels(141), pixels(142, fill=unhashable)])
    first = request("first", image_prompt(model, 2, [592]), [pixels(143, fill=unhashable), pixels(144)])
    results = drive(engine, {0: [good[0], broken, good[1], last, first, *good[2:]]}, eos)
    for rid in ("broken", "last", "first"):
        assert results[rid] == f"failed:{E.ERROR_CODE_FEATURE_TRANSPORT_FAILED}", rid
    assert len(engine.encoder_cache) == 4, "only the good requests' images were encoded and kept"
    for req in good:
        assert results[req.request_id] == reference(model, req), req.request_id


class UncompilableGrammars:
    """Rank 0's structured-output compiler, failing on every structure (a
    schema the tokenizer let through that the compiler cannot take)."""

    def constraint(self, structure: object, request_id: str = "") -> object:
        raise RuntimeError("injected into the grammar compiler")


@pytest.mark.parametrize("grammars", [None, UncompilableGrammars()], ids=["no-compiler", "compiler-raises"])
def test_a_structure_that_cannot_be_compiled_fails_its_request_alone(model: torch.nn.Module, grammars: object) -> None:
    """A request whose structured output has no constraint (no compiler in
    this engine, or compiling it raised) fails at its first token with a
    typed error; the requests beside it make their usual tokens."""
    eos = int(model.config.text_config.eos_token_id)
    engine = solo_engine(model, grammars=grammars)
    good = [request(f"ok{i}", image_prompt(model, 1, [600 + i]), [pixels(150 + i)], max_tokens=5) for i in range(3)]
    schema = ("json_schema", '{"type": "object"}')
    shaped = request("shaped", image_prompt(model, 1, [610]), [pixels(160)], max_tokens=5, structure=schema)
    results = drive(engine, {0: [good[0], shaped, good[1]], 1: [good[2]]}, eos)
    failed = results["shaped"]
    assert isinstance(failed, str), failed
    assert failed.startswith("rejected:"), failed
    assert ("not available" if grammars is None else "compiling its structured output failed") in failed
    for req in good:
        assert results[req.request_id] == reference(model, req), req.request_id


class FailingBody(torch.nn.Module):
    """The model's multimodal body, raising for prompts that hold a marker
    token: RuntimeError for BAD, MemoryError for HUGE."""

    BAD, HUGE = 31_001, 31_002

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        if bool((input_ids == self.BAD).any()):
            raise RuntimeError("injected into the prefill forward")
        if bool((input_ids == self.HUGE).any()):
            raise MemoryError
        return self.body(input_ids=input_ids, **kwargs)


def test_a_prefill_forward_that_raises_fails_only_its_request(model: torch.nn.Module, engine: Engine) -> None:
    """At TP=1 a prefill forward that raises is undone and each joiner
    tried alone: the one at fault fails with a typed error (out of memory:
    OVERLOADED, retriable), the others in its step make their usual tokens,
    and rows already running are untouched."""
    eos = int(model.config.text_config.eos_token_id)
    engine._prefill_body = FailingBody(engine._prefill_body)
    good = [request(f"ok{i}", image_prompt(model, 1, [540 + i]), [pixels(80 + i)], max_tokens=4) for i in range(8)]
    bad = request("bad", image_prompt(model, 1, [FailingBody.BAD]), [pixels(90)], max_tokens=4)
    huge = request("huge", image_prompt(model, 0, [FailingBody.HUGE, 7]), max_tokens=4)
    running = request("running", image_prompt(model, 1, [541]), [pixels(91)], max_tokens=6)
    results = drive(engine, {0: [running], 1: [*good[:5], bad, *good[5:], huge]}, eos)
    assert results["bad"] == f"failed:{E.ERROR_CODE_INTERNAL}"
    assert results["huge"] == f"failed:{E.ERROR_CODE_OVERLOADED}"
    for req in [*good, running]:
        assert results[req.request_id] == reference(model, req), req.request_id


class FailingDecode(torch.nn.Module):
    """The model's decode body, raising `raising[n]` at its n-th call."""

    def __init__(self, body: torch.nn.Module, raising: dict[int, BaseException]) -> None:
        super().__init__()
        self.body, self.raising, self.calls = body, raising, 0

    def forward(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        if self.calls in self.raising:
            raise self.raising[self.calls]
        return self.body(*args, **kwargs)


def test_a_decode_forward_that_raises_ends_its_rows_and_the_engine_goes_on(
    model: torch.nn.Module, engine: Engine
) -> None:
    """At TP=1 a decode forward that raises is undone and ends the rows it
    held, typed (out of memory: OVERLOADED, retriable; any other error:
    INTERNAL); a request that joins in that step and one that comes later
    make the tokens they make alone."""
    eos = int(model.config.text_config.eos_token_id)
    # Decode calls: step 1 (a, b), step 2 (a, b: raises; c joins), steps 3-4 (c),
    # step 6 (d: raises), then e's.
    engine._decode_body = FailingDecode(engine._decode_body, {2: MemoryError(), 5: RuntimeError("boom")})
    a = request("a", image_prompt(model, 1, [550]), [pixels(95)], max_tokens=8)
    b = request("b", image_prompt(model, 0, [551, 552]), max_tokens=8)
    c = request("c", image_prompt(model, 1, [553]), [pixels(96)], max_tokens=3)
    d = request("d", image_prompt(model, 0, [555]), max_tokens=8)
    e = request("e", image_prompt(model, 1, [554]), [pixels(97)], max_tokens=5)
    results = drive(engine, {0: [a, b], 2: [c], 5: [d], 8: [e]}, eos)
    assert results["a"] == results["b"] == f"ended:{E.ERROR_CODE_OVERLOADED}"
    assert results["d"] == f"ended:{E.ERROR_CODE_INTERNAL}"
    assert results["c"] == reference(model, c)
    assert results["e"] == reference(model, e)
    assert engine.cache.rows == 0


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(model: torch.nn.Module) -> None:
    """Prompts longer than a chunk (16 tokens here), with images whose
    placeholder runs chunks cut through, are prefilled one chunk a step:
    their tokens are those of one prefill, and a request already running
    gets a token every step meanwhile."""
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(
        model,
        SoloGroup(),
        InlineReader(),
        torch.device("cpu"),
        eos_token_ids=frozenset([eos]),
        token_chunk=32,
        encoder_cache_bytes=64 << 20,
        prefill_chunk=16,
    )
    rng = random.Random(11)
    running = request("running", image_prompt(model, 0, [600, 601]), max_tokens=40)
    long = [
        request("long1", image_prompt(model, 2, [rng.randrange(100, 30000) for _ in range(21)]),
                [pixels(95), pixels(96)], max_tokens=5),
        request("long2", [1, *(rng.randrange(100, 30000) for _ in range(50))], max_tokens=5),
    ]  # fmt: skip
    short = request("short", image_prompt(model, 1, [602])[:10], max_tokens=3)  # 10 tokens: one prefill
    steps_with_a_token: list[int] = []
    original = engine.step

    chunk_steps = 0

    def step(plan: Plan) -> StepOutcome:
        nonlocal chunk_steps
        outcome = original(plan)
        chunk_steps += "chunk" in outcome.phases
        if "running" in outcome.sampled:
            steps_with_a_token.append(plan.step)
        return outcome

    engine.step = step  # type: ignore[method-assign]
    results = drive(engine, {0: [running], 1: [long[0]], 2: [short, long[1]]}, eos)
    for req in [running, *long, short]:
        assert results[req.request_id] == reference(model, req), req.request_id
    # A step per chunk of 16 (one long prompt's at a time), and a token every step for "running".
    assert chunk_steps == sum(-(-len(req.input_ids) // 16) for req in long) == 14
    assert len(short.input_ids) <= 16
    assert len(results["running"]) == 40
    assert steps_with_a_token == list(range(40)), "the running request missed a step"


def test_a_chunk_that_raises_fails_its_long_prompt_alone(model: torch.nn.Module) -> None:
    """At TP=1 a long prompt whose second chunk raises fails alone, typed
    (out of memory: OVERLOADED; any other error: INTERNAL); the request
    decoding meanwhile, and a long prompt after them, make their usual tokens."""
    eos = int(model.config.text_config.eos_token_id)
    engine = solo_engine(model, encoder_cache_bytes=64 << 20, prefill_chunk=16)
    engine._prefill_body = FailingBody(engine._prefill_body)
    rng = random.Random(12)

    def long(rid: str, marker: int | None) -> NewRequest:
        ids = [1, *(rng.randrange(100, 30000) for _ in range(40))]
        if marker is not None:
            ids[20] = marker  # in its second chunk
        return request(rid, ids, max_tokens=4)

    running = request("running", image_prompt(model, 0, [610, 611]), max_tokens=20)
    bad, huge, fine = long("bad", FailingBody.BAD), long("huge", FailingBody.HUGE), long("fine", None)
    results = drive(engine, {0: [running], 1: [bad, huge], 2: [fine]}, eos)
    assert results["bad"] == f"ended:{E.ERROR_CODE_INTERNAL}"
    assert results["huge"] == f"ended:{E.ERROR_CODE_OVERLOADED}"
    for req in (running, fine):
        assert results[req.request_id] == reference(model, req), req.request_id


@pytest.mark.parametrize("how", ["raises", "dropped"])
def test_a_long_prompt_that_never_joins_lets_go_of_the_room_made_for_it(model: torch.nn.Module, how: str) -> None:
    """A long prompt's first chunk makes the batch's cache room for its row
    ahead of time (`RowCache.grow_ahead`); when a later chunk raises, or the
    request is dropped between chunks (cancelled), that room goes at once,
    not when the batch next empties."""
    eos = frozenset([int(model.config.text_config.eos_token_id)])
    engine = Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=eos, token_chunk=8,
                    prefill_chunk=16)  # fmt: skip
    engine._prefill_body = FailingBody(engine._prefill_body)
    running = request("running", image_prompt(model, 0, [610, 611]), max_tokens=50)
    out = engine.step(Plan(step=1, new=(running,)))
    ids = [1, *range(1000, 1040)]
    ids[20] = FailingBody.BAD if how == "raises" else 1020  # in its second chunk
    out = engine.step(Plan(step=2, new=(request("long", ids, max_tokens=4),), feed=tuple(out.sampled.items())))
    assert engine.cache._growth is not None, "its first chunk made room for its 41 tokens"
    held = engine.cache.nbytes()
    if how == "raises":
        out = engine.step(Plan(step=3, feed=tuple(out.sampled.items())))
        assert set(out.ended) == {"long"}
    else:
        out = engine.step(Plan(step=3, feed=tuple(out.sampled.items()), drop=("long",)))
    assert engine.cache._growth is None
    assert engine.cache.nbytes() == held, "the running row's own storage is as it was"
    assert set(out.sampled) == {"running"}


class FailingHead(torch.nn.Module):
    """The LM head, out of memory for a batch of exactly `rows` rows."""

    def __init__(self, head: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.head, self.rows, self.failed = head, rows, 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == self.rows:
            self.failed += 1
            raise MemoryError
        out: torch.Tensor = self.head(hidden)
        return out


def test_a_prefill_whose_head_raises_is_tried_alone(model: torch.nn.Module, engine: Engine) -> None:
    """The LM head is part of the prefill that is undone and retried: 9
    joiners whose batched head runs out of memory each get their usual
    tokens alone, and the running row is untouched."""
    eos = int(model.config.text_config.eos_token_id)
    head = model.lm_head
    model.lm_head = FailingHead(head, rows=9)
    try:
        joiners = [
            request(f"h{i}", image_prompt(model, 1, [560 + i]), [pixels(100 + i)], max_tokens=4) for i in range(9)
        ]
        running = request("h-running", image_prompt(model, 1, [570]), [pixels(110)], max_tokens=6)
        results = drive(engine, {0: [running], 1: joiners}, eos)
        assert model.lm_head.failed == 1
    finally:
        model.lm_head = head
    for req in [*joiners, running]:
        assert results[req.request_id] == reference(model, req), req.request_id


def test_rows_leaving_together_leave_last_first_and_move_no_kv(model: torch.nn.Module, engine: Engine) -> None:
    """A row leaves by swap-remove (the last row moves into its place): rows
    that leave in one step go last first, so none is copied only to leave
    too (the tokens of rows that move are checked by the continuous batching
    test above)."""
    reqs = [request(f"r{i}", image_prompt(model, 0, [600 + i, 700]), max_tokens=6) for i in range(4)]
    outcome = engine.step(Plan(step=1, new=tuple(reqs)))
    removed: list[tuple[int, int]] = []  # (row, rows then)
    remove = engine.cache.remove

    def spy(row: int) -> None:
        removed.append((row, engine.cache.rows))
        remove(row)

    engine.cache.remove = spy  # type: ignore[method-assign]
    # r0 and r2 leave (in plan order: the first rows first), r1 and r3 go on.
    feed = tuple((rid, token) for rid, token in outcome.sampled.items() if rid in ("r1", "r3"))
    outcome = engine.step(Plan(step=2, feed=feed, drop=("r0", "r2")))
    assert removed == [(2, 4), (0, 3)], "r2 first (row 2 of 4: the last row moves there), then r0"
    assert set(outcome.sampled) == {"r1", "r3"}
    removed.clear()
    engine.step(Plan(step=3, drop=("r1", "r3")))
    assert removed == [(1, 2), (0, 1)], "the last row each time: no row's KV moved"
    assert (engine.cache.rows, engine.cache.nbytes()) == (0, 0)


@pytest.mark.parametrize(
    ("device", "cudnn", "inside"),
    [("cuda", False, False), ("cuda", True, True), ("cpu", False, True)],
    ids=["CUDA: without cuDNN's kernel", "CUDA: --cudnn-attention", "CPU: as torch has it"],
)
def test_a_step_runs_without_cudnns_attention_on_cuda_unless_asked(device: str, cudnn: bool, inside: bool) -> None:
    """cuDNN's SDPA plans a graph on the host per new shape (decode steps
    1.3-1.8x as long on an H200, bench/step_profile.py): a CUDA engine's
    step runs without it unless --cudnn-attention, and puts torch's flags
    back after (the backend flags are global; flags are all this CPU build
    can show)."""
    from scheduler_svc.engine import _attention_kernels

    kernels = _attention_kernels(torch.device(device), cudnn=cudnn)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with kernels():
        assert torch.backends.cuda.cudnn_sdp_enabled() is inside
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_whole_step_runs_under_the_engines_attention_kernels(model: torch.nn.Module, engine: Engine) -> None:
    """The vision tower, the prefill and the decode forwards all run under
    the engine's choice (here a CUDA engine's, on this CPU: only the flags
    show), and torch's flags are as they were between steps."""
    from scheduler_svc.engine import _attention_kernels

    engine._kernels = _attention_kernels(torch.device("cuda"), cudnn=False)
    seen: list[tuple[str, bool]] = []

    def record(name: str) -> Any:
        return lambda *_: seen.append((name, torch.backends.cuda.cudnn_sdp_enabled()))

    hooks = [
        model.model.vision_tower.register_forward_pre_hook(record("tower")),  # type: ignore[union-attr,operator]
        model.model.language_model.register_forward_pre_hook(record("language model")),  # type: ignore[union-attr,operator]
    ]
    try:
        req = request("r", image_prompt(model, 1, [500]), [pixels(3)], max_tokens=3, min_tokens=3)
        results = drive(engine, {0: [req]}, model.config.text_config.eos_token_id)  # type: ignore[union-attr]
    finally:
        for hook in hooks:
            hook.remove()
    assert len(results["r"]) == 3
    assert {name for name, _ in seen} == {"tower", "language model"}
    assert len(seen) >= 4
    assert not any(cudnn for _, cudnn in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()


def _expected_scores(model: torch.nn.Module, req: NewRequest) -> torch.Tensor:
    """log_softmax of the model's logits over the whole prompt, one forward: ``[prompt - 1, vocab]``."""
    images = [torch.frombuffer(bytearray(s.inline or b""), dtype=torch.float32).reshape(s.shape) for s in req.specs]
    extra = {"pixel_values": torch.cat(images)} if images else {}
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([req.input_ids]), **extra).logits[0, :-1]  # type: ignore[operator]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_are_the_model_s_own_over_every_prompt_position(model: torch.nn.Module, chunk: int) -> None:
    """prompt_logprobs: one entry per prompt token after the first, its log
    probability, rank and top tokens on log_softmax of one full forward of
    the prompt (images included), whether the prompt joined with others,
    was prefilled in chunks, or matches blocks the prefix cache holds
    (never taken: its cached tokens are 0); the generated tokens are
    unchanged, and requests that did not ask get none."""
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(
        model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset([eos]), token_chunk=32,
        encoder_cache_bytes=64 << 20, prefill_chunk=chunk, prefix_cache_bytes=64 << 20,
    )  # fmt: skip
    rng = random.Random(5)
    text = [rng.randrange(100, 30000) for _ in range(40)]
    first = request("first", image_prompt(model, 1, text), [pixels(1)], max_tokens=2)
    asked = [
        request("again", first.input_ids, [pixels(1)], max_tokens=3, prompt_logprobs=3),
        request("plain", [1, *text[:25]], max_tokens=3, prompt_logprobs=0),
        request("two", image_prompt(model, 2, text[:7]), [pixels(2), pixels(3)], max_tokens=2, prompt_logprobs=20),
    ]
    other = request("other", [1, *text[5:30]], max_tokens=4)
    scores: dict[str, list[Any]] = {}
    cached: dict[str, int] = {}
    original = engine.step

    def step(plan: Plan) -> StepOutcome:
        outcome = original(plan)
        assert not set(scores) & set(outcome.prompt_logprobs), "reported twice"
        scores.update(outcome.prompt_logprobs)
        return outcome

    engine.step = step  # type: ignore[method-assign]
    results = drive(engine, {0: [first], 4: [*asked, other]}, eos, cached)
    for req in [first, *asked, other]:
        assert results[req.request_id] == reference(model, req), req.request_id
    assert set(scores) == {r.request_id for r in asked}
    assert cached["again"] == 0
    for req in asked:
        expected = _expected_scores(model, req)
        got = scores[req.request_id]
        assert len(got) == len(req.input_ids) - 1, req.request_id
        top = req.sampling.prompt_logprobs
        for k, (token, lp) in enumerate(zip(req.input_ids[1:], got, strict=True)):
            assert lp.logprob == pytest.approx(float(expected[k, token]), abs=1e-4), (req.request_id, k)
            assert rank_within_ties(lp.rank, expected[k], token), (req.request_id, k, lp.rank)
            best = torch.topk(expected[k], top) if top else None
            assert list(lp.top_ids) == ([] if best is None else best.indices.tolist()), (req.request_id, k)
            if best is not None:
                assert list(lp.top_logprobs) == pytest.approx(best.values.tolist(), abs=1e-4)


class FailingScores:
    """An engine hook that fails the making of the named requests' prompt log probabilities."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def before_scoring(self, rank: int, req: NewRequest) -> None:
        if req.request_id in self.names:
            raise RuntimeError("out of memory (injected)")


def test_prompt_logprobs_that_cannot_be_made_fail_only_their_request(model: torch.nn.Module) -> None:
    """Making one request's prompt log probabilities raises (out of memory,
    say), whole or in chunks: that request fails alone at its first token,
    the others joining with it get their tokens and scores, and the
    engine goes on."""
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(
        model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=frozenset([eos]), token_chunk=32,
        encoder_cache_bytes=64 << 20, prefill_chunk=16, hook=FailingScores({"short", "long"}),
    )  # fmt: skip
    rng = random.Random(9)
    text = [rng.randrange(100, 30000) for _ in range(30)]
    victims = [request("short", [1, *text[:9]], prompt_logprobs=7), request("long", [1, *text], prompt_logprobs=7)]
    others = [request("scored", [1, *text[:12]], max_tokens=3, prompt_logprobs=1), request("plain", [1, *text[3:8]])]
    scores: dict[str, list[Any]] = {}
    original = engine.step

    def step(plan: Plan) -> StepOutcome:
        outcome = original(plan)
        scores.update(outcome.prompt_logprobs)
        return outcome

    engine.step = step  # type: ignore[method-assign]
    results = drive(engine, {0: [*victims, *others]}, eos)
    for victim in victims:
        assert str(results[victim.request_id]).startswith("rejected:its prompt log probabilities"), results
    for req in others:
        assert results[req.request_id] == reference(model, req), req.request_id
    assert set(scores) == {"scored"}
    assert len(scores["scored"]) == 12
    assert engine.cache.rows == 0
