"""How the services' processes start (README, *Start-up*): on CPU a local
group's ranks 1..N-1 are forks of rank 0, which import nothing."""

from __future__ import annotations

import dataclasses
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
