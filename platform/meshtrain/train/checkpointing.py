"""The loop's checkpoints: save at checkpoint steps unless the newest step was skipped, and stop when
the guard says so."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from meshtrain.checkpoint.manager import CheckpointLoaded, CheckpointManager, SaveCommitted
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import run_checkpoints
from meshtrain.config import CheckpointConfig, RunConfig
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import CheckpointLoadRecord, CheckpointSaveRecord, CheckpointSkippedRecord
from meshtrain.train.faults import FaultInjection
from meshtrain.train.guard import BadStepLimit
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.records import LoopOutputs


def checkpoint_manager(
    checkpoint: CheckpointConfig, run: RunConfig, layout: WorkerLayout,
    on_event: Callable[[CheckpointSaveRecord | CheckpointLoadRecord], None],
) -> CheckpointManager | None:
    """This run's checkpoint manager, or None with checkpoints off; its saves and loads reach ``on_event``
    as records."""
    if not checkpoint.enabled:
        return None

    def record(event: SaveCommitted | CheckpointLoaded) -> None:
        if isinstance(event, SaveCommitted):
            on_event(CheckpointSaveRecord(step=event.step, path=event.path, blocking_s=event.blocking_s,
                                          total_s=event.total_s, bytes=event.bytes, mode=event.mode))
        else:
            on_event(CheckpointLoadRecord(step=event.step, path=event.path, load_s=event.load_s,
                                          rng_restored=event.rng_restored))

    return CheckpointManager(
        run_checkpoints(checkpoint, run),
        rank=layout.world_rank,
        world_size=layout.world_size,
        interval=checkpoint.interval,
        keep=checkpoint.keep,
        asynchronous=checkpoint.mode == "async",
        on_event=record,
    )


class Checkpointing(LoopPart):
    """After every step: let a finished async save commit, and at a checkpoint step save the state,
    unless that step was skipped (then the last good checkpoint stays the newest)."""

    def __init__(
        self,
        manager: CheckpointManager | None,
        state: TrainState,
        progress: Progress,
        manifest: dict[str, Any],
        last_step: int,
        bad_steps: BadStepLimit,
        outputs: LoopOutputs,
        faults: FaultInjection,
        beat: Callable[[str], None],
        manifest_extra: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        """``manifest_extra``: what the manifest of a save at a data position adds (data.stages' samples, the
        samples left out, the spike rules' windows)."""
        self.manager, self.state, self.progress, self.manifest = manager, state, progress, manifest
        self.manifest_extra = manifest_extra
        self.last_step, self.bad_steps, self.outputs, self.faults, self.beat = last_step, bad_steps, outputs, faults, beat
        self.saved_step: int | None = None  # the newest step this worker group saved
        self.writer = True  # fault_tolerance.mode=replica: only the first live replica group saves

    def after_step(self, done: StepDone) -> bool:
        """False when the run must stop (the guard's limit was reached at a checkpoint step)."""
        step = done.step
        if self.manager is None:
            return True
        self.manager.poll()
        if not self.manager.due(step, self.last_step):
            return True
        bad_in_a_row = self.bad_steps.check(step)
        if bad_in_a_row is None:
            return False
        if bad_in_a_row or self.bad_steps.rollback is not None:
            reason = "a rollback is due" if not bad_in_a_row else "the step was skipped by the guard"
            self.outputs.emit(CheckpointSkippedRecord(step=step, reason=reason))
            return True
        if not self.writer:
            return True
        saving_since = time.perf_counter()
        self.beat(f"saving the checkpoint of step {step}")
        self.manager.save(self.state, self._manifest(), wait=step == self.last_step)
        self.saved_step = step
        self.beat(f"training after the checkpoint of step {step}")
        self.outputs.checkpoint_blocked(time.perf_counter() - saving_since)
        self.faults.while_saving(step)
        return True

    def _manifest(self) -> dict[str, Any]:
        extra = self.manifest_extra(self.progress.data_position) if self.manifest_extra is not None else {}
        return {**self.manifest, **vars(self.progress), **extra}

    def save_now(self, step: int) -> bool:
        """Save ``step`` and wait for its commit, unless the newest save is already of this step (then
        wait for that one); False with checkpoints off, or when the step was skipped by the guard."""
        if self.manager is None or not self.writer:  # replica mode: the first live group saves
            return False
        if self.saved_step == step:  # already saved (maybe still writing): never rewrite a checkpoint
            self.manager.finish_pending()
            return True
        bad_in_a_row = self.bad_steps.check(step)
        if bad_in_a_row is None or bad_in_a_row:
            return False
        self.beat(f"saving the checkpoint of step {step} on notice")
        self.manager.save(self.state, self._manifest(), wait=True)
        self.saved_step = step
        return True

    def rewound(self, step: int) -> None:
        self.saved_step = None  # the newer saves were set aside: the steps after ``step`` are saved again

    def at_end(self, step: int) -> None:
        """Wait for the save in flight to commit."""
        if self.manager is not None:
            self.manager.close()
