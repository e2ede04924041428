"""One downstream evaluation of one committed checkpoint: load, run the harness, keep the results."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.evaluate.harness import (
    RESULTS_FILE,
    HarnessRun,
    downstream_records,
    run_harness,
    save_results,
    task_manager,
)
from meshtrain.evaluate.hf_model import load_checkpoint_model

DOWNSTREAM_DIR = "downstream"
__all__ = ["DOWNSTREAM_DIR", "RESULTS_FILE", "CheckpointEvaluation", "default_run_dir", "evaluate_checkpoint",
           "results_folder"]


@dataclass(frozen=True)
class CheckpointEvaluation:
    step: int
    records: list[dict[str, Any]]  # one downstream_eval record per task
    results_path: Path  # the harness's results JSON
    seconds: float


def results_folder(run_dir: Path, step: int) -> Path:
    """Where a run keeps the harness's results of the checkpoint of ``step``."""
    return run_dir / DOWNSTREAM_DIR / f"step-{step:08d}"


def default_run_dir(checkpoint: str) -> Path | None:
    """The run folder of a local ``{run}/checkpoints/step-N`` checkpoint, else None."""
    path = Path(checkpoint)
    if "://" in checkpoint or path.parent.name != "checkpoints":
        return None
    return path.parent.parent


def evaluate_checkpoint(
    checkpoint: str,
    run: HarnessRun,
    results_in: Callable[[int], Path],
    storage_options: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> CheckpointEvaluation:
    """The harness on ``checkpoint``'s model; its results JSON and samples go to ``results_in(step)``
    (a run's: ``results_folder``). Task names are checked before the model is read (ConfigError, one line)."""
    started = time.perf_counter()
    manager = task_manager(run)
    loaded = load_checkpoint_model(checkpoint, storage_options, dtype)
    loaded.model.to(device)  # the harness runs the model where it lies
    results = run_harness(loaded, run, manager)
    seconds = time.perf_counter() - started
    path = save_results(results, results_in(loaded.step))
    return CheckpointEvaluation(loaded.step, downstream_records(results, loaded.step, seconds), path, seconds)
