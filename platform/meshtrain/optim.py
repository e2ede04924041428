"""AdamW with decoupled weight decay on matrices, and a warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from meshtrain.config import OptimConfig


# Devices with a fused AdamW kernel (one kernel per parameter group instead of one per op).
_FUSED_ADAMW_DEVICES = {"cuda", "cpu"}


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; norms and other vectors get no weight decay. Fused kernels where the device has them."""
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
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel
    )


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR factor for the update that follows ``step`` completed steps: linear warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
