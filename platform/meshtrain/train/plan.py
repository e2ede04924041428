"""What a launch resolves once, on the driver after preflight, and ships to every worker.

The driver builds it from the checked config (``cluster.worker_plan``); below the driver nothing sees
the whole config: the worker, the trainer and the loop's parts read the sections they need from here,
and the values derived from several sections (the model's shape, the LR horizon, the group sizes the
run may train on, the replica groups) are computed once, in the builder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.checkpoint.start_point import StartPoint
from meshtrain.config.data import DataConfig
from meshtrain.config.evaluation import EvalConfig
from meshtrain.config.fault_tolerance import FaultToleranceConfig
from meshtrain.config.model import ModelArgs, ModelConfig
from meshtrain.config.observability import MemoryConfig, MetricsConfig, ProfileConfig
from meshtrain.config.parallelism import ParallelConfig, ScalingConfig
from meshtrain.config.run import CheckpointConfig, FaultConfig, RunConfig
from meshtrain.config.training import OptimConfig, TrainConfig
from meshtrain.data import DataPlan, TrainingData
from meshtrain.data.stages import DataStage
from meshtrain.observe.run_folder import RunPaths


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    """The resolved run. The mesh is not in it: each worker group resolves its mesh from where Ray placed
    its workers and how many it started (an elastic group may be smaller)."""

    model: ModelArgs  # the model's shape, read once (model.init_from's config.json is not read again per worker)
    data: DataPlan | TrainingData  # the token stores and tokenizer (resumed runs keep their checkpoints' sampling)
    horizon: int  # the LR schedule's steps: optim.schedule_steps, else the first launch's train.steps
    group_sizes: tuple[int, ...]  # the worker-group sizes the run trains on (more than one when elastic)
    replica_groups: int | None  # fault_tolerance.mode=replica: the model copies the workers form
    settings: Mapping[str, Any]  # the resolved config as JSON, as the checkpoints' manifest keeps it
    launch_id: str = ""
    data_stages: tuple[DataStage, ...] = ()  # data.stages at their first samples, weights in the sources' order
    lr_decay_start: int | None = None  # optim.decay_from_stage: the step the wsd decay starts at
    lr_stages: tuple[tuple[int | None, float | None], ...] = ()  # optim.schedule=staged: stage ends, decay ratios
    start_from: StartPoint | None = None  # checkpoint.start_from, resolved: loaded on the run's first start
    pipeline_split: tuple[int, ...] = ()  # parallel.pipeline > 1: each stage's layers (given, or balanced)
    # The config's sections, as the driver checked them.
    model_config: ModelConfig
    data_config: DataConfig
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    parallel: ParallelConfig
    scaling: ScalingConfig
    run: RunConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    fault_tolerance: FaultToleranceConfig
    fault: FaultConfig
    profile: ProfileConfig
    memory: MemoryConfig

    @property
    def paths(self) -> RunPaths:
        return RunPaths.of(self.run)
