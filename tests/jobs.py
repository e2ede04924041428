"""Helpers for tests that run ``jobs/pretrain.py`` as a user would, through a local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshtrain.observe.run_folder import ReadRecord, read_records

REPO = Path(__file__).resolve().parents[1]


def job_command(*args: str) -> list[str]:
    return [sys.executable, "jobs/pretrain.py", *args]


def job_env(*, own_ray: bool = False, **extra: str) -> dict[str, str]:
    """This process's environment for a job, without what would point it at another cluster or change
    how Ray Train behaves (a RAY_TRAIN_* setting some test left behind). The job joins the session's
    shared Ray head (tests/raynodes.py) unless ``own_ray``: a job that sizes its Ray or must be the one
    that started it gets a local Ray of its own, started by its driver."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_TRAIN_")}
    if not own_ray:
        from raynodes import SharedHead

        env.update(SharedHead.join())
    env.update(extra)
    return env


def run_job(*args: str, timeout: float = 300, own_ray: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        job_command(*args), cwd=REPO, env=job_env(own_ray=own_ray, **env), capture_output=True, text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[ReadRecord]:
    """The run's records, as every reader parses them (meshtrain.observe.run_folder.read_records)."""
    return read_records(run_dir / "metrics.jsonl")


def model_weights(checkpoint: Path | str, scratch: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, consolidated in this process."""
    out = scratch / f"weights-{abs(hash(str(checkpoint)))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)["train"]["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
