"""AdamW with decoupled weight decay on matrices, and warmup + cosine/linear/wsd/constant LR schedules."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from meshtrain.config import OptimConfig
from meshtrain.distributed.float8 import keep_float8_scales_precomputed

# Devices with a fused AdamW kernel (one kernel per parameter group instead of one per op).
_FUSED_ADAMW_DEVICES = {"cuda", "cpu"}


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, precompute_float8_scales: bool = True
) -> torch.optim.AdamW:
    """AdamW; norms and other vectors get no weight decay. Fused kernels where the device has them.
    Weights all-gathered in float8 get their scales computed after each step, unless
    ``precompute_float8_scales`` is false (each all-gather then reduces its own weight's amax)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    implementation = cfg.implementation
    if implementation == "auto":
        # The optimizer runs where the sharded parameters live (host memory under CPU offload).
        implementation = "fused" if params[0].device.type in _FUSED_ADAMW_DEVICES else "foreach"
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel
    )
    if precompute_float8_scales:
        keep_float8_scales_precomputed(optimizer, model)
    return optimizer


StageLR = tuple[tuple[int | None, float | None], ...]  # each stage's last step (None: the horizon), its decay ratio


def staged_multiplier(step: int, horizon: int, stages: StageLR, warmup: int = 0) -> float:
    """optim.schedule=staged after the warmup: each stage holds the factor it starts with, or decays it linearly
    to its ratio by its last step (from the warmup's end, in a stage the warmup reaches into); steps past the
    horizon keep the factor it reaches."""
    step = min(step, horizon)
    level, first = 1.0, 0
    for end, decay_to in stages:
        last = horizon if end is None else end
        if decay_to is not None:
            begin = max(first, warmup)
            if step < last:
                return level + (decay_to - level) * max(0, step - begin) / max(1, last - begin)
            level = decay_to
        elif step < last:
            return level
        first = last
    return level


def lr_multiplier(step: int, cfg: OptimConfig, horizon: int, decay_start: int | None = None,
                  stages: StageLR = ()) -> float:
    """LR factor for the update that follows ``step`` completed steps of a ``horizon``-step schedule:
    linear warmup over ``cfg.warmup_steps``, then ``cfg.schedule``; steps past the horizon keep its
    final factor (``cfg.min_lr_ratio`` for the decaying schedules). ``decay_start``: the step a wsd decay
    starts at (optim.decay_from_stage, resolved); ``stages``: optim.schedule=staged's stages, resolved."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "staged":
        return staged_multiplier(step, horizon, stages, cfg.warmup_steps)
    if cfg.schedule == "wsd":
        decay_steps = cfg.wsd_decay_steps(horizon, decay_start)
        progress = min(1.0, max(0.0, (step - (horizon - decay_steps)) / decay_steps))
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - cfg.warmup_steps) / (horizon - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, horizon: int,
                       decay_start: int | None = None, stages: StageLR = ()) -> LambdaLR:
    """The ``cfg`` schedule over ``horizon`` steps (ConfigError if the warmup does not fit in it)."""
    cfg.check_horizon(horizon, decay_start, stages)
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, horizon, decay_start, stages))
