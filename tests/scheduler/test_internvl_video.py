"""InternVL's video: its frames are image placeholders (one token for both
modalities), a line ``FrameN: <img>...</img>`` each, so the prompt's runs
are assigned in the order of the markers, not per token; the scheduler
admits a video of one run a frame, each of one tile's placeholders, and
refuses any other split, as it refuses an image cut in two."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError
from mmsplit.scheduler.v1 import scheduler_pb2
from mmsplit_cli import samples
from mmsplit_server import families
from tests.support import family_kit
from tokenizer_svc import video
from tokenizer_svc.prompt import Media

RULE = video.Sampling(fps=2.0, min_frames=4, max_frames=32, temporal_patch_size=1, how="centered")


def _request(model_dir: Path) -> tuple[scheduler_pb2.GenerateRequest, int, int]:
    """An image, a video and an image, in that order in the prompt (the
    video sent last, as requests list them); with the video's frame count
    and one tile's placeholders."""
    kit = family_kit.kit(model_dir)
    family = kit.family
    (wide, n_wide), (tall, n_tall) = kit.items(
        [Image.new("RGB", (200, 90), "red"), Image.new("RGB", (90, 200), "blue")]
    )
    limits = video.VideoLimits(max_pixels=10**7, max_duration_s=60, max_frames=1000, deadline=float("inf"))
    clip = video.decode_video(samples.video(frames=12, seed=1), limits, RULE)
    clip_rows = family.video_rows(kit.image_processor, clip.frames, clip.sampled_fps)
    n_clip = family.count(families.VIDEO, {"pixel_values": clip_rows["pixel_values"].shape}, {})
    prompt = kit.prompts.build(
        f"{kit.marker} then <video> then {kit.marker}: what changed?",
        [Media(families.IMAGE, n_wide), Media(families.IMAGE, n_tall), Media(families.VIDEO, n_clip)],
    )
    items = [
        common_pb2.MultimodalItem(
            modality=modality,
            tensors={name: family_kit.inline(array) for name, array in rows.items()},
            placeholders=[common_pb2.PlaceholderRange(offset=o, length=n) for o, n in runs],
        )
        for (modality, rows), runs in sorted(
            zip(
                [(families.IMAGE, wide), (families.IMAGE, tall), (families.VIDEO, clip_rows)], prompt.runs, strict=True
            ),
            key=lambda pair: pair[1][0][0],
        )
    ]
    message = scheduler_pb2.GenerateRequest(
        request_id="r", input_ids=prompt.input_ids, items=items, sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    return message, len(clip.frames), family.tokens_per_tile()  # type: ignore[attr-defined]


def test_the_runs_follow_the_markers_and_a_video_is_a_run_a_frame(family_models: Callable[[str], Path]) -> None:
    model_dir = family_models("internvl")
    message, frames, per_tile = _request(model_dir)
    assert [item.modality for item in message.items] == [
        common_pb2.MODALITY_IMAGE,
        common_pb2.MODALITY_VIDEO,
        common_pb2.MODALITY_IMAGE,
    ]
    image, clip, other = ([(r.offset, r.length) for r in item.placeholders] for item in message.items)
    assert len(image) == len(other) == 1
    assert [length for _, length in clip] == [per_tile] * frames == [per_tile] * 4
    assert image[0][0] < clip[0][0]
    assert clip[-1][0] < other[0][0]
    # Each frame's line, as InternVLProcessor writes it.
    tokenizer = family_kit.kit(model_dir).tokenizer
    for k, (offset, length) in enumerate(clip):
        before = tokenizer.decode(message.input_ids[max(0, offset - 8) : offset])
        assert before.endswith(f"Frame{k + 1}: <img>"), before
        assert tokenizer.decode(message.input_ids[offset + length : offset + length + 1]) == "</img>"
    assert family_kit.admit(model_dir, message).request_id == "r"


@pytest.mark.parametrize("change", ["a frame cut in two", "image cut in two", "frames as the image's"])
def test_any_other_split_is_refused(family_models: Callable[[str], Path], change: str) -> None:
    model_dir = family_models("internvl")
    message, _, per_tile = _request(model_dir)
    image, clip = message.items[0], message.items[1]
    if change == "a frame cut in two":
        first = clip.placeholders[0]
        half = first.length // 2
        runs = [(first.offset, half), (first.offset + half, first.length - half)]
        runs += [(r.offset, r.length) for r in clip.placeholders[1:]]
        del clip.placeholders[:]
        for offset, length in runs:
            clip.placeholders.add(offset=offset, length=length)
        expected = f"each frame of a video fills a run of {per_tile} placeholders"
    elif change == "image cut in two":
        run = image.placeholders[0]
        del image.placeholders[:]
        image.placeholders.add(offset=run.offset, length=1)
        image.placeholders.add(offset=run.offset + 1, length=run.length - 1)
        expected = "an image of internvl fills one placeholder run, not 2"
    else:
        # A video's rows sent as an image: its runs are a frame's each.
        clip.modality = common_pb2.MODALITY_IMAGE
        expected = "an image of internvl fills one placeholder run, not 4"
    with pytest.raises(MmsplitError) as refused:
        family_kit.admit(model_dir, message)
    assert refused.value.error_code == E.ERROR_CODE_INVALID_REQUEST
    assert expected in refused.value.message, refused.value.message
