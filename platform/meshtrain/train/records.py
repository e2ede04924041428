"""Where the training loop's records go (the run's record sink, Prometheus and Ray Train, each
optional), and what the loop returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshtrain.checkpoint.state import Progress
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.observe.reporting import RayTrainReporter
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    EvalRecord,
    Interrupted,
    MetricsRecord,
    MixtureRecord,
    RollbackRecord,
    StragglerRecord,
    TrainRecord,
)
from meshtrain.train.loop import LoopPart, StepDone


@dataclass
class TrainResult:
    """What one rank's run did; the step log, the evaluation and the notices fill it in as the loop runs."""

    records: list[TrainRecord] = field(default_factory=list)
    mesh_shape: tuple[int, ...] = (1, 1)
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
        return self.records[-1].loss if self.records else None

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Throughput after the first logged interval (which pays for warm-up and compilation)."""
        if not self.records:
            return None
        first, last = self.records[0], self.records[-1]
        if len(self.records) == 1:
            return last.tokens / last.elapsed_s
        return (last.tokens - first.tokens) / (last.elapsed_s - first.elapsed_s)


class LoopOutputs:
    """Fans each record out to ``on_record`` (rank 0's metrics.jsonl and TensorBoard), this worker's
    Prometheus ``metrics`` and Ray Train's ``reporter``; any of them may be None. ``on_straggler``
    hears of a rank that stays slow (the driver's eviction policy, on rank 0)."""

    def __init__(
        self,
        on_record: Callable[[MetricsRecord], None] | None = None,
        metrics: TrainingMetrics | None = None,
        reporter: RayTrainReporter | None = None,
        on_straggler: Callable[[StragglerRecord], None] | None = None,
    ) -> None:
        self.on_record, self.metrics, self.reporter, self.on_straggler = on_record, metrics, reporter, on_straggler
        self.writes = True  # fault_tolerance.mode=replica: only the first live replica group writes

    def emit(self, record: MetricsRecord, *, any_replica: bool = False) -> None:
        """``any_replica``: written by whichever replica group says it (a group's own joining)."""
        if self.on_record is not None and (self.writes or any_replica):
            self.on_record(record)

    def started(self, world_size: int, mesh_sizes: tuple[int, ...], progress: Progress) -> None:
        if self.metrics is not None:
            self.metrics.set_mesh(world_size, mesh_sizes)
            self.metrics.start_steps(progress.step, progress.tokens, progress.skipped_steps)

    def step_done(self, step: int, worker_tokens: int, data_wait_s: float) -> None:
        if self.metrics is not None:
            self.metrics.step_done(step, worker_tokens, data_wait_s)

    def logged(self, record: TrainRecord, world_size: int, final: bool) -> None:
        """A logged step; ``final``: the last one this run reports (the last step, or a stop)."""
        if self.metrics is not None:
            self.metrics.logged(record, world_size)
        if self.reporter is not None:
            self.reporter.logged(record, final)
        self.emit(record)

    def evaluated(self, record: EvalRecord) -> None:
        if self.metrics is not None:
            self.metrics.evaluated(record)
        if self.reporter is not None:
            self.reporter.evaluated(record)
        self.emit(record)

    def mixture(self, record: MixtureRecord) -> None:
        if self.metrics is not None:
            self.metrics.mixture(record)
        self.emit(record)

    def replicas(self, live: int, heal_s: float | None, heal_bytes: int | None) -> None:
        """fault_tolerance.mode=replica: the step's live replica groups, and this worker's healing time and bytes."""
        if self.metrics is not None:
            self.metrics.replicas(live, heal_s, heal_bytes)

    def rollback(self, record: RollbackRecord) -> None:
        if self.metrics is not None:
            self.metrics.rollback(record)
        self.emit(record)

    def skipped(self, skipped_total: int) -> None:
        if self.metrics is not None:
            self.metrics.skipped(skipped_total)

    def checkpoint_event(self, event: CheckpointSaveRecord | CheckpointLoadRecord) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_event(event)
        self.emit(event)

    def checkpoint_blocked(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_blocked(seconds)


class StepMetrics(LoopPart):
    """Every step's counters for Prometheus: this worker's tokens and its wait for data."""

    def __init__(self, outputs: LoopOutputs, world_size: int) -> None:
        self.outputs, self.world_size = outputs, world_size

    def after_step(self, done: StepDone) -> bool:
        self.outputs.step_done(done.step, done.output.tokens // (self.world_size * done.groups), done.data_wait_s)
        return True
