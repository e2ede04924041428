"""One worker's trainer in the test's own process, on the CPU, built as ``meshtrain.train.trainer.train``
builds it, for tests that reach into it (its model, its progress) or run it in steps of their own; and
one rank's sharded model built from a test's config, as the trainer builds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshtrain.checkpoint.start_point import StartPoint
from meshtrain.cluster.worker_plan import worker_plan
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import RankLayout, WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.llama import Transformer
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.train.records import LoopOutputs
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.trainer import RankContext, Trainer, open_training_data


def cpu_trainer(cfg: MeshtrainConfig, corpus: DataPlan, on_record: Callable[[Any], None] | None = None,
                metrics: TrainingMetrics | None = None, start_from: StartPoint | None = None, **context: Any) -> Trainer:
    """``start_from``: checkpoint.start_from as the driver resolved it. ``context``: the rest of
    :class:`RankContext` (``replica``, ``stop_request``)."""
    plan = worker_plan(cfg, corpus, start_from=start_from)
    data = open_training_data(plan)
    rank = RankContext(WorkerLayout(), torch.device("cpu"), LoopOutputs(on_record, metrics), **context)
    return Trainer(plan, data, rank)


def sharded_model(cfg: MeshtrainConfig, vocab_size: int, worker: WorkerLayout, device: torch.device,
                  document_eos: int | None = None) -> tuple[Transformer, RankLayout]:
    """``cfg``'s model for a tokenizer of ``vocab_size`` tokens, sharded on ``worker``'s mesh and initialized
    (or read from model.init_from)."""
    return build_sharded_model(model_args(cfg.model, vocab_size), cfg.parallel, worker, device, cfg.train.seed,
                               cfg.scaling.workers_per_node, cfg.model.init_from, document_eos)
