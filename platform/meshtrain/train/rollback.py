"""Rollback after repeated loss spikes: back to the newest checkpoint before them, leaving out the
samples behind them, in the same workers (no restart).

When the guard's reading calls for it (``train.rollback_after_spikes`` skipped steps within
``train.rollback_window``, see :class:`~meshtrain.train.guard.BadStepLimit`), every rank, at the same
step:

1. waits for the save in flight, marks the committed checkpoints from the first step whose samples are
   left out on as bad (kept for inspection, never resumed) and loads the newest one before it: model,
   optimizer, schedule, progress, random state, and the spike rules' windows from its manifest;
2. leaves out the samples the steps from ``train.rollback_skip_before`` steps before the first skipped
   one to the last trained one read, as ranges of each stage's own sequence (rank 0 writes them to the
   run folder's ``left_out_samples.json``, which every later start honours, and the checkpoints
   saved from now on list them);
3. tells the loop's other parts that the run went back (``LoopParts.rewound``), and trains on.

The data reads the same order as a run that left those samples out from its start, so the rest of the
run is that run's, bitwise on the same mesh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.data.batches import DataParallelBatches
from meshtrain.data.skips import merged_skips
from meshtrain.data.stages import StagedSamples
from meshtrain.observe.run_folder import LeftOutRange, LeftOutSamples, RollbackRecord, read_left_out, write_left_out
from meshtrain.train.guard import BadStepLimit, StepGuard
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.records import LoopOutputs


class SpikeRollback(LoopPart):
    def __init__(
        self,
        checkpoints: CheckpointManager,
        state: TrainState,
        progress: Progress,
        guard: StepGuard,
        bad_steps: BadStepLimit,
        samples: StagedSamples,
        batches: DataParallelBatches,
        labels: list[str],
        skip_before: int,
        left_out_file: Path,
        outputs: LoopOutputs,
        rank: int,
        beat: Callable[[str], None] = lambda doing: None,
    ) -> None:
        """``beat``: the hang watchdog's, told what the rank is doing while it reloads."""
        self.checkpoints, self.state, self.progress, self.guard = checkpoints, state, progress, guard
        self.bad_steps, self.samples, self.batches, self.labels = bad_steps, samples, batches, labels
        self.skip_before, self.left_out_file, self.outputs, self.rank = skip_before, left_out_file, outputs, rank
        self.beat = beat
        self.tell_parts: Callable[[int], None] = lambda step: None  # LoopParts.rewound, set once the parts exist

    def after_step(self, done: StepDone) -> bool:
        """False when the run must stop: no committed checkpoint lies before the spikes."""
        due, self.bad_steps.rollback = self.bad_steps.rollback, None
        if due is None:
            return True
        started = time.perf_counter()
        first_left_out = max(due.skipped[0] - self.skip_before, 1)  # the first step whose samples are left out
        G = self.batches.global_batch_size
        read_from, read_to = (first_left_out - 1) * G, self.progress.data_position
        new = self.samples.skip_ranges(read_from, read_to)
        counts = [{label: count for label, count in zip(self.labels, self.samples.newly_left_out(skip)) if count}
                  for skip in new]
        reason = f"rolled back past it: steps {', '.join(map(str, due.skipped))} spiked"
        self.beat(f"rolling back to a checkpoint before step {first_left_out}")
        restored = self.checkpoints.roll_back(self.state, first_left_out, reason)
        self.beat(f"training after the rollback to step {self.progress.step}")
        if restored is None:
            self.bad_steps.stop(done.step, (
                f"train.rollback_after_spikes={len(due.skipped)}: steps {', '.join(map(str, due.skipped))} were skipped, and "
                f"no committed checkpoint precedes step {first_left_out} to roll back to; lower checkpoint.interval"))
            return False
        self.bad_steps.rollbacks += 1
        left_out = [LeftOutSamples(stage=r.stage, start=r.start, stop=r.stop, rollback=self.bad_steps.rollbacks,
                                   step=done.step, rolled_back_to=restored.step, sources=n) for r, n in zip(new, counts)]
        self.samples.skip(merged_skips([*self.samples.skips, *new]))
        if self.rank == 0:
            write_left_out(self.left_out_file, [*read_left_out(self.left_out_file), *left_out])
        self.batches.load_state_dict({"position": self.progress.data_position})
        self.guard.restart(self.progress.step)
        self.guard.load_history(restored.manifest.get("spike_history"))
        self.guard.skipped_before = self.progress.skipped_steps
        self.guard.skipped.zero_()
        self.outputs.rollback(RollbackRecord(
            step=done.step, to_step=restored.step, skipped_steps=list(due.skipped),
            left_out=[cast(LeftOutRange, entry.to_json()) for entry in left_out], seconds=time.perf_counter() - started,
            time=time.time(),
        ))
        self.tell_parts(self.progress.step)
        return True
