"""One downstream evaluation of one committed checkpoint: load it once, run the harness and continue
the fixed prompts with it, keep the results in the run."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.config.evaluation import TextSamplesConfig
from meshtrain.evaluate.generation import check_settings, continue_prompts
from meshtrain.evaluate.harness import (
    RESULTS_FILE,
    HarnessRun,
    downstream_records,
    run_harness,
    save_results,
    task_manager,
)
from meshtrain.evaluate.hf_model import load_checkpoint_model
from meshtrain.observe.run_folder import DownstreamEvalRecord, TextSamplesRecord

DOWNSTREAM_DIR = "downstream"
SAMPLES_FILE = "text_samples.jsonl"
__all__ = ["DOWNSTREAM_DIR", "RESULTS_FILE", "SAMPLES_FILE", "CheckpointEvaluation", "SampleRun", "default_run_dir",
           "evaluate_checkpoint", "results_folder"]


@dataclass(frozen=True)
class SampleRun:
    """Fixed prompts to continue with each scored checkpoint (``eval.samples``)."""

    prompts: tuple[str, ...]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, config: TextSamplesConfig) -> SampleRun | None:
        if not config.prompts:
            return None
        return cls(tuple(config.prompts), config.max_new_tokens, config.temperature, config.top_p, config.seed)


@dataclass(frozen=True)
class CheckpointEvaluation:
    step: int
    records: list[DownstreamEvalRecord | TextSamplesRecord]  # a downstream_eval record per task, and the text_samples record
    folder: Path  # the harness's results JSON and samples, the text samples
    seconds: float


def results_folder(run_dir: Path, step: int) -> Path:
    """Where a run keeps what the evaluation of the checkpoint of ``step`` found."""
    return run_dir / DOWNSTREAM_DIR / f"step-{step:08d}"


def default_run_dir(checkpoint: str) -> Path | None:
    """The run folder of a local ``{run}/checkpoints/step-N`` checkpoint, else None."""
    path = Path(checkpoint)
    if "://" in checkpoint or path.parent.name != "checkpoints":
        return None
    return path.parent.parent


def evaluate_checkpoint(
    checkpoint: str,
    harness: HarnessRun | None,
    results_in: Callable[[int], Path],
    storage_options: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    samples: SampleRun | None = None,
    average: int | None = None,
) -> CheckpointEvaluation:
    """``harness``'s tasks on ``checkpoint``'s model (its results JSON and samples go to
    ``results_in(step)``, a run's: ``results_folder``), and ``samples``' prompts continued (into
    ``text_samples.jsonl`` there). Task names and sample settings are checked before the model is
    read (ConfigError, one line). ``average``: score the mean of the newest ``average`` committed
    checkpoints under ``checkpoint`` (a checkpoint root) instead."""
    started = time.perf_counter()
    manager = task_manager(harness) if harness is not None else None
    if samples is not None:
        check_settings(samples.max_new_tokens, samples.temperature, samples.top_p)
    loaded = load_checkpoint_model(checkpoint, storage_options, dtype, average)
    loaded.model.to(device)  # the harness and generate run the model where it lies
    folder = results_in(loaded.step)
    records: list[DownstreamEvalRecord | TextSamplesRecord] = []
    if harness is not None:
        results = run_harness(loaded, harness, manager)
        save_results(results, folder)
        records += downstream_records(results, loaded.step, time.perf_counter() - started)
    if samples is not None:
        sampling = time.perf_counter()
        rows = continue_prompts(loaded, samples.prompts, samples.max_new_tokens, temperature=samples.temperature,
                                top_p=samples.top_p, seed=samples.seed)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{SAMPLES_FILE}.partial"
        partial.write_text("".join(json.dumps({"step": loaded.step, **row}) + "\n" for row in rows), encoding="utf-8")
        partial.replace(folder / SAMPLES_FILE)
        records.append(TextSamplesRecord(step=loaded.step, samples=rows, seconds=time.perf_counter() - sampling,
                                         time=time.time()))
    return CheckpointEvaluation(loaded.step, records, folder, time.perf_counter() - started)
