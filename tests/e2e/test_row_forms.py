"""A tokenizer sends an image's rows of one frame only to a scheduler that
takes them (ServerInfo.one_frame_image_rows): against a scheduler told not
to (`--one-frame-image-rows false`, as a scheduler from before them), the
tokenizer sends the rows of every frame and the answer is the one those
rows give; rows of one frame sent to it anyway are refused by name, and the
group goes on. (That a scheduler taking them gets them from the tokenizer,
and gives the same tokens, is in tests/e2e/test_families.py.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2_grpc
from mmsplit.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mmsplit_cli.client import make_request, run_request
from tests.e2e.helpers import (
    kept_of_one_image,
    kit_rows_bytes,
    png,
    rank_active_requests,
    scheduler_info,
    tokenizer_info,
)
from tests.support import family_kit, greedy
from tests.support.leaks import wait_until
from tests.support.local_token import scheduler_channel
from tests.support.services import Pair, running_pair
from tokenizer_svc.decode import decode_image

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def refusing_pair(family_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("logs-one-frame")
    with running_pair(
        family_models("qwen2-vl"), logs, tp=1, scheduler_extra=["--one-frame-image-rows", "false"]
    ) as pair:
        yield pair


def test_a_scheduler_that_does_not_take_one_frame_rows_gets_every_frame_s(refusing_pair: Pair) -> None:
    pair = refusing_pair
    kit = family_kit.kit(pair.model)
    assert not scheduler_info(pair.scheduler_address).one_frame_image_rows
    assert not tokenizer_info(pair.tokenizer_address).scheduler.one_frame_image_rows
    image = png(210, 140, 7)
    assert kept_of_one_image(pair, kit, image) == kit_rows_bytes(kit, image, one_frame=False)

    # Rows of one frame sent to it anyway: refused by name.
    one = kit.message("one", f"Describe {kit.marker}.", [decode_image(image, max_pixels=10**8)], 4, one_frame=True)
    with scheduler_channel(pair.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(one, timeout=60))
    error = RemoteError.from_rpc_error(refused.value)
    assert error.reason == "INVALID_REQUEST", error
    assert "--one-frame-image-rows" in str(error), error
    # What the tokenizer sends it answers as the model does (every frame's rows).
    asks = [["USER: ", ("image", png(120, 200, 1)), " and ", ("image", image), "? ASSISTANT:"]]
    greedy.equal_to_the_model("qwen2-vl", pair, asks, max_tokens=4)
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0], timeout=10)


@pytest.fixture(scope="module")
def bfloat16_pair(family_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("logs-bfloat16")
    with running_pair(family_models("llava"), logs, tp=1, scheduler_extra=["--dtype", "bfloat16"]) as pair:
        yield pair


def test_a_bfloat16_model_gets_its_pixels_in_bfloat16_with_the_tokens_of_float32_ones(bfloat16_pair: Pair) -> None:
    pair = bfloat16_pair
    kit = family_kit.kit(pair.model)
    assert scheduler_info(pair.scheduler_address).encoder_input_dtype == common_pb2.DTYPE_BFLOAT16
    image = png(200, 150, 8)
    float32_bytes = kit_rows_bytes(kit, image, one_frame=False)
    assert kept_of_one_image(pair, kit, image) == float32_bytes // 2
    prompt = f"USER: {kit.marker}\nWhat is it? ASSISTANT:"
    direct = kit.message("float32", prompt, [decode_image(image, max_pixels=10**8)], 6)
    assert direct.items[0].tensors["pixel_values"].dtype == common_pb2.DTYPE_FLOAT32
    direct.sampling.min_tokens = 6
    with scheduler_channel(pair.scheduler_address) as channel:
        events = list(scheduler_pb2_grpc.SchedulerServiceStub(channel).Generate(direct, timeout=60))
    expected = [t for e in events if e.HasField("tokens") for t in e.tokens.token_ids]
    assert len(expected) == 6, events[-1]
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        answer = run_request(stub, make_request(prompt, [image], max_tokens=6, min_tokens=6), timeout=120)
    assert answer.ok, answer
    assert answer.token_ids == expected
    # Tokenize preprocesses a new image in the backend's form too: the request that follows takes it from the cache.
    fresh = make_request(prompt, [png(180, 120, 9)], max_tokens=2)
    before = tokenizer_info(pair.tokenizer_address).info
    with grpc.insecure_channel(pair.tokenizer_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=fresh), timeout=60)
        assert run_request(stub, fresh, timeout=120).ok
    after = tokenizer_info(pair.tokenizer_address).info
    assert after.preprocess_cache_misses - before.preprocess_cache_misses == 1
    assert after.preprocess_cache_hits - before.preprocess_cache_hits == 1
    assert wait_until(lambda: rank_active_requests(pair.scheduler_address) == [0], timeout=10)


def test_a_bfloat16_qwen_model_gets_one_frame_rows_in_bfloat16_and_its_videos_too(
    family_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Both forms at once (Qwen2-VL in bfloat16): an image kept at a quarter
    of the float32 rows of both frames, a video's rows (two frames a patch
    whatever the scheduler) in bfloat16, and a request with both answered."""
    from mmsplit_cli import samples
    from mmsplit_server import families

    logs = tmp_path_factory.mktemp("logs-qwen-bfloat16")
    model = family_models("qwen2-vl")
    with running_pair(model, logs, tp=1, scheduler_extra=["--dtype", "bfloat16"]) as pair:
        kit = family_kit.kit(model)
        image = png(210, 140, 10)
        whole, grid = kit_rows_bytes(kit, image, one_frame=False), 3 * 8
        assert kept_of_one_image(pair, kit, image) == (whole - grid) // 4 + grid  # the grid's int64s as they are
        marker = "<|vision_start|><|video_pad|><|vision_end|>"
        request = make_request(f"{marker} Same?", [], videos=[samples.video(frames=8, seed=3)], max_tokens=3)
        before = tokenizer_info(pair.tokenizer_address).info.preprocess_cache_bytes
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            answer = run_request(stub, request, timeout=120)
            ids = stub.Tokenize(tokenizer_pb2.TokenizeRequest(request=request), timeout=60).token_ids
        assert answer.ok, answer
        kept = tokenizer_info(pair.tokenizer_address).info.preprocess_cache_bytes - before
        # Its rows: a placeholder per merge x merge patches, each row_width values of 2 bytes; and its grid.
        pads = list(ids).count(kit.family.placeholders[families.VIDEO].token_id)
        assert pads > 0
        assert kept == pads * kit.family.merge**2 * kit.family.row_width() * 2 + grid
