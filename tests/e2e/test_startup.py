"""How the services' processes start (README, *Start-up*): on CPU a local
group's ranks 1..N-1 are forks of rank 0, which import nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import psutil
import pytest

from scheduler_svc.group import forkable
from scheduler_svc.settings import SchedulerSettings
from tests.conftest import Services
from tests.e2e.helpers import rank_processes

pytestmark = pytest.mark.e2e


def test_local_ranks_are_forks_of_rank_0_on_cpu(services: Services) -> None:
    rank0 = psutil.Process(services.scheduler.pid)
    ranks = rank_processes(services.scheduler.pid)
    assert [r.name() for r in ranks] == ["mmsplit-rank1"]
    assert ranks[0].cmdline() == rank0.cmdline(), "rank 1 is a new interpreter, not a fork of rank 0"
    assert "(fork)" in services.scheduler.log_path.read_text()


def test_ranks_are_spawned_where_cuda_may_be_used() -> None:
    settings = SchedulerSettings(model_dir=Path("unused"))
    assert forkable(dataclasses.replace(settings, device="cpu"))
    assert not forkable(dataclasses.replace(settings, device="cuda"))


def test_forked_ranks_sum_the_model_s_partials_over_shared_memory(tiny_model: Path, tmp_path: Path) -> None:
    """A local CPU group sums the model's TP partials over shared memory
    (`--tp-all-reduce shm`, the default): rank 1 counts its sums when it
    stops. (That the tokens equal plain `generate`'s is every TP=2 engine
    test's; gloo's sums are the env-launched groups', tests/e2e/test_multipod.py.)"""
    import grpc

    from mmsplit_cli import samples
    from mmsplit_cli.client import make_request, run_request
    from tests.e2e.helpers import tokenizer_stub
    from tests.support.services import running_pair

    requests = [make_request(f"Describe {i}.", [samples.good_png(seed=i)], max_tokens=12) for i in range(3)]
    with running_pair(tiny_model, tmp_path) as pair:
        with grpc.insecure_channel(pair.tokenizer_address) as channel:
            outcomes = [run_request(tokenizer_stub(channel), r) for r in requests]
        assert all(o.ok and len(o.token_ids) == 12 for o in outcomes), outcomes
        pair.tokenizer.terminate()
        pair.scheduler.terminate()
        assert [pair.tokenizer.stop(), pair.scheduler.stop()] == [0, 0]
    log = pair.scheduler.log_path.read_text()
    assert "tensor-parallel sums go over shared memory" in log
    sums = re.search(r"rank 1 stopped after (\d+) sums over shared memory", log)
    assert sums is not None, log[-3000:]
    assert int(sums[1]) >= 3 * 12 * 2 * 2, log[-3000:]  # 2 layers x 2 sums per token
