"""Video decoding in the worker, in-process: the corpus's documented
outcomes, the sampling rule, the deadline, and item rows equal to what
transformers' Qwen2-VL video processor computes."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mmsplit.errors import MmsplitError
from mmsplit_cli import samples
from mmsplit_server import families
from tests.support import hf_family, video_corpus
from tokenizer_svc import pil_shortcuts, video
from tokenizer_svc.errors import PreprocessTimeout
from tokenizer_svc.settings import TokenizerSettings

DEFAULTS = TokenizerSettings(model_dir=Path("."))
RULE = video.Sampling(fps=2.0, min_frames=4, max_frames=8, temporal_patch_size=2)


def limits(deadline_s: float = 30.0) -> video.VideoLimits:
    return video.VideoLimits(
        max_pixels=DEFAULTS.max_video_frame_pixels,
        max_duration_s=DEFAULTS.max_video_duration_s,
        max_frames=DEFAULTS.max_video_file_frames,
        deadline=time.monotonic() + deadline_s,
    )


def outcome(data: bytes) -> str:
    try:
        clip = video.decode_video(data, limits(), RULE)
    except MmsplitError as exc:
        return exc.reason
    assert clip.frames
    assert len(clip.frames) == len(clip.indices)
    assert {f.size for f in clip.frames} == {(clip.width, clip.height)}
    return "ok"


def test_every_corpus_case_has_its_documented_outcome_and_writes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A temporary directory of this test's own (the shared one sees other
    # test processes' files come and go): Python's and FFmpeg's (TMPDIR).
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    cases = video_corpus.corpus()
    outcomes = {case.name: outcome(case.data) for case in cases}
    assert outcomes == {case.name: case.expected for case in cases}
    assert os.listdir(private) == []


@pytest.mark.parametrize(
    ("total", "fps", "expected"),
    [
        (12, 6.0, [0, 3, 6, 9]),  # 2 s at 6 fps: 4 frames at 2 fps
        (5, 6.0, [0, 1, 2, 3]),  # under a second: raised to min_frames, capped at what there is (even)
        (1, 6.0, [0]),  # fewer frames than a temporal patch: all of them
        (3, 6.0, [0, 1]),
        (600, 30.0, [0, 75, 150, 225, 300, 375, 450, 525]),  # 20 s: 40 wanted, max_frames 8
        (10, 4.96, [0, 2, 5, 7]),  # a variable rate: by index over the average rate
    ],
)
def test_sampling_rule(total: int, fps: float, expected: list[int]) -> None:
    assert video.sample_indices(total, fps, RULE) == expected


@pytest.mark.parametrize("total", [1, 2, 3, 5, 12, 13, 97, 600])
@pytest.mark.parametrize("fps", [1.0, 4.96, 6.0, 29.97])
def test_spread_sampling_is_qwen3_vls_rule_and_its_times_are_the_processors(total: int, fps: float) -> None:
    """Qwen3-VL's video processor: ``int(total / fps * 2)`` frames within
    [min_frames, max_frames] and what there is, by ``linspace(0, total - 1)``
    rounded; its processor's time per temporal patch."""
    from transformers import Qwen3VLProcessor

    rule = dataclasses.replace(RULE, how="spread")
    n = min(max(int(total / fps * rule.fps), rule.min_frames), rule.max_frames, total)
    indices = video.sample_indices(total, fps, rule)
    assert indices == np.linspace(0, total - 1, n).round().astype(int).tolist()
    clip = video.Video([], indices, total, fps, 0, 0)
    expected = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, rule.temporal_patch_size)  # type: ignore[arg-type]
    assert clip.patch_times(rule.temporal_patch_size) == pytest.approx(tuple(expected), abs=1e-12)


@pytest.mark.parametrize("total", [1, 2, 3, 5, 7, 12, 13, 97, 600, 1799])
@pytest.mark.parametrize("fps", [1.0, 4.96, 6.0, 29.97])
def test_centered_sampling_is_internvls_rule(total: int, fps: float) -> None:
    """InternVL's video processor (`sample_frames` with fps and its
    `initial_shift`, restated: its module needs torchvision):
    ``int(total / fps * 2)`` frames within [min_frames, max_frames] and what
    there is, at ``arange(total / n / 2, total, total / n)``, each in the
    middle of its part."""
    import torch

    rule = dataclasses.replace(RULE, how="centered", temporal_patch_size=1)
    n = min(max(int(total / fps * rule.fps), rule.min_frames), rule.max_frames, total)
    indices = video.sample_indices(total, fps, rule)
    assert indices == torch.arange(total / n / 2, total, total / n).int().tolist()
    assert len(set(indices)) == n


def test_a_video_over_its_budget_stops_with_preprocess_timeout() -> None:
    with pytest.raises(PreprocessTimeout):
        video.decode_video(samples.video(frames=12), limits(deadline_s=-1), RULE)


def test_only_the_sampled_frames_are_converted() -> None:
    seen: list[tuple[int, int]] = []
    clip = video.decode_video(samples.video(frames=6), limits(), RULE, on_frame=lambda im: seen.append(im.size))
    assert seen == [(96, 64)] * 4
    assert clip.sampled_fps == pytest.approx(4 / 6 * 6)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize("frames", [12, 5, 1])
def test_item_rows_equal_the_video_processors(family_models: Callable[[str], Path], family: str, frames: int) -> None:
    from transformers import AutoImageProcessor

    model = family_models(family)
    processor = AutoImageProcessor.from_pretrained(model)
    adapter = families.load(model, frozenset(processor.model_input_names))
    data = samples.video(frames=frames, width=120, height=90, seed=frames)
    clip = video.decode_video(data, limits(), dataclasses.replace(RULE, how=adapter.frame_sampling))
    rows = adapter.video_rows(processor, clip.frames, clip.sampled_fps)
    # As a worker makes them: with the image processor's shortcuts.
    fast = AutoImageProcessor.from_pretrained(model)
    assert pil_shortcuts.install(fast)
    with pil_shortcuts.processing():
        in_worker = adapter.video_rows(fast, clip.frames, clip.sampled_fps)
    assert sorted(in_worker) == sorted(rows)
    for name, value in rows.items():
        np.testing.assert_array_equal(in_worker[name], value, err_msg=name)
    expected = hf_family.video_inputs(model, data, fps=RULE.fps, max_frames=RULE.max_frames)
    if metadata := expected.pop("metadata", None):  # Qwen3-VL: the frames its processor samples
        assert clip.indices == metadata.frames_indices
    assert sorted(rows) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(rows[name], value.numpy().astype(rows[name].dtype), err_msg=name)
    shapes = {"pixel_values_videos": rows["pixel_values_videos"].shape}
    side = {n: v for n, v in rows.items() if n not in shapes}
    grid = rows["video_grid_thw"][0]
    assert adapter.count(families.VIDEO, shapes, side) == int(np.prod(grid)) // 4
