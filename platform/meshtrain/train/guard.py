"""Skip optimizer steps whose loss or gradient norm is not finite, or whose loss spikes.

The decision is made on the device, with no host sync on the training hot path:

* the step's global loss and gradient norm are identical on every rank (both are reduced over all
  ranks), so every rank takes the same decision and replicas never diverge;
* fused AdamW (meshtrain's default on CUDA and CPU) takes the decision as its ``found_inf`` input,
  the mechanism ``torch.amp.GradScaler`` uses: a flagged step leaves parameters, moments and the
  step count untouched inside the kernel. The foreach and for-loop kernels have no such input, so
  with ``optim.implementation`` set to one of them the flag is read on the host every step;
* the counters stay on the device and are read where the loop synchronizes anyway (logged steps,
  checkpoint steps); the longest streak of skipped steps is kept there too, so a streak that ends
  between two reads is still seen at the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtrain.checkpoint.state import Progress
from meshtrain.observe.run_folder import StoppedRecord
from meshtrain.train.records import LoopOutputs


@dataclass(frozen=True)
class GuardReading:
    bad_in_a_row: int
    skipped_total: int
    longest_streak: int  # the longest run of skipped steps in a row since the last reading


class StepGuard:
    def __init__(
        self, optimizer: torch.optim.Optimizer, device: torch.device, spike_factor: float | None, spike_window: int
    ) -> None:
        self.optimizer = optimizer
        self.fused = bool(optimizer.defaults.get("fused"))
        self.spike_factor = spike_factor
        self.bad_in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self.longest_streak = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_before = 0  # skipped steps of earlier worker groups (restored from the checkpoint)
        # The last accepted losses; nan marks a slot not yet filled.
        self.history = torch.full((spike_window,), math.nan, dtype=torch.float32, device=device)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step must be skipped (a 0-dim bool tensor); updates the counters."""
        loss = loss.detach().float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm.detach().float()))
        if self.spike_factor is not None:
            warm = ~torch.isnan(self.history).any()
            bad = bad | (warm & (loss > self.spike_factor * torch.nanmedian(self.history)))
            shifted = torch.cat([self.history[1:], loss.reshape(1)])
            self.history = torch.where(bad, self.history, shifted)
        self.bad_in_a_row = (self.bad_in_a_row + 1) * bad
        self.longest_streak = torch.maximum(self.longest_streak, self.bad_in_a_row)
        self.skipped = self.skipped + bad
        return bad

    def step(self, bad: torch.Tensor) -> None:
        """``optimizer.step()`` unless ``bad``."""
        if self.fused:
            found_inf = bad.float()
            params_device = self._params_device()
            if params_device != found_inf.device:
                # Under CPU offload the kernel runs on the host, and fused AdamW would copy the flag
                # with non_blocking=True and no sync: the host could read it before it arrives.
                found_inf = found_inf.to(params_device)
            self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        elif not bool(bad):
            self.optimizer.step()

    def _params_device(self) -> torch.device:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                return param.device
        return self.bad_in_a_row.device

    def read(self) -> GuardReading:
        """The counters on the host (a device sync: call it where the loop syncs anyway); starts a new
        longest-streak window."""
        bad_in_a_row, skipped, longest = torch.stack([self.bad_in_a_row, self.skipped, self.longest_streak]).tolist()
        self.longest_streak = self.bad_in_a_row.clone()  # a streak still going carries into the next window
        return GuardReading(bad_in_a_row, self.skipped_before + skipped, longest)


class BadStepLimit:
    """Reads the guard at logged and checkpoint steps (one device sync) and says when the run must
    stop: after ``max_bad_steps`` skipped steps in a row. ``stopped`` then holds why."""

    def __init__(self, guard: StepGuard, max_bad_steps: int, progress: Progress, outputs: LoopOutputs) -> None:
        self.guard, self.max_bad_steps, self.progress, self.outputs = guard, max_bad_steps, progress, outputs
        self.stopped: str | None = None

    def check(self, step: int) -> int | None:
        """The skipped steps in a row up to ``step`` (0: it was taken), or None when the run must stop."""
        reading = self.guard.read()
        self.progress.skipped_steps = reading.skipped_total
        self.outputs.skipped(reading.skipped_total)
        if reading.longest_streak < self.max_bad_steps:
            return reading.bad_in_a_row
        ending = f"up to step {step}" if reading.bad_in_a_row >= self.max_bad_steps else f"before step {step}"
        self.stopped = (
            f"train.max_bad_steps={self.max_bad_steps}: {reading.longest_streak} steps in a row {ending} "
            "were skipped (non-finite or spiking loss or gradient norm)"
        )
        self.outputs.emit(StoppedRecord(step=step, reason=self.stopped))
        return None
