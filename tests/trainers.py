"""One worker's trainer in the test's own process, on the CPU, built as ``meshtrain.train.trainer.train``
builds it, for tests that reach into it (its model, its progress) or run it in steps of their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshtrain.config import MeshtrainConfig
from meshtrain.data import DataPlan, open_data
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.train.records import LoopOutputs
from meshtrain.train.trainer import RankContext, Trainer


def cpu_trainer(cfg: MeshtrainConfig, corpus: DataPlan, on_record: Callable[[Any], None] | None = None,
                metrics: TrainingMetrics | None = None, **context: Any) -> Trainer:
    """``context``: the rest of :class:`RankContext` (``replica``, ``stop_request``)."""
    data = open_data(corpus, cfg.data.seq_len, cfg.train.seed)
    rank = RankContext(WorkerLayout(), torch.device("cpu"), LoopOutputs(on_record, metrics), **context)
    return Trainer(cfg, model_args(cfg.model, data.vocab_size), data, rank)
