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
  between two reads is still seen at the next one;
* so are the steps skipped within the last ``train.rollback_window`` (a ring of step numbers), from
  which :class:`BadStepLimit` decides a rollback (``train.rollback``) at the same reads.

Spike rules: a step spikes when its loss is over ``train.loss_spike_factor`` times the median of the last
``train.loss_spike_window`` accepted losses, or its gradient norm (before clipping) over
``train.grad_norm_spike_factor`` times the median of their norms; a median (not a mean) is not pulled up
by the spike it is to detect, and the rule waits until the window is full. The windows are saved with
each checkpoint (:meth:`StepGuard.history`), so a resumed run judges its steps as the unbroken one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.checkpoint.state import Progress
from meshtrain.config.training import TrainConfig
from meshtrain.observe.run_folder import StoppedRecord
from meshtrain.train.records import LoopOutputs


@dataclass(frozen=True)
class GuardReading:
    bad_in_a_row: int
    skipped_total: int
    longest_streak: int  # the longest run of skipped steps in a row since the last reading
    recent: tuple[int, ...] = ()  # the steps skipped within the rollback window ending at the reading's step


@dataclass(frozen=True)
class SpikeRules:
    """When a finite step is skipped as a spike (train.loss_spike_factor, train.grad_norm_spike_factor)."""

    loss_factor: float | None = None
    grad_norm_factor: float | None = None
    window: int = 50
    rollback_window: int | None = None  # how many recent steps' skips are kept for the rollback rule (None: off)


def spike_rules(train: TrainConfig) -> SpikeRules:
    return SpikeRules(train.loss_spike_factor, train.grad_norm_spike_factor, train.loss_spike_window,
                      train.rollback_window if train.rollback_after_spikes is not None else None)


def _spikes(value: torch.Tensor, history: torch.Tensor, factor: float) -> torch.Tensor:
    warm = ~torch.isnan(history).any()
    return warm & (value > factor * torch.nanmedian(history))


class StepGuard:
    def __init__(
        self, optimizer: torch.optim.Optimizer, device: torch.device, rules: SpikeRules, step: int = 0
    ) -> None:
        """``step``: the step the run resumes after (the guard numbers the steps it checks from it)."""
        self.optimizer = optimizer
        self.fused = bool(optimizer.defaults.get("fused"))
        self.rules = rules
        self.device = device
        self.bad_in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self.longest_streak = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_before = 0  # skipped steps of earlier worker groups (restored from the checkpoint)
        # The last accepted losses and gradient norms; nan marks a slot not yet filled.
        self.history = torch.full((rules.window,), math.nan, dtype=torch.float32, device=device)
        self.norms = torch.full((rules.window,), math.nan, dtype=torch.float32, device=device)
        self.restart(step)

    def restart(self, step: int) -> None:
        """Number the next checked step ``step + 1`` and forget the skips before it (a rollback to ``step``)."""
        self.last_step = torch.tensor(step, dtype=torch.int64, device=self.device)
        self.recent = torch.zeros(self.rules.rollback_window or 0, dtype=torch.int64, device=self.device)
        self.bad_in_a_row.zero_()
        self.longest_streak.zero_()

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step must be skipped (a 0-dim bool tensor); updates the counters."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        rules = self.rules
        if rules.loss_factor is not None:
            bad = bad | _spikes(loss, self.history, rules.loss_factor)
        if rules.grad_norm_factor is not None:
            bad = bad | _spikes(grad_norm, self.norms, rules.grad_norm_factor)
        if rules.loss_factor is not None or rules.grad_norm_factor is not None:
            self.history = torch.where(bad, self.history, torch.cat([self.history[1:], loss.reshape(1)]))
            self.norms = torch.where(bad, self.norms, torch.cat([self.norms[1:], grad_norm.reshape(1)]))
        if len(self.recent):  # the rollback rule's ring of skipped steps (nothing added to the step without it)
            self.last_step = self.last_step + 1
            slot = torch.remainder(self.last_step, len(self.recent)).reshape(1)
            self.recent = self.recent.index_put((slot,), (self.last_step * bad).reshape(1))
        self.bad_in_a_row = (self.bad_in_a_row + 1) * bad
        self.longest_streak = torch.maximum(self.longest_streak, self.bad_in_a_row)
        self.skipped = self.skipped + bad
        return bad

    def history_state(self) -> dict[str, Any]:
        """The spike rules' windows as JSON (a checkpoint's manifest keeps them); a device sync."""
        losses, norms = torch.stack([self.history, self.norms]).tolist()
        return {"losses": [None if math.isnan(x) else x for x in losses],
                "grad_norms": [None if math.isnan(x) else x for x in norms]}

    def load_history(self, state: Any) -> None:
        """Windows saved by :meth:`history_state` (kept as they are when absent or of another length: a
        checkpoint from before they were saved, or another train.loss_spike_window)."""
        if not isinstance(state, dict):
            return
        for name, key in (("history", "losses"), ("norms", "grad_norms")):
            values = state.get(key)
            current: torch.Tensor = getattr(self, name)
            if isinstance(values, list) and len(values) == len(current) and all(
                    v is None or isinstance(v, (int, float)) for v in values):
                setattr(self, name, torch.tensor([math.nan if v is None else float(v) for v in values],
                                                 dtype=torch.float32, device=self.device))

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
        values = torch.cat([torch.stack([self.bad_in_a_row, self.skipped, self.longest_streak, self.last_step]),
                            self.recent]).tolist()
        bad_in_a_row, skipped, longest, step = values[:4]
        self.longest_streak = self.bad_in_a_row.clone()  # a streak still going carries into the next window
        recent = tuple(sorted(s for s in values[4:] if s > 0 and s > step - len(self.recent)))
        return GuardReading(bad_in_a_row, self.skipped_before + skipped, longest, recent)


@dataclass(frozen=True)
class RollbackRule:
    """train.rollback_*: roll back when ``after_spikes`` steps within the last ``window`` were skipped, at most
    ``max_rollbacks`` times in the run (``done`` so far, counted from the run folder)."""

    after_spikes: int
    window: int
    skip_before: int
    max_rollbacks: int
    done: int = 0


@dataclass(frozen=True)
class RollbackDue:
    """A rollback the guard's reading at ``step`` calls for: the skipped steps within the window."""

    step: int
    skipped: tuple[int, ...]


class BadStepLimit:
    """Reads the guard at logged and checkpoint steps (one device sync) and says when the run must
    stop: after ``max_bad_steps`` skipped steps in a row, or when spikes call for a rollback past
    ``train.max_rollbacks``. ``stopped`` then holds why; ``rollback`` holds a rollback called for."""

    def __init__(self, guard: StepGuard, max_bad_steps: int, progress: Progress, outputs: LoopOutputs,
                 rollback: RollbackRule | None = None) -> None:
        self.guard, self.max_bad_steps, self.progress, self.outputs = guard, max_bad_steps, progress, outputs
        self.rule = rollback
        self.rollbacks = rollback.done if rollback is not None else 0
        self.stopped: str | None = None
        self.rollback: RollbackDue | None = None

    def check(self, step: int) -> int | None:
        """The skipped steps in a row up to ``step`` (0: it was taken), or None when the run must stop."""
        reading = self.guard.read()
        self.progress.skipped_steps = reading.skipped_total
        self.outputs.skipped(reading.skipped_total)
        rule = self.rule
        if rule is not None and len(reading.recent) >= rule.after_spikes:
            if self.rollbacks < rule.max_rollbacks:
                self.rollback = RollbackDue(step, reading.recent)
                return reading.bad_in_a_row
            self.stop(step, (
                f"train.max_rollbacks={rule.max_rollbacks}: {len(reading.recent)} of the last {rule.window} steps up to "
                f"step {step} were skipped (non-finite or spiking loss or gradient norm) after {self.rollbacks} "
                "rollback(s)"))
            return None
        if reading.longest_streak < self.max_bad_steps:
            return reading.bad_in_a_row
        ending = f"up to step {step}" if reading.bad_in_a_row >= self.max_bad_steps else f"before step {step}"
        self.stop(step, (
            f"train.max_bad_steps={self.max_bad_steps}: {reading.longest_streak} steps in a row {ending} "
            "were skipped (non-finite or spiking loss or gradient norm)"))
        return None

    def stop(self, step: int, why: str) -> None:
        """The run must stop at ``step`` for ``why`` (a record says so; ``check`` returns None)."""
        self.stopped = why
        self.outputs.emit(StoppedRecord(step=step, reason=why))
        return None
