"""Validation loss: the mean next-token loss over a fixed held-out set, the same on any mesh."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtrain.data import HeldOutSamples
from meshtrain.model import token_cross_entropy_sum


def validation_samples(available: int, batches: int, global_batch_size: int) -> int:
    """How many held-out samples one evaluation reads: ``batches`` global batches, or as many whole
    global batches as the held-out set holds. A whole number of global batches divides evenly over
    every data-parallel degree the run can have, so every rank runs the same number of forwards
    (FSDP's all-gathers need that) and the set does not depend on the mesh."""
    return min(batches, available // global_batch_size) * global_batch_size


def evaluate(
    model: torch.nn.Module,
    validation: HeldOutSamples,
    samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> float:
    """Mean token loss over the first ``samples`` held-out samples, split over the data-parallel ranks."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target tokens
    with torch.no_grad():
        for inputs, targets in validation.batches(samples, micro_batch_size, dp_rank, dp_size, device):
            totals[0] += token_cross_entropy_sum(model(inputs), targets).double()
            totals[1] += targets.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    # Units that keep their parameters gathered after forward (for backward) are resharded here:
    # no backward follows an evaluation.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return float(totals[0] / totals[1]) if totals[1] > 0 else math.nan
