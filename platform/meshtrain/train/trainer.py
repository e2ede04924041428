"""One rank's run, independent of Ray (the Ray worker and the tests both call it).

:class:`Trainer` sets up the sharded model, optimizer, data and checkpoints, then ``run`` is the
loop: each step fetches its micro-batches, takes one guarded optimizer step, and hands over to the
named parts of the loop: checkpointing, evaluation and the step log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.write_progress import bytes_written
from meshtrain.config import ConfigError, MeshtrainConfig, ModelArgs
from meshtrain.data import DataParallelBatches, DataPlan, TrainingData, checkpoint_sampling, open_data
from meshtrain.distributed.layout import RankLayout, WorkerLayout
from meshtrain.distributed.plan import memory_plan
from meshtrain.distributed.replicas import ReplicaPeers, ReplicaPlacement
from meshtrain.model.args import model_args
from meshtrain.model.flops import AttentionWork
from meshtrain.model.llama import count_parameters
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.observe.run_folder import (
    Interrupted,
    MemorySnapshotRecord,
    MetricsRecord,
    StopRequest,
    StragglerRecord,
    TrainRecord,
)
from meshtrain.observe.reporting import RayTrainReporter
from meshtrain.train.checkpointing import Checkpointing, checkpoint_manager
from meshtrain.train.evaluation import Evaluation
from meshtrain.train.faults import FaultInjection
from meshtrain.train.gc_schedule import ScheduledCollection
from meshtrain.train.guard import BadStepLimit, StepGuard
from meshtrain.train.hangs import HangReport
from meshtrain.train.memory_snapshot import OutOfMemorySnapshots, cuda_allocator
from meshtrain.train.optim import build_lr_scheduler, build_optimizer
from meshtrain.train.preemption import NoticeHandling, PreemptionNotice, StopRequestWatch, StopVote, defer_sigterm
from meshtrain.train.profiling import StepProfiler, region
from meshtrain.train.healing import HealingState
from meshtrain.train.records import LoopOutputs
from meshtrain.train.replica_steps import ReplicaSteps
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.step import train_step
from meshtrain.train.step_log import StepLog
from meshtrain.train.stragglers import ComputeTimer, StragglerWatch
from meshtrain.train.watchdog import HangWatchdog


@dataclass
class TrainResult:
    records: list[TrainRecord] = field(default_factory=list)
    mesh_shape: tuple[int, int] = (1, 1)
    world_size: int = 1
    parameters: int = 0
    train_time_s: float = 0.0
    tokens: int = 0
    eval_loss: float | None = None  # the last evaluation's
    eval_loss_by_source: dict[str, float | None] = field(default_factory=dict)  # the last evaluation's
    skipped_steps: int = 0
    stopped: str | None = None  # why the run stopped before train.steps (the step guard)
    interrupted: Interrupted | None = None  # the driver was interrupted: at which step, what was saved

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Throughput after the first logged interval (which pays for warm-up and compilation)."""
        if not self.records:
            return None
        first, last = self.records[0], self.records[-1]
        if len(self.records) == 1:
            return last["tokens"] / last["elapsed_s"]
        return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


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


def train(
    cfg: MeshtrainConfig,
    data: DataPlan | TrainingData,
    worker: WorkerLayout,
    device: torch.device,
    on_record: Callable[[MetricsRecord], None] | None = None,
    metrics: TrainingMetrics | None = None,
    reporter: RayTrainReporter | None = None,
    on_straggler: Callable[[StragglerRecord], None] | None = None,
    stop_request: StopRequest | None = None,
    model: ModelArgs | None = None,
    replica: ReplicaPlacement | None = None,
) -> TrainResult:
    """Train until ``cfg.train.steps``, resuming from the newest committed checkpoint if any.

    ``on_record`` receives every logged step, evaluation and checkpoint event (rank 0 emits the save
    events); ``metrics`` (when given) is updated every step; ``reporter`` (every rank, or none) hands
    logged steps to Ray Train; ``stop_request`` is where the driver asks the ranks to save and stop;
    ``model`` is the model's shape as the driver resolved it (``RunSpec.model``; resolved here when not given);
    ``replica`` (fault_tolerance.mode=replica) places this worker's group among the run's replica groups.
    """
    if isinstance(data, DataPlan):
        data = open_data(data, cfg.data.seq_len, cfg.train.seed)
    trainer = Trainer(cfg, data, worker, device, on_record, metrics, reporter, on_straggler, stop_request, model,
                      replica)
    try:
        return trainer.run()
    finally:
        trainer.close()


class Trainer:
    """One rank's run: setup here, then the loop in ``run``."""

    def __init__(
        self,
        cfg: MeshtrainConfig,
        data: TrainingData,
        worker: WorkerLayout,
        device: torch.device,
        on_record: Callable[[MetricsRecord], None] | None,
        metrics: TrainingMetrics | None,
        reporter: RayTrainReporter | None = None,
        on_straggler: Callable[[StragglerRecord], None] | None = None,
        stop_request: StopRequest | None = None,
        model: ModelArgs | None = None,
        replica: ReplicaPlacement | None = None,
    ) -> None:
        self.cfg = cfg
        args = model if model is not None else model_args(cfg.model, data.vocab_size)  # the driver resolved it once
        self.outputs = LoopOutputs(on_record, metrics, reporter)
        torch.manual_seed(cfg.train.seed)
        run_dir = Path(cfg.run.storage_path) / (cfg.run.name or "")
        # First, so that memory.history_entries records the model's and optimizer's allocations too.
        self.memory = OutOfMemorySnapshots(
            cuda_allocator(device), run_dir / "memory", worker.world_rank, cfg.memory.history_entries,
            lambda: memory_plan(cfg, args, self.layout.plan, device.type == "cuda").total,
        )
        checkpoints = checkpoint_manager(cfg, worker, self.outputs.checkpoint_event)
        resuming = checkpoints is not None and cfg.checkpoint.resume and checkpoints.any_committed()
        self.model, layout = build_sharded_model(cfg, args, worker, device, read_init_from=not resuming,
                                                 document_eos=data.eos_id if cfg.model.document_mask else None)
        # Every part of the loop asks this one layout which ranks it works with.
        self.layout: RankLayout = layout.with_control_group()
        layout, plan = self.layout, self.layout.plan
        self.attention_work = AttentionWork()  # the (query, key) pairs the steps attend, for MFU
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.optim.schedule_steps or cfg.train.steps)
        self.guard = StepGuard(self.optimizer, device, cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
        self.progress = Progress()
        state = TrainState(self.model, self.optimizer, self.scheduler, self.progress, layout.rank)

        def restore() -> None:
            assert checkpoints is not None
            restored = checkpoints.restore(state, at_most=replica.resume_step if replica is not None else None)
            if restored is not None:
                check_sampling(restored.manifest, data.sampling, restored.step)

        # A replica group that replaces a lost one receives its state from a live peer, not from storage.
        joining = replica is not None and replica.joining
        if resuming and not joining:
            restore()
        self.guard.skipped_before = self.progress.skipped_steps
        micro_batch, _ = cfg.batch_layout(layout.data_ranks)
        self.batches = DataParallelBatches(
            data.train, cfg.train.global_batch_size, micro_batch, dp_rank=layout.data_rank,
            dp_size=layout.data_ranks, device=device, position=self.progress.data_position,
            read_ahead_steps=cfg.data.read_ahead_steps, read_threads=cfg.data.read_threads,
        )
        self.result = TrainResult(
            mesh_shape=plan.shape, world_size=layout.world_size, parameters=count_parameters(self.model)
        )
        manifest = {
            "world_size": layout.world_size,
            "mesh_shape": list(plan.shape),
            "model_args": args.model_dump(),
            "data_fingerprint": data.fingerprint,
            "sampling": data.sampling,
            "config": cfg.model_dump(mode="json"),
        }
        fault_rank = layout.rank if replica is None else replica.index * layout.world_size + layout.rank
        self.faults = FaultInjection(cfg.fault, fault_rank, run_dir / "faults", worker.node)
        self.bad_steps = BadStepLimit(self.guard, cfg.train.max_bad_steps, self.progress, self.outputs)
        self.checkpointing = Checkpointing(
            checkpoints, state, self.progress, manifest, cfg.train.steps, self.bad_steps, self.outputs,
            self.faults, self._beat,
        )
        self.evaluation = Evaluation(
            self.model, data.validation, cfg.eval.interval, cfg.eval.batches, cfg.train.global_batch_size,
            micro_batch, layout, device, self.outputs, self._beat,
        )
        self.log = StepLog(
            cfg.train.log_every, cfg.train.global_batch_size, layout.world_size, self.progress, self.bad_steps,
            self.outputs, self.result.records, (self.attention_work, self.model.args), replicas=replica is not None,
        )
        # The loop's own small collectives (notice votes, straggler times) go on the layout's control
        # group; every rank issues them in the same order.
        budget = cfg.run.preemption_save_s
        self.notice = PreemptionNotice(budget, layout.rank) if budget is not None else None
        self.stop_vote = StopVote(self.notice, layout.control_group) if self.notice is not None else None
        self.notices = (
            NoticeHandling(self.notice, self.stop_vote, self.checkpointing, self.outputs, layout.rank, budget,
                           cfg.scaling.resize_check_interval_s, self._beat,
                           hand_over=self._hand_over if replica is not None else None)
            if self.notice is not None and self.stop_vote is not None else None
        )
        self.stragglers = StragglerWatch(
            ComputeTimer(self.model.layers, device), cfg.metrics.straggler_factor, cfg.metrics.straggler_patience,
            layout.rank, layout.node, self.outputs, layout.control_group,
            metrics.set_rank_speed if metrics is not None else None, on_straggler,
        )
        self.profiler = StepProfiler.of(
            cfg.profile, run_dir / "profile", layout.rank, cfg.train.steps, self.model.layers, cfg.parallel.compile,
            device, self.outputs.emit,
        )
        self.replicas: ReplicaSteps | None = None
        if replica is not None:
            healing = HealingState(state, self.guard)
            peers = ReplicaPeers(cfg.fault_tolerance, replica, layout.rank, layout.world_size, device,
                                 healing.state_dict, healing.load_state_dict, host=worker.node or None)
            if not joining:
                peers.set_step(self.progress.step)
            self.replicas = ReplicaSteps(peers, cfg.fault_tolerance.data == "strict", layout, self.batches,
                                         self.progress, self.outputs, self.checkpointing, joining)
        # Last, so a setup that fails leaves neither a thread, a signal route nor the collector switched off.
        timeout_s = cfg.run.hang_timeout_s
        self.watchdog = (
            HangWatchdog(timeout_s, layout.rank, progress=bytes_written,
                         report=HangReport.of(run_dir / "hangs", layout.rank, layout.world_size, timeout_s),
                         on_fire=self.replicas.peers.close if self.replicas is not None else None)
            if timeout_s else None
        )
        self.collection = ScheduledCollection(cfg.train.gc_every)
        self._restore_sigterm = defer_sigterm(self.notice) if self.notice is not None else None
        self.stop_watch = (
            StopRequestWatch(stop_request, self.notice) if stop_request is not None and self.notice is not None else None
        )

    def run(self) -> TrainResult:
        cfg, progress = self.cfg, self.progress
        self.outputs.started(self.layout.world_size, self.layout.plan.sizes, progress)
        self.model.train()
        self.log.start(time.perf_counter())
        first_step = progress.step + 1
        try:
            while progress.step < cfg.train.steps:
                step = progress.step + 1
                self._beat(f"training step {step}", arm=step > first_step)
                live = None
                attempt_started = time.perf_counter()
                if self.replicas is not None:
                    with self._excused("waiting for the replica quorum"):
                        live = self.replicas.begin()
                    self.log.waited_for_replicas(time.perf_counter() - attempt_started)
                    attempt_started = time.perf_counter()
                    step = progress.step + 1  # a group that joined has its peer's progress
                    self._beat(f"training step {step}")
                if self.profiler is not None:
                    self.profiler.step(step)
                if self.stop_vote is not None:
                    self.stop_vote.cast()
                self.faults.before_step(step, self.model)
                self.collection.step(step)
                lr = self.scheduler.get_last_lr()[0]
                waiting_since = time.perf_counter()
                with region("data wait"):
                    micro_batches = list(self.batches.next_step())
                data_wait = time.perf_counter() - waiting_since
                with self.memory.step(step):
                    output = train_step(self.model, self.guard, micro_batches, self.layout, cfg.optim.grad_clip,
                                        attention_work=self.attention_work, replicas=live)
                if output is None:  # a live replica group failed during the step: train it again
                    self.log.waited_for_replicas(time.perf_counter() - attempt_started)
                    continue
                self.scheduler.step()
                progress.step, progress.tokens = step, progress.tokens + output.tokens
                progress.data_position = self.batches.position
                last = step == cfg.train.steps
                if not self.checkpointing.after_step(step):
                    break
                if live is not None:
                    self.log.replicas_in_step(live.participants)
                workers = self.layout.world_size * (live.participants if live is not None else 1)
                self.outputs.step_done(step, output.tokens // workers, data_wait)
                self.stragglers.step_done()
                if self.evaluation.due(step, last):
                    self.result.eval_loss = self.evaluation.run(step)
                    self.result.eval_loss_by_source = self.evaluation.last_by_source
                if not self.log.after_step(step, lr, output, data_wait, last):
                    break
                if self.log.logged_at(step, last):
                    self.stragglers.at_logged_step(step)
                    if self.notices is not None:
                        self.notices.check_budget(step, self.result.records)
                if self.notices is not None:
                    interrupted = self.notices.after_step(step)
                    if interrupted is not None:
                        self.result.interrupted = interrupted
                        break
        finally:
            self.batches.close()
            if self.profiler is not None:
                self.profiler.close()
        self.checkpointing.close()
        snapshot = self.memory.finished(progress.step)
        if snapshot is not None:
            self.outputs.emit(MemorySnapshotRecord(event="memory_snapshot", step=progress.step, rank=self.layout.rank,
                                                   path=str(snapshot)))
        self.result.tokens = progress.tokens
        self.result.skipped_steps = self.guard.read().skipped_total
        self.result.train_time_s = time.perf_counter() - self.log.started
        self.result.stopped = self.bad_steps.stopped
        return self.result

    def _hand_over(self) -> int:
        return self.replicas.hand_over() if self.replicas is not None else 0

    def _excused(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return self.watchdog.excused(doing) if self.watchdog is not None else contextlib.nullcontext()

    def _beat(self, doing: str, arm: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(doing, arm)

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.peers.close()
        if self.stop_watch is not None:
            self.stop_watch.close()
        if self._restore_sigterm is not None:
            self._restore_sigterm()
        if self.stop_vote is not None:
            self.stop_vote.close()
        self.stragglers.close()
        self.layout.close()
        if self.watchdog is not None:
            self.watchdog.close()
        self.collection.close()
