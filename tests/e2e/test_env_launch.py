"""`--launch env`: ranks started separately (as on several pods) meet through
torch's env:// rendezvous; rank 0 serves gRPC, and SIGTERM stops both."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from mmsplit.common.v1 import common_pb2
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit_cli.launch import ServiceProcess
from mmsplit_server.serving import free_port
from scheduler_svc.model import model_info
from tests.conftest import SCHEDULER_SERVICE
from tests.support.local_token import scheduler_channel

pytestmark = pytest.mark.e2e


def test_two_ranks_started_separately_serve_and_stop(tiny_model: Path, tmp_path: Path) -> None:
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    args = ["scheduler", "--model", str(tiny_model), "--launch", "env", "--port", "0"]
    rank0 = ServiceProcess("rank0", args, tmp_path / "rank0.log", env={**rendezvous, "RANK": "0"})
    rank1 = ServiceProcess("rank1", args, tmp_path / "rank1.log", env={**rendezvous, "RANK": "1"})
    try:
        rank0.wait_serving(SCHEDULER_SERVICE, 180)
        info = model_info(tiny_model)
        pixels = np.random.default_rng(0).random(info.image_shape, dtype=np.float32)
        ref = common_pb2.TensorRef(dtype=common_pb2.DTYPE_FLOAT32, shape=info.image_shape, inline=pixels.tobytes())
        request = scheduler_pb2.GenerateRequest(
            request_id="env-launch-1",
            input_ids=[1, *[info.image_token_id] * info.tokens_per_image, 22557],
            pixel_values=[ref],
            sampling=common_pb2.SamplingParams(max_tokens=4),
        )
        with scheduler_channel(rank0.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            assert stub.GetServerInfo(scheduler_pb2.GetServerInfoRequest(), timeout=5).info.tp_size == 2
            events = list(stub.Generate(request, timeout=60))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "accepted"
        assert kinds[-1] == "finished"
        assert events[-1].finished.completion_tokens == 4
    finally:
        code0 = rank0.stop()
        try:
            code1 = rank1.proc.wait(30)
        except subprocess.TimeoutExpired:
            code1 = rank1.stop()
    assert (code0, code1) == (0, 0), rank0.tail() + rank1.tail()
