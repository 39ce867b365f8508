"""The scheduler's start-up check of CUDA (`collective.cuda_problem`): a
group asked to run on CUDA where it cannot is one line before the group
forms and the model loads, not a ZeroDivisionError (no GPU: the rank's device was `rank %
device_count()`) or NCCL's refusal of two ranks on one GPU after the load."""

from __future__ import annotations

import pytest
import torch

from scheduler_svc.collective import cuda_problem


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_no_gpu_refuses_cuda_and_lets_auto_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    problem = cuda_problem("cuda", 1, local=True)
    assert problem.startswith("--device cuda: this process sees no CUDA device (CUDA_VISIBLE_DEVICES='';"), problem
    assert problem.endswith("give it a GPU, or use --device cpu"), problem
    assert cuda_problem("auto", 2, local=True) == ""
    assert cuda_problem("cpu", 2, local=True) == ""


def test_a_local_group_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 2)
    assert cuda_problem("cuda", 2, local=True) == ""
    assert cuda_problem("auto", 1, local=True) == ""
    assert cuda_problem("auto", 4, local=True) == (
        "--tp 4: a group on CUDA takes one GPU a rank (NCCL refuses two ranks on one GPU), and this process "
        "sees 2: use --tp 2 or fewer here, or --launch env with a GPU per pod"
    )
    # Under --launch env each rank is a process of its own, on its own pod's GPUs.
    assert cuda_problem("cuda", 4, local=False) == ""
