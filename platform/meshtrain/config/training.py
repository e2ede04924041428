"""Optimizer and training-loop settings: AdamW and its schedule, steps, batches, logging, the step guard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshtrain.config.errors import ConfigError
from meshtrain.config.section import Section


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (after warmup).")
    schedule: Literal["cosine", "linear", "wsd", "constant", "staged"] = Field(
        "cosine",
        description="LR after warmup: cosine or linear decay to min_lr_ratio x lr by the end of the "
        "schedule; wsd = stable at lr, then linear decay to min_lr_ratio x lr over the last "
        "optim.decay_fraction of the schedule (or from the start of optim.decay_from_stage); constant = lr throughout; "
        "staged = each data.stages stage holds the LR it starts with, or decays it linearly to its lr_decay_to x lr "
        "by its last step (the last stage: by the end of the schedule).",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final LR of the cosine, linear and wsd decays, as a fraction of lr."
    )
    warmup_steps: int = Field(20, ge=0, description="Steps of linear warmup from 0 to lr.")
    decay_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="wsd only (it or optim.decay_from_stage): share of the schedule's steps spent decaying, e.g. "
        "0.2 (rounded to whole steps, at least one).",
    )
    decay_from_stage: str | None = Field(
        None,
        description="wsd only (it or optim.decay_fraction): the data.stages stage the decay starts with; the LR "
        "decays linearly from that stage's first step to the end of the schedule (an anneal on its mix).",
    )
    schedule_steps: int | None = Field(
        None,
        gt=0,
        description="Steps the LR schedule spans; unset = train.steps of the run's first launch. "
        "Later steps keep the final LR.",
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (matrices only).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient L2 norm to this (0 = off).")
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="AdamW kernel; auto = fused on CUDA and CPU, foreach elsewhere."
    )

    @model_validator(mode="after")
    def _decay_fraction_only_for_wsd(self) -> "OptimConfig":
        given = [name for name in ("decay_fraction", "decay_from_stage") if getattr(self, name) is not None]
        if self.schedule == "wsd" and len(given) != 1:
            raise ValueError(
                "optim.decay_fraction: the wsd schedule needs it (the share of steps to decay over, e.g. 0.2) or "
                "optim.decay_from_stage (the data stage the decay starts with), not both"
            )
        if self.schedule != "wsd" and given:
            raise ValueError(
                f"optim.{given[0]}: only the wsd schedule uses it, not {self.schedule}; "
                f"set optim.schedule=wsd or leave optim.{given[0]} unset"
            )
        return self

    def wsd_decay_steps(self, horizon: int, decay_start: int | None = None) -> int:
        """Steps at the end of a ``horizon``-step wsd schedule that decay the LR (at least one): from
        ``decay_start`` (optim.decay_from_stage's first step, resolved) or over optim.decay_fraction."""
        if decay_start is not None:
            return max(1, horizon - decay_start)
        assert self.decay_fraction is not None, "the wsd schedule decays over a fraction or from a stage"
        return max(1, round(self.decay_fraction * horizon))

    def check_horizon(self, horizon: int, decay_start: int | None = None,
                      stages: tuple[tuple[int | None, float | None], ...] = ()) -> None:
        """ConfigError unless the warmup (and a wsd decay, or the first staged decay) fit in a schedule of
        ``horizon`` steps (``stages``: optim.schedule=staged's stage ends and decay ratios)."""
        span = f"the LR schedule's {horizon} steps (optim.schedule_steps, unset = train.steps)"
        if self.schedule == "wsd":
            if decay_start is not None and not self.warmup_steps <= decay_start < horizon:
                raise ConfigError(
                    f"optim.decay_from_stage={self.decay_from_stage!r} starts the wsd decay at step {decay_start}, "
                    f"outside optim.warmup_steps={self.warmup_steps} to the end of {span}; "
                    "decay from another stage, or lengthen the schedule"
                )
            decay = self.wsd_decay_steps(horizon, decay_start)
            if self.warmup_steps + decay > horizon:
                raise ConfigError(
                    f"optim.warmup_steps={self.warmup_steps} plus the wsd decay of {decay} steps "
                    f"(optim.decay_fraction={self.decay_fraction}) exceed {span}; "
                    "lower optim.warmup_steps or optim.decay_fraction, or lengthen the schedule"
                )
        elif self.schedule == "staged" and any(end is not None and decay is not None and end <= self.warmup_steps
                                               for end, decay in stages):
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps}: a data.stages stage that sets lr_decay_to ends within the "
                "warmup; shorten the warmup or end the stage later"
            )
        elif self.warmup_steps >= horizon:
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps} does not fit in {span}; "
                "lower optim.warmup_steps or lengthen the schedule"
            )


class TrainConfig(Section):
    steps: int = Field(200, gt=0, description="Optimizer steps to run.")
    global_batch_size: int = Field(16, gt=0, description="Sequences per optimizer step, over all workers.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward on one worker; the rest is accumulation."
    )
    seed: int = Field(0, description="Seeds weight init and the data order.")
    log_every: int = Field(5, gt=0, description="Write metrics and the progress line every N steps.")
    max_bad_steps: int = Field(
        5,
        gt=0,
        description="Stop the run after this many skipped steps in a row (a step is skipped when its loss or "
        "gradient norm is not finite, or it spikes); the longest streak is kept on the device and read at logged "
        "and checkpoint steps, so a streak that ended in between still stops the run.",
    )
    loss_spike_factor: float | None = Field(
        None,
        gt=1,
        description="Also skip a step whose loss exceeds this many times the median of the last "
        "train.loss_spike_window accepted losses; unset = no spike rule.",
    )
    loss_spike_window: int = Field(
        50, ge=3, description="Accepted steps the loss-spike (and gradient-norm spike) median is taken over."
    )
    grad_norm_spike_factor: float | None = Field(
        None,
        gt=1,
        description="Also skip a step whose gradient norm (before clipping) exceeds this many times the median of the "
        "last train.loss_spike_window accepted steps' norms; unset = no gradient-norm rule.",
    )
    rollback_after_spikes: int | None = Field(
        None,
        gt=0,
        description="Roll back when this many steps within train.rollback_window were skipped (spiking or non-finite): "
        "reload the newest committed checkpoint before the first of them, leave out the samples of the steps from "
        "that one (less train.rollback_skip_before) to the last trained, and go on; unset = skip steps only. Read "
        "where the guard is read (logged and checkpoint steps). Needs checkpoint.enabled.",
    )
    rollback_window: int = Field(20, gt=0, description="Steps over which train.rollback_after_spikes counts skipped steps.")
    rollback_skip_before: int = Field(
        0, ge=0, description="Also leave out the samples of this many steps before the first skipped step of a rollback."
    )
    max_rollbacks: int = Field(
        3, ge=0, description="Stop the run (one line) when spikes call for a rollback after this many in the run."
    )
    tf32: bool | None = Field(
        None,
        description="fp32 matrix multiplies on CUDA in TF32 (torch.set_float32_matmul_precision('high')); "
        "unset = on for CUDA workers computing in fp32. MFU divides by the TF32 peak when on, the fp32 peak when off.",
    )
    gc_every: int = Field(
        50,
        ge=0,
        description="Python's automatic garbage collection is off during training; every rank collects at the same "
        "steps, every N (0 = leave automatic collection on).",
    )

    def batch_layout(self, data_parallel_size: int) -> tuple[int, int]:
        """(micro-batch size, accumulation steps) for a data-parallel degree, or ConfigError."""
        micro, total = self.micro_batch_size, self.global_batch_size
        per_step = micro * data_parallel_size
        if total % per_step:
            raise ConfigError(
                f"train.global_batch_size={total} is not a multiple of train.micro_batch_size "
                f"({micro}) x data-parallel workers ({data_parallel_size}); make it a multiple of {per_step}"
            )
        return micro, total // per_step
