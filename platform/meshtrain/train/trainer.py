"""One rank's run (the Ray worker and the tests both call it).

:class:`Trainer` sets up the sharded model, optimizer, data and checkpoints, then ``run`` is the
loop: each step lets the loop's parts (``train.parts``) act before it, fetches its micro-batches,
takes one guarded optimizer step, and hands the step to the parts after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.checkpoint.start_point import load_start_point
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.config import ConfigError
from meshtrain.data import DataParallelBatches, DataPlan, TrainingData, checkpoint_sampling, open_data
from meshtrain.data.skips import check_left_out, skips_of
from meshtrain.data.stages import left_out_now
from meshtrain.distributed.layout import RankLayout, WorkerLayout
from meshtrain.distributed.plan import rank_memory_plan
from meshtrain.distributed.replicas import ReplicaPlacement
from meshtrain.model.flops import AttentionWork
from meshtrain.model.llama import build_model, count_parameters
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.observe.run_folder import (
    LeftOutSamples, MetricsRecord, StartedFromRecord, StopRequest, StragglerRecord, read_left_out,
)
from meshtrain.observe.reporting import RayTrainReporter
from meshtrain.train.checkpointing import checkpoint_manager
from meshtrain.train.guard import BadStepLimit, RollbackRule, StepGuard, spike_rules
from meshtrain.train.loop import StepDone, StepStart
from meshtrain.train.optim import build_lr_scheduler, build_optimizer
from meshtrain.train.parts import loop_parts, memory_snapshots
from meshtrain.train.pipeline_step import PipelineSchedule
from meshtrain.train.plan import WorkerPlan
from meshtrain.train.profiling import region
from meshtrain.train.records import LoopOutputs, TrainResult
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.step import train_step

__all__ = ["RankContext", "TrainResult", "Trainer", "train"]


@dataclass(frozen=True)
class RankContext:
    """Where this rank trains, where its records go, and what it hears from the driver."""

    worker: WorkerLayout
    device: torch.device
    outputs: LoopOutputs = field(default_factory=LoopOutputs)
    replica: ReplicaPlacement | None = None  # fault_tolerance.mode=replica: this worker's group among the run's
    stop_request: StopRequest | None = None  # where the driver asks the ranks to save and stop


def check_sampling(manifest: dict[str, Any], reading: str, step: int) -> None:
    """A checkpoint resumes only under the sampling scheme it was trained with (the driver passes it on,
    ``cluster.launcher.data_for_resume``); a worker reading with another one refuses."""
    trained_with = checkpoint_sampling(manifest, f"the checkpoint of step {step}")
    if trained_with != reading:
        raise ConfigError(
            f"data: the checkpoint of step {step} was trained with sampling scheme {trained_with!r}, this worker "
            f"reads with {reading!r}; launch through meshtrain.cluster.launcher (it keeps the checkpoint's scheme) "
            "or choose another run.name"
        )


def rollbacks_left_out(plan: WorkerPlan) -> list[LeftOutSamples]:
    """The samples the run's rollbacks left out (none for a run without a name: a benchmark's, a test's)."""
    return read_left_out(plan.paths.left_out) if plan.run.name is not None else []


def open_training_data(plan: WorkerPlan) -> TrainingData:
    """The run's data as this worker reads it: in its stages, leaving out data.skip_samples and what the run's
    rollbacks left out (the run folder's left_out_samples.json, read at every start)."""
    if not isinstance(plan.data, DataPlan):
        return plan.data
    skips = skips_of(plan.data_config.skip_samples, rollbacks_left_out(plan))
    return open_data(plan.data, plan.data_config.seq_len, plan.train.seed, plan.data_stages, skips,
                     may_skip=plan.train.rollback_after_spikes is not None)


def train(
    plan: WorkerPlan,
    worker: WorkerLayout,
    device: torch.device,
    on_record: Callable[[MetricsRecord], None] | None = None,
    metrics: TrainingMetrics | None = None,
    reporter: RayTrainReporter | None = None,
    on_straggler: Callable[[StragglerRecord], None] | None = None,
    stop_request: StopRequest | None = None,
    replica: ReplicaPlacement | None = None,
) -> TrainResult:
    """Train until ``plan.train.steps``, resuming from the newest committed checkpoint if any.

    ``on_record`` receives every logged step, evaluation and checkpoint event (rank 0 emits the save
    events); ``metrics`` (when given) is updated every step; ``reporter`` (every rank, or none) hands
    logged steps to Ray Train; ``stop_request`` is where the driver asks the ranks to save and stop;
    ``replica`` (fault_tolerance.mode=replica) places this worker's group among the run's replica groups.
    """
    data = open_training_data(plan)
    outputs = LoopOutputs(on_record, metrics, reporter, on_straggler)
    trainer = Trainer(plan, data, RankContext(worker, device, outputs, replica, stop_request))
    try:
        return trainer.run()
    finally:
        trainer.close()


class Trainer:
    """One rank's run: setup here, then the loop in ``run``."""

    def __init__(self, plan: WorkerPlan, data: TrainingData, rank: RankContext) -> None:
        self.plan, self.rank, self.outputs = plan, rank, rank.outputs
        worker, device, replica = rank.worker, rank.device, rank.replica
        train, model = plan.train, plan.model
        torch.manual_seed(train.seed)
        self.memory = memory_snapshots(
            plan.memory, self, plan.run.run_dir,
            lambda: rank_memory_plan(model, self.layout.plan, plan.parallel, train, plan.data_config.longest_seq_len(),
                                     device.type == "cuda", plan.model_config.document_mask, self.layout.rank).total,
        )
        checkpoints = checkpoint_manager(plan.checkpoint, plan.run, worker, self.outputs.checkpoint_event)
        resuming = checkpoints is not None and plan.checkpoint.resume and checkpoints.any_committed()
        self.model, layout = build_sharded_model(
            model, plan.parallel, worker, device, train.seed, plan.scaling.workers_per_node,
            init_from=None if resuming else plan.model_config.init_from,
            document_eos=data.eos_id if plan.model_config.document_mask else None, pipeline_split=plan.pipeline_split,
        )
        # Every part of the loop asks this one layout which ranks it works with.
        self.layout: RankLayout = layout.with_control_group()
        layout, mesh = self.layout, self.layout.plan
        self.pipeline = None
        if self.model.stages:
            assert layout.pipeline_group is not None
            self.pipeline = PipelineSchedule(self.model.stages,
                                             plan.parallel.pipeline_schedule, plan.parallel.pipeline_stages,
                                             plan.parallel.microbatches, device, layout.pipeline_group,
                                             self.model.local_targets)
        self.attention_work = AttentionWork()  # the (query, key) pairs the steps attend, for MFU
        self.optimizer = build_optimizer(self.model, plan.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, plan.optim, plan.horizon, plan.lr_decay_start,
                                            plan.lr_stages)
        self.guard = StepGuard(self.optimizer, device, spike_rules(train))
        self.progress = Progress()
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.progress, layout.rank)
        # A replica group that replaces a lost one receives its state from a live peer, not from storage.
        joining = replica is not None and replica.joining
        if resuming and not joining:
            assert checkpoints is not None
            restored = checkpoints.restore(self.state, at_most=replica.resume_step if replica is not None else None)
            if restored is not None:
                check_sampling(restored.manifest, data.sampling, restored.step)
                check_left_out(restored.manifest, *left_out_now(data.train), restored.step)
                self.guard.load_history(restored.manifest.get("spike_history"))
        elif plan.start_from is not None and not resuming and not joining:
            load_s = load_start_point(self.model, self.optimizer, plan.start_from, plan.checkpoint.storage_options)
            self.outputs.emit(StartedFromRecord(**plan.start_from.to_json(), load_s=load_s))
        self.guard.restart(self.progress.step)
        self.guard.skipped_before = self.progress.skipped_steps
        micro_batch, _ = train.batch_layout(layout.data_ranks)
        self.batches = DataParallelBatches(
            data.train, train.global_batch_size, micro_batch, dp_rank=layout.data_rank,
            dp_size=layout.data_ranks, device=device, position=self.progress.data_position,
            read_ahead_steps=plan.data_config.read_ahead_steps, read_threads=plan.data_config.read_threads,
        )
        self.result = TrainResult(
            mesh_shape=mesh.shape, world_size=layout.world_size,
            # A pipeline rank holds its stages' part: the run's model is counted whole, on meta.
            parameters=count_parameters(build_model(model, "meta") if self.model.stages else self.model),
        )
        manifest: dict[str, Any] = {
            "world_size": layout.world_size,
            "mesh_shape": list(mesh.shape),
            "model_args": model.model_dump(),
            "data_fingerprint": data.fingerprint,
            "sampling": data.sampling,
            "config": dict(plan.settings),
        }
        if plan.data_stages:
            manifest["data_stages"] = [stage.to_json() for stage in plan.data_stages]
        if plan.start_from is not None:
            manifest["started_from"] = plan.start_from.to_json()  # the lineage, for exports and later runs
        rollback = None
        if train.rollback_after_spikes is not None:
            done = max((entry.rollback for entry in rollbacks_left_out(plan)), default=0)
            rollback = RollbackRule(train.rollback_after_spikes, train.rollback_window, train.rollback_skip_before,
                                    train.max_rollbacks, done)
        self.bad_steps = BadStepLimit(self.guard, train.max_bad_steps, self.progress, self.outputs, rollback)
        self.parts = loop_parts(plan, self, checkpoints, data, manifest, joining)

    def run(self) -> TrainResult:
        progress, steps, log_every = self.progress, self.plan.train.steps, self.plan.train.log_every
        self.outputs.started(self.layout.world_size, self.layout.plan.sizes, progress)
        self.model.train()
        started = time.perf_counter()
        self.parts.at_start()
        first_step = progress.step + 1
        try:
            while progress.step < steps:
                start = self.parts.before_step(StepStart(progress.step + 1, first=progress.step + 1 == first_step))
                lr = float(self.scheduler.get_last_lr()[0])
                waiting_since = time.perf_counter()
                with region("data wait"):
                    micro_batches = list(self.batches.next_step())
                data_wait = time.perf_counter() - waiting_since
                with self.parts.around_step(start.step):
                    output = train_step(self.model, self.guard, micro_batches, self.layout, self.plan.optim.grad_clip,
                                        attention_work=self.attention_work, reduction=start.reduction,
                                        pipeline=self.pipeline)
                if output is None:  # the reduction was not committed (a replica group failed): train it again
                    self.parts.step_abandoned(start)
                    continue
                self.scheduler.step()
                step = start.step
                progress.step, progress.tokens = step, progress.tokens + output.tokens
                progress.data_position = self.batches.position
                last = step == steps
                groups = start.reduction.groups if start.reduction is not None else 1
                if not self.parts.after_step(StepDone(step, last, last or step % log_every == 0, lr, output, data_wait,
                                                      groups)):
                    break
        finally:
            self.batches.close()
        self.parts.at_end(progress.step)
        self.result.tokens = progress.tokens
        self.result.skipped_steps = self.guard.read().skipped_total
        self.result.train_time_s = time.perf_counter() - started
        self.result.stopped = self.bad_steps.stopped
        return self.result

    def close(self) -> None:
        self.parts.close()
        self.layout.close()
