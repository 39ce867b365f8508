"""A prompt whose prefill can never fit one step is refused at admission:
one with media that cannot be cut into chunks (with the encoder cache off
the forward encodes them itself) and longer than --max-prefill-tokens gets
INVALID_REQUEST naming the setting, instead of running alone and out of
memory; whatever can be chunked (text; media with the encoder cache on) is
admitted. And an image's rows of one frame are admitted unless the
scheduler is told not to take them."""

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


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_an_image_s_rows_of_one_frame_are_taken_unless_the_scheduler_is_told_not_to(
    family_models: Callable[[str], Path], family: str
) -> None:
    """Rows of one frame (ServerInfo.one_frame_image_rows) pass admission
    with the placeholders of all frames' rows; `--one-frame-image-rows
    false` refuses them by name, as a scheduler before them would, and
    still takes rows of all frames."""
    model_dir = family_models(family)
    kit = family_kit.kit(model_dir)
    image = Image.new("RGB", (96, 64), "red")
    text = f"Look: {kit.marker} and tell me."
    whole, one = (kit.message("r", text, [image], 4, one_frame=flag) for flag in (False, True))
    assert list(one.input_ids) == list(whole.input_ids)
    width = {m.items[0].tensors["pixel_values"].shape[1] for m in (whole, one)}
    assert len(width) == 2, width
    assert family_kit.admit(model_dir, one).request_id == "r"
    assert family_kit.admit(model_dir, whole, one_frame_image_rows=False).request_id == "r"
    with pytest.raises(MmsplitError) as refused:
        family_kit.admit(model_dir, one, one_frame_image_rows=False)
    assert refused.value.error_code == E.ERROR_CODE_INVALID_REQUEST
    assert "--one-frame-image-rows" in refused.value.message
