"""The LM head's weight in either memory layout (scheduler_svc/head_layout.py):
the same values and products whichever is taken, only a measured CPU weight
is ever changed by `auto`, and an engine whose head is stored column after
column makes the greedy tokens of the model as the checkpoint stores it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from scheduler_svc.head_layout import column_major, lay_out
from tests.support.engine_kit import drive, image_prompt, pixels, reference, request, solo_engine


def test_column_major_holds_the_same_values_in_the_other_order() -> None:
    weight = torch.randn(300, 48)
    laid = column_major(weight)
    assert laid.shape == weight.shape
    assert torch.equal(laid, weight)
    assert laid.stride() == (1, 300)
    assert laid.data_ptr() != weight.data_ptr()
    hidden = torch.randn(5, 48)
    products = torch.nn.functional.linear(hidden, laid), torch.nn.functional.linear(hidden, weight)
    torch.testing.assert_close(*products, rtol=1e-5, atol=1e-5)


def test_each_layout_is_what_it_says() -> None:
    weight = torch.randn(2000, 64)
    assert lay_out(weight, "stored") is weight
    assert lay_out(weight, "columns").stride() == (1, 2000)
    chosen = lay_out(weight, "auto")  # measured here: either, with the same values
    assert chosen is weight or (chosen.stride() == (1, 2000) and torch.equal(chosen, weight))
    with pytest.raises(ValueError, match="unknown LM head layout 'rows'"):
        lay_out(weight, "rows")


def test_auto_measures_only_a_2d_contiguous_weight() -> None:
    strided = torch.randn(64, 2000).t()  # not contiguous: as it is, never measured
    assert lay_out(strided, "auto") is strided
    flat = torch.randn(2000)
    assert lay_out(flat, "auto") is flat
    assert lay_out(flat, "columns") is flat


def test_an_engine_with_its_head_column_after_column_makes_the_model_s_tokens(tiny_model: Path) -> None:
    from transformers import AutoModelForImageTextToText

    def load() -> torch.nn.Module:
        return AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()

    stored, model = load(), load()
    engine = solo_engine(model, head_layout="columns")
    vocab = model.lm_head.weight.shape[0]
    assert model.lm_head.weight.stride() == (1, vocab), "the engine's model holds its head column after column"
    assert stored.lm_head.weight.stride() == (model.config.text_config.hidden_size, 1)
    rng = random.Random(3)
    arrivals: dict[int, list] = {}
    requests = []
    for i in range(8):
        n_images = rng.choice([0, 1])
        ids = image_prompt(model, n_images, [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 20))])
        req = request(f"r{i}", ids, [pixels(50 + i)] * n_images, max_tokens=rng.randrange(1, 12))
        requests.append(req)
        arrivals.setdefault(rng.randrange(0, 6), []).append(req)
    results = drive(engine, arrivals, model.config.text_config.eos_token_id)
    assert results == {req.request_id: reference(stored, req) for req in requests}
