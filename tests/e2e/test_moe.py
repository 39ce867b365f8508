"""Qwen3-VL's mixture-of-experts variant (`qwen3_vl_moe`): the Qwen3-VL
adapter serves it at TP=2 (its experts loaded whole on each rank:
`Qwen3VL.tp_plan_overrides`, then split over the two by
`scheduler_svc.experts`), prefilling in chunks, with greedy tokens and log
probabilities equal to the model's own `generate` for text, images and
videos in one batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.helpers import png, rank_active_requests
from tests.support import greedy
from tests.support.leaks import wait_until
from tests.support.services import running_pair

pytestmark = pytest.mark.e2e
FAMILY = "qwen3-vl-moe"


def test_qwen3_vl_moe_at_tp2_gives_the_model_s_tokens_for_text_images_and_videos(
    family_models: Callable[[str], Path], tmp_path: Path
) -> None:
    model = family_models(FAMILY)
    extra = ["--max-prefill-tokens", "32", "--log-level", "DEBUG"]
    with running_pair(model, tmp_path, scheduler_extra=extra) as pair:
        images = (png(120, 200, 1), png(300, 90, 2), png(224, 224, 3))
        greedy.equal_to_the_model(FAMILY, pair, greedy.asks(FAMILY, video=True, images=images), max_tokens=6)
        log = pair.scheduler.log_path.read_text()
        assert log.count("prefilled in chunks") >= 8, "the media asks were not prefilled in chunks (a line per rank)"
        split = [line for line in log.splitlines() if "MoE layers split over 2 ranks" in line]
        assert len(split) == 2, "each rank keeps half of every expert"
        assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0, 0], timeout=10)
