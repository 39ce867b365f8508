"""The engine in this process (a group of one, the tiny LLaVA): continuous
batching with images equals plain greedy decoding, and bad requests fail
alone — before the forward when every rank can see it, after it on rank 0
when only the logits show it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mmsplit.errors import E
from scheduler_svc.engine import Engine, all_finite
from scheduler_svc.plan import NewRequest, Plan
from tests.support.engine_kit import InlineReader, SoloGroup, pixels, request


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture
def engine(model: torch.nn.Module) -> Engine:
    eos = frozenset([int(model.config.text_config.eos_token_id)])
    return Engine(model, SoloGroup(), InlineReader(), torch.device("cpu"), eos_token_ids=eos, token_chunk=32)


def reference(model: torch.nn.Module, req: NewRequest) -> list[int]:
    """Greedy by full recomputation, stopping at EOS like the scheduler."""
    eos = model.config.text_config.eos_token_id
    seq = list(req.input_ids)
    images = [torch.frombuffer(bytearray(s.inline or b""), dtype=torch.float32).reshape(s.shape) for s in req.specs]
    extra = {"pixel_values": torch.cat(images)} if images else {}
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < req.sampling.max_tokens:
            token = int(model(input_ids=torch.tensor([seq]), **extra).logits[0, -1].argmax())  # type: ignore[operator]
            out.append(token)
            if token == eos:
                break
            seq.append(token)
    return out


def drive(engine: Engine, arrivals: dict[int, list[NewRequest]], eos: int) -> dict[str, list[int] | str]:
    """Run plans the way the step loop makes them: joins at their step,
    each running request fed its last token, finished or failed ones dropped
    in the next plan. Returns each request's tokens, or its error."""
    results: dict[str, list[int] | str] = {}
    limits: dict[str, int] = {}
    feeds: dict[str, int] = {}
    drop: list[str] = []
    step = 0
    while step <= max(arrivals) or feeds or drop:
        new = tuple(arrivals.get(step, ()))
        limits.update({r.request_id: r.sampling.max_tokens for r in new})
        outcome = engine.step(Plan(step=step, new=new, drop=tuple(drop), feed=tuple(feeds.items())))
        drop, feeds = [], {}
        for rid, failure in outcome.failed.items():
            results[rid] = f"failed:{failure.code}"
        for rid, why in outcome.rejected.items():
            results[rid] = f"rejected:{why}"
            drop.append(rid)
        for rid, token in outcome.sampled.items():
            made = results.setdefault(rid, [])
            assert isinstance(made, list)
            made.append(token)
            if token == eos or len(made) >= limits[rid]:
                drop.append(rid)
            else:
                feeds[rid] = token
        step += 1
    assert not engine.rows, "every request left"
    return results


def image_prompt(model: torch.nn.Module, n_images: int, text: list[int]) -> list[int]:
    return [1, *([model.config.image_token_id] * 64 * n_images), *text]


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


def test_items_of_one_step_are_keyed_together_and_hit_the_encoder_cache(model: torch.nn.Module) -> None:
    """Several requests with one or two images join in one step (their
    items hashed on several threads); the same images later hit the
    encoder cache; every request makes the tokens plain decoding makes."""
    eos = int(model.config.text_config.eos_token_id)
    engine = Engine(
        model,
        SoloGroup(),
        InlineReader(),
        torch.device("cpu"),
        eos_token_ids=frozenset([eos]),
        token_chunk=32,
        encoder_cache_bytes=64 << 20,
    )
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
