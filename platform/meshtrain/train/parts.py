"""The one list of the training loop's parts, in the order the loop calls them (see ``train.loop``).

Before a step: the watchdog's beat, the replica quorum, the profiler, the notice vote, faults, the
garbage collector; around it, the out-of-memory snapshot; after it: checkpoints, the step's metrics,
evaluation, the step log, the mixture, a rollback the spikes call for, stragglers, and the notices acted on. A new behaviour of the
loop is a module with one :class:`~meshtrain.train.loop.LoopPart` and a line here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.write_progress import bytes_written
from meshtrain.config.observability import MemoryConfig
from meshtrain.data import TrainingData
from meshtrain.data.sampling import MixtureSamples
from meshtrain.data.stages import StagedSamples
from meshtrain.distributed.replicas import ReplicaPeers
from meshtrain.train.checkpointing import Checkpointing
from meshtrain.train.evaluation import Evaluation
from meshtrain.train.faults import FaultInjection
from meshtrain.train.gc_schedule import ScheduledCollection
from meshtrain.train.hangs import HangReport
from meshtrain.train.healing import HealingState
from meshtrain.train.loop import LoopPart, LoopParts
from meshtrain.train.memory_snapshot import OutOfMemorySnapshots, cuda_allocator
from meshtrain.train.mixture_log import MixtureLog
from meshtrain.train.plan import WorkerPlan
from meshtrain.train.preemption import NoticeHandling, Notices, PreemptionNotice, StopVote
from meshtrain.train.profiling import StepProfiler
from meshtrain.train.records import StepMetrics
from meshtrain.train.replica_pace import StepPace
from meshtrain.train.replica_steps import ReplicaSteps
from meshtrain.train.replica_stragglers import ReplicaEviction, ReplicaStragglers
from meshtrain.train.rollback import SpikeRollback
from meshtrain.train.step_log import StepLog
from meshtrain.train.stragglers import ComputeTimer, StragglerWatch
from meshtrain.train.watchdog import HangWatchdog, Heartbeat

if TYPE_CHECKING:
    from collections.abc import Callable

    from meshtrain.train.trainer import Trainer


def memory_snapshots(memory: MemoryConfig, trainer: Trainer, run_dir: Path,
                     planned_bytes: Callable[[], int]) -> OutOfMemorySnapshots:
    """Built before the model, so that memory.history_entries records the model's and optimizer's
    allocations too."""
    return OutOfMemorySnapshots(cuda_allocator(trainer.rank.device), run_dir / "memory", trainer.rank.worker.world_rank,
                                memory.history_entries, planned_bytes, trainer.outputs)


def manifest_extra(trainer: Trainer, data: TrainingData, staged: StagedSamples | None, position: int) -> dict[str, Any]:
    """What a checkpoint's manifest keeps beside the trainer's: each stage's samples per source, the samples
    left out, and the spike rules' windows (read at a checkpoint step, where the loop syncs anyway)."""
    extra: dict[str, Any] = {}
    if staged is not None:
        samples = staged.counters(position, data.source_names)
        lengths = {stage.name or "": stage.seq_len or trainer.plan.data_config.seq_len for stage in staged.stages}
        extra["data_samples"] = samples
        extra["data_tokens"] = {stage: {source: count * lengths[stage] for source, count in counts.items()}
                                for stage, counts in samples.items()}
    if isinstance(data.train, StagedSamples):
        extra["left_out"] = [skip.to_json() for skip in data.train.skips]
    rules = trainer.guard.rules
    if rules.loss_factor is not None or rules.grad_norm_factor is not None:
        extra["spike_history"] = trainer.guard.history_state()
    return extra


def loop_parts(
    plan: WorkerPlan,
    trainer: Trainer,
    checkpoints: CheckpointManager | None,
    data: TrainingData,
    manifest: dict[str, Any],
    joining: bool,
) -> LoopParts:
    """The parts of ``trainer``'s loop. The watchdog, the garbage collector's schedule and the routes of
    SIGTERM and the driver's stop request come last, so a setup that fails leaves neither a thread, a
    signal route nor the collector switched off."""
    layout, outputs, progress, result = trainer.layout, trainer.outputs, trainer.progress, trainer.result
    rank, run_dir = trainer.rank, plan.run.run_dir
    replica = rank.replica
    heartbeat = Heartbeat()
    fault_rank = layout.rank if replica is None else replica.index * layout.world_size + layout.rank
    faults = FaultInjection(plan.fault, fault_rank, run_dir / "faults", rank.worker.node, trainer.model)
    staged = data.train if isinstance(data.train, StagedSamples) and plan.data_stages else None
    checkpointing = Checkpointing(
        checkpoints, trainer.state, progress, manifest, plan.train.steps, trainer.bad_steps, outputs, faults, heartbeat.beat,
        manifest_extra=lambda position: manifest_extra(trainer, data, staged, position),
    )
    evaluation = Evaluation(trainer.model, data.validation, plan.eval.interval, plan.eval.batches,
                            plan.train.global_batch_size, trainer.batches.micro_batch_size, layout, rank.device, outputs, heartbeat.beat,
                            result, trainer.pipeline)
    log = StepLog(plan.train.global_batch_size, layout.world_size, progress, trainer.bad_steps, outputs, result.records,
                  (trainer.attention_work, trainer.model.args), replicas=replica is not None,
                  stage_of=staged.stage_name if staged is not None else None)
    profiler = StepProfiler.of(plan.profile, run_dir / "profile", layout.rank, plan.train.steps, list(trainer.model.layers.values()),
                               plan.parallel.compile, rank.device, outputs.emit)
    mixture = (MixtureLog(data.train, list(data.source_names), progress, outputs)
               if isinstance(data.train, (MixtureSamples, StagedSamples)) and len(data.train.components) > 1 else None)
    replicas: ReplicaSteps | None = None
    if replica is not None:
        pace = StepPace(plan.fault_tolerance.hang_factor, plan.fault_tolerance.hang_floor_s)
        healing = HealingState(trainer.state, trainer.guard, pace)
        peers = ReplicaPeers(plan.fault_tolerance, replica, layout.rank, layout.world_size, rank.device,
                             healing.state_dict, healing.load_state_dict, host=rank.worker.node or None)
        if not joining:
            peers.set_step(progress.step)
        replicas = ReplicaSteps(peers, plan.fault_tolerance.data == "strict", layout, trainer.batches, progress,
                                outputs, checkpointing, joining, heartbeat, log, pace)
    metrics = outputs.metrics
    stragglers = StragglerWatch(
        ComputeTimer(trainer.model.layers.values(), rank.device, trainer.model.args.n_layers), plan.metrics.straggler_factor,
        plan.metrics.straggler_patience,
        layout.rank, layout.node, outputs, layout.control_group,
        metrics.set_rank_speed if metrics is not None else None, outputs.on_straggler,
        ReplicaStragglers(replicas.peers, plan.metrics.straggler_factor, plan.metrics.straggler_patience, outputs,
                          ReplicaEviction(replicas.end_slow, plan.fault_tolerance.min_replicas)
                          if plan.scaling.evict_stragglers else None)
        if replicas is not None else None,
    )
    # The loop's own small collectives (notice votes, straggler times) go on the layout's control
    # group; every rank issues them in the same order.
    budget = plan.run.preemption_save_s
    notices: Notices | None = None
    if budget is not None:
        notice = PreemptionNotice(budget, layout.rank)
        vote = StopVote(notice, layout.control_group)
        handling = NoticeHandling(notice, vote, checkpointing, outputs, layout.rank, budget,
                                  plan.scaling.resize_check_interval_s, heartbeat.beat,
                                  hand_over=replicas.hand_over if replicas is not None else None)
        notices = Notices(notice, vote, handling, result)

    timeout_s = plan.run.hang_timeout_s
    if timeout_s:
        heartbeat.watchdog = HangWatchdog(
            timeout_s, layout.rank, progress=bytes_written,
            report=HangReport.of(run_dir / "hangs", layout.rank, layout.world_size, timeout_s),
            on_fire=replicas.peers.close if replicas is not None else None,
        )
    rollback = None
    if trainer.bad_steps.rule is not None and checkpoints is not None and isinstance(data.train, StagedSamples):
        rollback = SpikeRollback(checkpoints, trainer.state, progress, trainer.guard, trainer.bad_steps, data.train,
                                 trainer.batches, list(data.source_names), plan.train.rollback_skip_before,
                                 plan.paths.left_out, outputs, layout.rank, heartbeat.beat)
    collection = ScheduledCollection(plan.train.gc_every)
    if notices is not None:
        notices.listen(rank.stop_request)
    parts: list[LoopPart | None] = [
        heartbeat, replicas, profiler, checkpointing, StepMetrics(outputs, layout.world_size), evaluation, log, mixture,
        rollback, stragglers, notices, faults, collection, trainer.memory,
    ]
    loop = LoopParts([part for part in parts if part is not None])
    if rollback is not None:
        rollback.tell_parts = loop.rewound
    return loop
