"""Decode steps without transformers' module calls (scheduler_svc/lean_decode.py):
the same logits bit for bit as the model's own forward, step after step
with rows joining and leaving; used only where it may be (a Llama text
model, one rank, a probe that agrees at start-up, no hook on a module it
skips), the model's own forward everywhere else."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler_svc.engine import Engine
from scheduler_svc.kvcache import RowCache
from scheduler_svc.lean_decode import LeanLlama, lean_decode_body
from scheduler_svc.plan import Plan, StepOutcome
from tests.support import family_kit
from tests.support.engine_kit import drive, image_prompt, pixels, reference, request, solo_engine


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.language_model  # type: ignore[union-attr,return-value]


class Twins:
    """Two engines stepped with the same plans; every step's outcome must be
    the same in both, log probabilities (the logits' values) included."""

    def __init__(self, one: Engine, other: Engine) -> None:
        self.one, self.other = one, other
        self.steps = 0
        self.scored = 0  # tokens whose log probabilities were compared
        self.deltas: set[int] = set()  # the running rows' M-RoPE offsets seen

    @property
    def rows(self) -> list[Any]:
        assert len(self.one.rows) == len(self.other.rows)
        return self.one.rows

    @property
    def prefilling(self) -> bool:
        return self.one.prefilling

    def step(self, plan: Plan) -> StepOutcome:
        mine, theirs = self.one.step(plan), self.other.step(plan)
        assert mine.sampled == theirs.sampled, f"step {plan.step}"
        assert mine.logprobs == theirs.logprobs, f"step {plan.step}"
        assert not mine.failed
        assert not mine.rejected
        assert not mine.ended
        self.steps += 1
        self.scored += len(mine.logprobs)
        self.deltas.update(row.rope_delta for row in self.one.rows)
        return mine


def workload(model: torch.nn.Module, seed: int, *, images: bool) -> tuple[dict[int, list[Any]], list[Any]]:
    """12 requests of different prompts and lengths joining at random steps;
    every other one asks for its tokens' log probabilities (5 alternatives)."""
    rng = random.Random(seed)
    arrivals: dict[int, list[Any]] = {}
    requests = []
    for i in range(12):
        n_images = rng.choice([0, 1]) if images else 0
        ids = image_prompt(model, n_images, [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 30))])
        scored = {"logprobs": True, "top_logprobs": 5} if i % 2 else {}
        req = request(f"r{i}", ids, [pixels(seed + i)] * n_images, max_tokens=rng.randrange(2, 14), **scored)
        requests.append(req)
        arrivals.setdefault(rng.randrange(0, 10), []).append(req)
    return arrivals, requests


@pytest.mark.parametrize(
    ("family", "kv_multiple"),
    [
        ("llava", 1),
        ("llava", 64),
        ("llava-next", 1),
        ("qwen2-vl", 1),
        ("qwen2.5-vl", 1),
        ("qwen3-vl", 1),
        ("internvl", 1),
        ("internvl3.5", 1),
    ],
)
def test_lean_decode_makes_the_model_s_own_logits_bit_for_bit(
    family_models: Callable[[str], Path], family: str, kv_multiple: int
) -> None:
    """`kv_multiple` 64: each decode step's keys padded (masked) to a
    multiple of 64, as `--decode-kv-multiple` asks on a GPU."""
    model = load(family_models(family))
    options = {"decode_kv_multiple": kv_multiple}
    lean, own = solo_engine(model, **options), solo_engine(model, lean_decode=False, **options)
    assert isinstance(lean._decode_body, LeanLlama)
    assert own._decode_body is text_model(model)
    # The other families' requests here are text only (the kit's images are the tiny
    # LLaVA's): images change prefills, not decode steps; a Qwen row decodes at its
    # prompt's M-RoPE offset either way.
    arrivals, requests = workload(model, 7, images=family == "llava")
    twins = Twins(lean, own)
    results = drive(twins, arrivals, model.config.text_config.eos_token_id)  # type: ignore[arg-type,union-attr]
    assert twins.steps > 10
    assert twins.scored > 20
    assert sorted(results) == sorted(req.request_id for req in requests)
    first = requests[0]
    assert results[first.request_id] == reference(model, first)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_qwen_rows_after_images_decode_bit_for_bit(family_models: Callable[[str], Path], family: str) -> None:
    """Rows whose prompts hold images decode at their M-RoPE offset (the
    prompt's rope delta, not 0): the same logits both ways there too."""
    from PIL import Image

    model_dir = family_models(family)
    model = load(model_dir)
    kit = family_kit.kit(model_dir)
    rng = random.Random(11)
    arrivals: dict[int, list[Any]] = {}
    for i in range(6):
        size = (rng.randrange(28, 120), rng.randrange(28, 120))
        image = Image.new("RGB", size, (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
        message = kit.message(f"q{i}", f"Look: {kit.marker} and tell me {i}.", [image], rng.randrange(3, 10))
        message.sampling.logprobs, message.sampling.top_logprobs = True, 5
        arrivals.setdefault(rng.randrange(0, 5), []).append(family_kit.admit(model_dir, message))
    lean, own = solo_engine(model), solo_engine(model, lean_decode=False)
    assert isinstance(lean._decode_body, LeanLlama)
    twins = Twins(lean, own)
    results = drive(twins, arrivals, model.config.text_config.eos_token_id)  # type: ignore[arg-type,union-attr]
    assert len(results) == 6
    assert all(isinstance(tokens, list) for tokens in results.values()), results
    assert twins.scored > 10
    assert twins.deltas - {0}, "some rows decoded at an offset from their images"


def keeps_its_own_forward(model: Any, caplog: pytest.LogCaptureFixture, level: int, says: str) -> None:
    """A solo engine over `model` decodes through the model's own forward and logs `says` at `level`."""
    with caplog.at_level(level, logger="scheduler_svc.lean_decode"):
        engine = solo_engine(model)
    assert engine._decode_body is text_model(model)
    assert says in caplog.text


def test_other_text_models_decode_through_their_own_forward(
    family_models: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    model = load(family_models("qwen3-vl-moe"))  # its experts are no MLP the lean bodies copy
    keeps_its_own_forward(model, caplog, logging.INFO, "is not one whose layers it copies")


def test_off_the_model_s_own_forward_runs(tiny_model: Path) -> None:
    model = load(tiny_model)
    assert solo_engine(model, lean_decode=False)._decode_body is text_model(model)


def test_forwards_set_before_it_are_the_model_s_own_and_later_ones_are_seen(tiny_model: Path) -> None:
    """As transformers' TP plan does, a projection whose instance has its
    own forward as the lean body is made keeps it (the body calls it, and
    decodes leanly); one set later, as a test's fault or an offload hook
    would be, sends calls through the model's own forward."""
    model = load(tiny_model)
    body = text_model(model)
    o_proj = body.layers[0].self_attn.o_proj  # type: ignore[index,union-attr]
    calls: list[int] = []

    def counted(x: torch.Tensor, plain: Any = o_proj.forward) -> torch.Tensor:
        calls.append(x.shape[1])
        return plain(x)  # type: ignore[no-any-return]

    o_proj.forward = counted
    lean = lean_decode_body(
        body, make_cache=lambda layers: RowCache(layers, dtype=torch.float32, device=torch.device("cpu"))
    )
    assert isinstance(lean, LeanLlama)
    assert not lean.observed()
    assert calls, "the probe's lean forwards called the instance's own forward"
    body.layers[1].mlp.down_proj.forward = lambda x: x  # type: ignore[index,union-attr,method-assign]
    assert lean.observed()


def test_a_projection_of_its_own_kind_is_never_skipped(tiny_model: Path) -> None:
    """A projection that is no plain `nn.Linear` (a quantized layer, say)
    multiplies in its own forward, which the lean body would skip: even one
    that computes what `nn.Linear` does (so the start-up probe agrees) keeps
    the model's own forward, and its forward runs in every decode step."""
    calls: list[int] = []

    class Counted(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[1])
            return super().forward(x)

    model = load(tiny_model)
    old = text_model(model).layers[0].mlp.up_proj  # type: ignore[index]
    counted = Counted(old.in_features, old.out_features, bias=False)
    counted.weight = old.weight
    text_model(model).layers[0].mlp.up_proj = counted  # type: ignore[index]
    engine = solo_engine(model)
    assert engine._decode_body is text_model(model)
    req = request("r", image_prompt(model, 0, [500, 600]), max_tokens=4, min_tokens=4)
    assert drive(engine, {0: [req]}, model.config.text_config.eos_token_id)["r"] == reference(model, req)  # type: ignore[union-attr]
    assert calls.count(1) >= 3  # the 3 decode steps after the prefill (the reference's calls are whole prompts)


def test_a_layer_that_computes_otherwise_keeps_the_model_s_own_forward(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a kernel that replaced a layer's forward would: the start-up probe
    sees other hidden states, and the engine keeps the model's forward."""
    from transformers.models.llama import modeling_llama

    plain = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: plain(self, x) * 1.001)
    says = "made other hidden states than the model's own forward in a prefill"
    keeps_its_own_forward(load(tiny_model), caplog, logging.WARNING, says)


def test_a_hook_on_a_skipped_module_sends_steps_through_the_model_s_own_forward(tiny_model: Path) -> None:
    model = load(tiny_model)
    engine = solo_engine(model)
    assert isinstance(engine._decode_body, LeanLlama)
    layer = text_model(model).layers[1]  # type: ignore[index]
    calls: list[int] = []
    handle = layer.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    eos = model.config.text_config.eos_token_id  # type: ignore[union-attr]
    req = request("hooked", image_prompt(model, 0, [500, 600]), max_tokens=5, min_tokens=5)
    try:
        assert drive(engine, {0: [req]}, eos)["hooked"] == reference(model, req)
    finally:
        handle.remove()
    assert calls.count(1) == 4, calls  # the 4 decode steps after the prefill, each one token
    calls.clear()
    again = request("plain", image_prompt(model, 0, [500, 600]), max_tokens=5, min_tokens=5)
    assert drive(engine, {0: [again]}, eos)["plain"] == reference(model, req)
    assert calls == []
