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

from mmsplit.errors import RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2_grpc
from tests.e2e.helpers import png, rank_active_requests, scheduler_info, tokenizer_info
from tests.e2e.test_families import kept_of_one_image, kit_rows_bytes
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
