"""Where the training loop's records go: the run's record sink, Prometheus and Ray Train, each optional."""

from __future__ import annotations

from collections.abc import Callable

from meshtrain.checkpoint.state import Progress
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.observe.reporting import RayTrainReporter
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    EvalRecord,
    MetricsRecord,
    TrainRecord,
)


class LoopOutputs:
    """Fans each record out to ``on_record`` (rank 0's metrics.jsonl and TensorBoard), this worker's
    Prometheus ``metrics`` and Ray Train's ``reporter``; any of them may be None."""

    def __init__(
        self,
        on_record: Callable[[MetricsRecord], None] | None,
        metrics: TrainingMetrics | None,
        reporter: RayTrainReporter | None,
    ) -> None:
        self.on_record, self.metrics, self.reporter = on_record, metrics, reporter
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

    def replicas(self, live: int, heal_s: float | None, heal_bytes: int | None) -> None:
        """fault_tolerance.mode=replica: the step's live replica groups, and this worker's healing time and bytes."""
        if self.metrics is not None:
            self.metrics.replicas(live, heal_s, heal_bytes)

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
