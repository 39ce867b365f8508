"""A request's own pixel budget for its images (GenerateRequest.image_budget,
the OpenAI API's `mm_processor_kwargs`): the checkpoint's budget read as
transformers reads it, a request's checked against it (each refusal names
its field), and the budget making the rows the processor makes with that
`size`; InternVL's bounds on an image's tiles likewise (its
`min_patches`, `max_patches`; vLLM's `max_dynamic_patch`,
`min_dynamic_patch`). Through the services: tests/e2e/test_http_api.py,
tests/e2e/test_families.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmsplit.client import build_request
from mmsplit.tokenizer.v1 import tokenizer_pb2 as pb
from mmsplit_server.families import PixelBudget, TileBudget
from tests.e2e.helpers import png
from tests.support import family_kit
from tokenizer_svc import conversation, openai_api, openai_responses
from tokenizer_svc.decode import decode_image
from tokenizer_svc.errors import InvalidRequest
from tokenizer_svc.settings import TokenizerSettings

QWEN = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")


@pytest.mark.parametrize("name", QWEN)
def test_the_checkpoint_s_budget_is_the_one_its_processor_uses(family_models: Callable[[str], Path], name: str) -> None:
    """As the checkpoint's processor holds it, and for the other ways a
    preprocessor_config.json says it (the top-level min_pixels and
    max_pixels over `size`, nothing at all: the class's own), as
    transformers' processor class reads each."""
    kit = family_kit.kit(family_models(name))
    own = kit.image_processor.size
    assert kit.family.image_pixels == PixelBudget(own.shortest_edge, own.longest_edge)
    assert kit.family.least_image_pixels == (kit.image_processor.patch_size * kit.image_processor.merge_size) ** 2
    cls = type(kit.image_processor)
    for config in (
        {"size": {"shortest_edge": 1000, "longest_edge": 90000}, "min_pixels": 2000, "max_pixels": 80000},
        {"size": {"shortest_edge": 1000, "longest_edge": 90000}, "max_pixels": 80000},
        {},
    ):
        family = dataclasses.replace(kit.family, image_config=config)
        made = cls(**config).size
        assert family.image_pixels == PixelBudget(made.shortest_edge, made.longest_edge), config


@pytest.mark.parametrize("name", QWEN)
def test_a_budget_makes_the_rows_the_processor_makes_with_that_size(
    family_models: Callable[[str], Path], name: str
) -> None:
    kit = family_kit.kit(family_models(name))
    image = decode_image(png(300, 420, 5), max_pixels=10**8)
    budget = PixelBudget(kit.family.least_image_pixels, 6 * kit.family.least_image_pixels)
    options = kit.family.image_options(one_frame=False, pixels=budget)
    ours = kit.image_processor(images=image, return_tensors="np", **options)
    size = {"shortest_edge": budget.least, "longest_edge": budget.most}
    theirs = kit.image_processor(images=image, return_tensors="np", size=size)
    assert np.array_equal(ours["pixel_values"], theirs["pixel_values"])
    assert np.array_equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert int(np.prod(ours["image_grid_thw"])) <= 6 * kit.image_processor.merge_size**2  # within the budget
    assert "size" not in kit.family.image_options(one_frame=False)  # none asked: the checkpoint's


@pytest.fixture(scope="module")
def parse(family_models: Callable[[str], Path]) -> Callable[[str, dict[str, int]], conversation.Parsed]:
    kits = {name: family_kit.kit(family_models(name)) for name in ("qwen2-vl", "llava", "internvl")}

    def parse(name: str, budget: dict[str, int]) -> conversation.Parsed:
        kit = kits[name]
        request = pb.GenerateRequest(prompt="Hi", image_budget=pb.ImageBudget(**budget))
        return conversation.parse(request, TokenizerSettings(model_dir=kit.model_dir), kit.family)

    return parse


def test_a_request_s_budget_is_checked_against_the_checkpoint_s(
    parse: Callable[[str, dict[str, Any]], conversation.Parsed], family_models: Callable[[str], Path]
) -> None:
    own = family_kit.kit(family_models("qwen2-vl")).family.image_pixels
    assert own is not None
    patch = 28 * 28
    assert parse("qwen2-vl", {"max_pixels": 10 * patch}).image_pixels == PixelBudget(own.least, 10 * patch)
    # A max under the checkpoint's min takes the min down with it, rather than refusing the request.
    assert parse("qwen2-vl", {"max_pixels": patch}).image_pixels == PixelBudget(patch, patch)
    assert parse("qwen2-vl", {"min_pixels": 2 * patch}).image_pixels == PixelBudget(2 * patch, own.most)
    # Exactly the checkpoint's, or nothing asked: no budget of its own (the same cache entries).
    assert parse("qwen2-vl", {"min_pixels": own.least, "max_pixels": own.most}).image_pixels is None
    assert parse("qwen2-vl", {}).image_pixels is None
    assert parse("llava", {}).image_pixels is None
    for name, budget, param, words in (
        ("qwen2-vl", {"max_pixels": own.most + 1}, "image_budget.max_pixels", "over this model's image budget"),
        ("qwen2-vl", {"max_pixels": patch - 1}, "image_budget.max_pixels", "under one merged patch"),
        ("qwen2-vl", {"min_pixels": 3 * patch, "max_pixels": 2 * patch}, "image_budget.min_pixels", "over max"),
        ("llava", {"max_pixels": 5000}, "image_budget", "one size"),
    ):
        with pytest.raises(InvalidRequest, match=words) as refused:
            parse(name, budget)
        assert refused.value.metadata["param"] == param
        assert openai_api.param_name(refused.value) == param.replace("image_budget", "mm_processor_kwargs")


def test_internvl_s_tiles_are_its_processor_s_and_a_request_s_bound_them(
    parse: Callable[[str, dict[str, Any]], conversation.Parsed], family_models: Callable[[str], Path]
) -> None:
    kit = family_kit.kit(family_models("internvl"))
    own = kit.family.image_tiles
    assert own == TileBudget(kit.image_processor.min_patches, kit.image_processor.max_patches) == TileBudget(1, 4)
    assert family_kit.kit(family_models("qwen2-vl")).family.image_tiles is None
    # The rows: what the processor makes with those min_patches and max_patches.
    image = decode_image(png(300, 120, 5), max_pixels=10**8)
    for tiles in (TileBudget(1, 1), TileBudget(1, 2), TileBudget(3, 4), None):
        options = kit.family.image_options(one_frame=False, tiles=tiles)
        ours = kit.image_processor(images=image, return_tensors="np", **options)
        bounds = {} if tiles is None else {"min_patches": tiles.least, "max_patches": tiles.most}
        theirs = kit.image_processor(images=image, return_tensors="np", crop_to_patches=True, **bounds)
        assert np.array_equal(ours["pixel_values"], theirs["pixel_values"]), tiles
        most = (tiles or own).most
        # Tiles within the bound, a thumbnail beside several.
        assert ours["pixel_values"].shape[0] in {1, *range(2 + 1, most + 2)}, (tiles, ours["pixel_values"].shape)
    assert parse("internvl", {"max_tiles": 2}).image_tiles == TileBudget(1, 2)
    assert parse("internvl", {"min_tiles": 2}).image_tiles == TileBudget(2, 4)
    assert parse("internvl", {"min_tiles": 1, "max_tiles": 4}).image_tiles is None  # the checkpoint's own
    assert parse("internvl", {}).image_tiles is None
    assert parse("qwen2-vl", {"max_pixels": 28 * 28 * 10}).image_tiles is None
    for name, budget, param, words in (
        ("internvl", {"max_tiles": 5}, "image_budget.max_tiles", "over this model's 4"),
        ("internvl", {"min_tiles": 3, "max_tiles": 2}, "image_budget.min_tiles", "over max_tiles 2"),
        ("internvl", {"max_pixels": 5000}, "image_budget", "bound its tiles instead"),
        ("qwen2-vl", {"max_tiles": 2}, "image_budget.max_tiles", "does not cut images into tiles"),
        ("llava", {"min_tiles": 2}, "image_budget.min_tiles", "does not cut images into tiles"),
    ):
        with pytest.raises(InvalidRequest, match=words) as refused:
            parse(name, budget)
        assert refused.value.metadata["param"] == param
    # The client library's words for them.
    budget = build_request("x", max_tiles=2, min_tiles=1).image_budget
    assert (budget.min_tiles, budget.max_tiles, budget.max_pixels) == (1, 2, 0)
    assert not build_request("x").HasField("image_budget")
    names = {"image_budget.max_tiles": "max_dynamic_patch", "image_budget.min_tiles": "min_dynamic_patch"}
    for param, kwarg in names.items():
        refused = InvalidRequest("x", metadata={"param": param})
        assert openai_api.param_name(refused) == f"mm_processor_kwargs.{kwarg}"


def test_mm_processor_kwargs_become_the_image_budget_and_the_video_budget() -> None:
    user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
    kwargs = {"mm_processor_kwargs": {"max_pixels": 5000, "min_pixels": 1000}}
    for request in (
        openai_api.parse_chat({"messages": [user], **kwargs}).request,
        openai_api.parse_completion({"prompt": "x", **kwargs}).request,
        openai_api.parse_tokenize({"messages": [user], **kwargs}).request,
        openai_api.parse_tokenize({"prompt": "x", **kwargs}).request,
    ):
        assert request is not None
        assert (request.image_budget.min_pixels, request.image_budget.max_pixels) == (1000, 5000)
    assert not openai_api.parse_chat({"messages": [user], "mm_processor_kwargs": {}}).request.HasField("image_budget")
    # The Responses API passes it on as chat completions takes it.
    chat, _ = openai_responses.to_chat({"input": "x", **kwargs})
    budget = openai_api.parse_chat(chat).request.image_budget
    assert (budget.min_pixels, budget.max_pixels) == (1000, 5000)
    video = {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}]}
    for body, param in (
        ({"mm_processor_kwargs": [1]}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": {"max_pixels": 0}}, "mm_processor_kwargs.max_pixels"),
        ({"mm_processor_kwargs": {"max_pixels": True}}, "mm_processor_kwargs.max_pixels"),
        ({"mm_processor_kwargs": {"min_pixels": 1 << 32}}, "mm_processor_kwargs.min_pixels"),
        ({"mm_processor_kwargs": {"fps": 0}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": 60.5}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"fps": float("nan")}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"max_frames": 2.5}}, "mm_processor_kwargs.max_frames"),
        ({"mm_processor_kwargs": {"do_resize": False}}, "mm_processor_kwargs.do_resize"),
        ({"messages": [video], **kwargs}, "mm_processor_kwargs"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            openai_api.parse_chat({"messages": [user], **body})
        assert openai_api.param_name(refused.value) == param, body
    # fps and max_frames sample videos: with a video, without pixel bounds, they are its rule.
    rule = openai_api.parse_chat({"messages": [video], "mm_processor_kwargs": {"fps": 0.5, "max_frames": 6}}).request
    assert (rule.video_budget.fps, rule.video_budget.max_frames, rule.HasField("image_budget")) == (0.5, 6, False)
    assert not openai_api.parse_chat({"messages": [user], **kwargs}).request.HasField("video_budget")
    # vLLM's names for an InternVL image's tiles; with a video too (its frames are a tile each).
    tiles = {"mm_processor_kwargs": {"max_dynamic_patch": 6, "min_dynamic_patch": 2}}
    for messages in ([user], [video]):
        budget = openai_api.parse_chat({"messages": messages, **tiles}).request.image_budget
        assert (budget.min_tiles, budget.max_tiles, budget.max_pixels) == (2, 6, 0)
    for value in (0, 2.5, True, "6"):
        with pytest.raises(InvalidRequest) as refused:
            openai_api.parse_chat({"messages": [user], "mm_processor_kwargs": {"max_dynamic_patch": value}})
        assert openai_api.param_name(refused.value) == "mm_processor_kwargs.max_dynamic_patch", value


@pytest.mark.parametrize("name", QWEN)
def test_an_image_over_its_scheduler_s_cap_is_refused_from_its_header(
    family_models: Callable[[str], Path], name: str
) -> None:
    """The worker's check counts the rows the processor will make from the
    size alone, exactly (every form, with and without a budget, a 50:1
    strip included), lets the image through at the cap, and just past it
    refuses MEDIA_TOO_LARGE naming the largest max_pixels whose rows fit
    (the processor's rows under it fit; a pixel more would not)."""
    from mmsplit_server.handoff import reference
    from tokenizer_svc.errors import MediaTooLarge
    from tokenizer_svc.preprocess import ImageJob, RowForm, _rows_check

    kit = family_kit.kit(family_models(name))
    family, processor = kit.family, kit.image_processor
    own = family.image_pixels
    assert own is not None
    small = PixelBudget(family.least_image_pixels, 9 * family.least_image_pixels)

    def rows_of(image: Any, form: RowForm, pixels: PixelBudget | None) -> tuple[int, int]:
        options = family.image_options(one_frame=form.one_frame, pixels=pixels)
        rows = processor(images=image, return_tensors="np", **options)["pixel_values"]
        return rows.shape[0], rows.shape[0] * rows.shape[1] * reference.itemsize(form.dtype)

    for height, width in ((300, 420), (1080, 1920), (40, 2000)):
        image = decode_image(png(height, width, 3), max_pixels=10**8)
        for form in (RowForm(), RowForm(one_frame=True, dtype="bfloat16")):
            for pixels in (None, small):
                rows, nbytes = rows_of(image, form, pixels)
                assert family.image_rows(width, height, pixels or own) == rows
                fits = ImageJob(b"", 10**8, 200.0, "", 0, form=form, pixels=pixels, max_bytes=nbytes)
                check = _rows_check(fits, family)
                assert check is not None
                check(width, height)  # exactly at the cap: through
                over = _rows_check(dataclasses.replace(fits, max_bytes=nbytes - 1), family)
                assert over is not None
                with pytest.raises(MediaTooLarge, match=r"ask for at most [\d,]+ pixels an image") as refused:
                    over(width, height)
                most = int(str(refused.value).rsplit("at most ", 1)[1].split(" ")[0].replace(",", ""))
                least = (pixels or own).least
                assert rows_of(image, form, PixelBudget(min(least, most), most))[1] <= nbytes - 1
                assert rows_of(image, form, PixelBudget(min(least, most + 1), most + 1))[1] > nbytes - 1
