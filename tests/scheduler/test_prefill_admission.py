"""A prompt whose prefill can never fit one step is refused at admission:
one with media that cannot be cut into chunks (with the encoder cache off
the forward encodes them itself) and longer than --max-prefill-tokens gets
INVALID_REQUEST naming the setting, instead of running alone and out of
memory; whatever can be chunked (text; media with the encoder cache on) is
admitted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from mmsplit.errors import E, MmsplitError
from tests.support import family_kit


@pytest.mark.parametrize(
    ("family", "encoder_cache_bytes", "cut"),
    [("llava-next", 0, False), ("qwen2-vl", 0, False), ("llava", 256 << 20, True), ("llava-next", 256 << 20, True)],
)
def test_a_prompt_with_media_that_cannot_be_cut_must_fit_one_step(
    family_models: Callable[[str], Path], family: str, encoder_cache_bytes: int, cut: bool
) -> None:
    model_dir = family_models(family)
    kit = family_kit.kit(model_dir)
    message = kit.message("r", f"Look: {kit.marker} and tell me.", [Image.new("RGB", (64, 48), "red")], 4)
    n = len(message.input_ids)
    settings = {"encoder_cache_bytes": encoder_cache_bytes}
    assert family_kit.admit(model_dir, message, max_prefill_tokens=n, **settings).request_id == "r"
    if cut:
        assert family_kit.admit(model_dir, message, max_prefill_tokens=n - 1, **settings).request_id == "r"
        return
    with pytest.raises(MmsplitError) as refused:
        family_kit.admit(model_dir, message, max_prefill_tokens=n - 1, **settings)
    assert refused.value.error_code == E.ERROR_CODE_INVALID_REQUEST
    assert "--max-prefill-tokens" in refused.value.message
    text = message.__class__()
    text.CopyFrom(message)
    del text.items[:]
    text.input_ids[:] = [kit.tokenizer.bos_token_id or 1] * n
    assert family_kit.admit(model_dir, text, max_prefill_tokens=n - 1, **settings).request_id == "r", "text is cut"
