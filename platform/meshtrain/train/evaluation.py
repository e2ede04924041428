"""Validation loss: the mean next-token loss over a fixed held-out set, the same on any mesh."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtrain.data import HeldOutSamples
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.train.records import LoopOutputs


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


class Evaluation:
    """The loop's evaluations: every ``interval`` steps and after the last, on a fixed held-out set."""

    def __init__(
        self,
        model: torch.nn.Module,
        validation: HeldOutSamples | None,
        interval: int | None,
        batches: int,
        global_batch_size: int,
        micro_batch_size: int,
        layout: WorkerLayout,
        device: torch.device,
        outputs: LoopOutputs,
        beat: Callable[[str], None],
    ) -> None:
        self.model, self.validation, self.interval = model, validation, interval
        self.micro_batch_size, self.layout, self.device, self.outputs, self.beat = (
            micro_batch_size, layout, device, outputs, beat
        )
        self.samples = 0
        if interval is not None and validation is not None:
            self.samples = validation_samples(len(validation), batches, global_batch_size)

    def due(self, step: int, last: bool) -> bool:
        return bool(self.samples) and bool(self.interval) and (step % self.interval == 0 or last)

    def run(self, step: int) -> float:
        """The validation loss at ``step``, recorded as an ``eval`` event."""
        assert self.validation is not None
        self.beat(f"evaluating at step {step}")
        started = time.perf_counter()
        self.model.eval()
        loss = evaluate(
            self.model, self.validation, self.samples, self.micro_batch_size,
            self.layout.world_rank, self.layout.world_size, self.device,
        )
        self.model.train()
        self.outputs.evaluated({
            "event": "eval", "step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "samples": self.samples, "seconds": time.perf_counter() - started,
        })
        self.beat(f"training after the evaluation at step {step}")
        return loss
