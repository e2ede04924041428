"""Logged metrics for Ray Train (``ray.train.report``) and TensorBoard.

``ray.train.report`` is a barrier over every worker, and each worker's result queue holds one
report until Ray's controller polls it (every 2 s), so reporting every logged step of a fast model
would stall training. Reports are therefore spaced by time; rank 0's clock decides and the decision
is shared with one scalar all-reduce at logged steps (which synchronize anyway), so every worker
calls ``report`` at the same steps.

meshtrain's DCP checkpoints are never handed to Ray (``meshtrain.checkpoint.storage`` says why).
Ray 2.60 fills ``Result.metrics`` and ``Result.checkpoint`` only from a report that carries a
checkpoint, so the run ends with one such report: its checkpoint is a small folder holding
``meshtrain_result.json``, which names the run directory and the newest committed DCP checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain import ray_compat
from meshtrain.observe.run_folder import (
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    ReadRecord,
    TextSamplesRecord,
    TrainRecord,
)

REPORTED_TRAIN_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "skipped_steps")
RESULT_FILE = "meshtrain_result.json"


class RayTrainReporter:
    def __init__(self, interval_s: float, rank: int, device: torch.device) -> None:
        self.interval_s, self.rank, self.device = interval_s, rank, device
        # Ray Train logs every report of every worker at INFO, which the job log receives: keep its
        # warnings only (the metrics are in metrics.jsonl and the progress line already). Ray 2.60
        # names that logger after the module's file.
        logging.getLogger(ray_compat.train_context_logger()).setLevel(logging.WARNING)
        self._last_report = -math.inf
        self._eval: dict[str, Any] = {}

    def evaluated(self, record: EvalRecord) -> None:
        self._eval = {"eval_loss": record.loss, "eval_perplexity": record.perplexity, "eval_step": record.step}

    def logged(self, record: TrainRecord, last: bool) -> None:
        """Called by every worker at every logged step."""
        now = time.monotonic()
        due = torch.tensor(int(self.rank == 0 and (last or now - self._last_report >= self.interval_s)),
                           device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(due, op=dist.ReduceOp.MAX)
        if not due.item():
            return
        import ray.train

        ray.train.report({**{key: getattr(record, key) for key in REPORTED_TRAIN_KEYS}, **self._eval})
        self._last_report = now

    def final(self, metrics: dict[str, Any], pointer: dict[str, Any]) -> None:
        """Every worker, once training ended: report ``metrics`` with rank 0 handing Ray a checkpoint
        folder that holds only ``pointer`` (the run directory, the newest committed checkpoint), so
        Ray's ``Result.metrics`` and ``Result.checkpoint`` describe the run."""
        import ray.train

        folder = Path(tempfile.mkdtemp(prefix="meshtrain-result-")) if self.rank == 0 else None
        try:
            checkpoint = None
            if folder is not None:
                (folder / RESULT_FILE).write_text(json.dumps(pointer, indent=2) + "\n", encoding="utf-8")
                checkpoint = ray.train.Checkpoint.from_directory(str(folder))
            ray.train.report(metrics, checkpoint=checkpoint)  # Ray copies the folder into its run storage
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


class TensorBoardWriter:
    """Rank 0's records as TensorBoard scalars, under ``<run dir>/tensorboard``."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def record(self, record: ReadRecord) -> None:
        match record:
            case TrainRecord():
                for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "skipped_steps"):
                    self._writer.add_scalar(f"train/{key}", getattr(record, key), record.step)
            case EvalRecord():
                self._writer.add_scalar("eval/loss", record.loss, record.step)
                self._writer.add_scalar("eval/perplexity", record.perplexity, record.step)
            case TextSamplesRecord():
                for index, sample in enumerate(record.samples):
                    self._writer.add_text(f"samples/{index}", f"{sample['prompt']} ⟶ {sample['continuation']}", record.step)
            case DownstreamEvalRecord():
                for key, value in record.scores.items():
                    self._writer.add_scalar(f"downstream/{record.task}/{key}", value, record.step)
            case CheckpointSaveRecord():
                self._writer.add_scalar("checkpoint/blocking_s", record.blocking_s, record.step)
                self._writer.add_scalar("checkpoint/total_s", record.total_s, record.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
