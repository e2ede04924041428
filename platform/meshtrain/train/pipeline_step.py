"""A step's micro-batches through torch's pipeline schedule (``parallel.pipeline`` > 1).

Each pipeline run takes ``parallel.pipeline_microbatches`` of the rank's micro-batches at once (a step is
whole runs, which the config checks); gradients accumulate over a step's runs as over plain micro-batches.
The loss on the last stage is the summed token loss times the step's scale (data-parallel ranks over the
global batch's target tokens), so the schedule does not scale gradients by its micro-batch count and the
gradient is the global mean's, as without pipeline parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from meshtrain.model.loss import loss_sum
from meshtrain.model.stages import ModelStage


# What a forward-only pass hands each micro-batch's logits to, with the micro-batch's rows.
Scoring = Callable[[torch.Tensor, torch.Tensor], None]


class _ScaledLoss:
    """The schedule's loss function: each micro-batch's summed loss times ``scale``; the sums are kept,
    unscaled, for the step's record."""

    def __init__(self, local_targets: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.local_targets = local_targets
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        summed = loss_sum(logits, self.local_targets(targets))
        self.sums.append(summed.detach())
        return summed * self.scale


class PipelineSchedule:
    """This rank's stages in torch's schedule ``name``, ``microbatches`` micro-batches per run."""

    def __init__(self, stages: Sequence[ModelStage], name: str, num_stages: int, microbatches: int,
                 device: torch.device, group: dist.ProcessGroup,
                 local_targets: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.microbatches = microbatches
        self.holds_first = any(stage.first for stage in stages)
        self.holds_last = any(stage.last for stage in stages)
        self.group = group
        self._loss = _ScaledLoss(local_targets)
        self._stages = [PipelineStage(stage, stage.index, num_stages, device, group=group) for stage in stages]
        torch_stages = self._stages
        cls = torch_schedules.get_schedule_class(name)
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            self._schedule: torch_schedules._PipelineSchedule = cls(
                torch_stages[0], n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            self._schedule = cls(torch_stages, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)

    def run(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward of ``micro_batches`` (whole pipeline runs), each loss scaled by ``scale``;
        the summed loss of this rank's last stage (0 on the other ranks)."""
        self._loss.scale = scale
        sums: list[torch.Tensor] = []
        for start in range(0, len(micro_batches), self.microbatches):
            run = micro_batches[start:start + self.microbatches]
            inputs = torch.cat([inputs for inputs, _ in run])
            targets = torch.cat([targets for _, targets in run])
            self._loss.sums = []
            self._schedule.step(*((inputs,) if self.holds_first else ()),
                                target=targets if self.holds_last else None, tokens=inputs)
            # The run's micro-batches are its last losses: the first run also infers the stages' shapes with
            # a real forward and backward, whose loss the step leaves out (and whose gradients torch clears).
            sums.extend(self._loss.sums[-self.microbatches:] if self.holds_last else [])
        if not sums:
            return torch.zeros((), dtype=torch.float32, device=micro_batches[0][1].device)
        return torch.stack(sums).sum()

    def score(self, inputs: Sequence[torch.Tensor], scoring: Scoring) -> None:
        """Forward only, of ``inputs`` (micro-batches, whole pipeline runs): on the ranks of the last stage,
        ``scoring(logits, rows)`` for each micro-batch, ``rows`` its rows' indices in ``inputs`` concatenated.

        Each micro-batch goes through the stages in order, one at a time (no overlap: an evaluation is a small
        share of a run), through the stages' own sends and receives. Not the schedules' ``eval``: torch
        2.13's V schedules (ZBV, DualPipeV) still hand a backward between their two stages there, and fail.
        """
        stages = sorted(self._stages, key=lambda stage: stage.stage_index)
        held = {stage.stage_index: stage for stage in stages}
        rows = 0
        for start in range(0, len(inputs), self.microbatches):
            run = inputs[start:start + self.microbatches]
            sends: list[list[dist.Work]] = []
            for index, tokens in enumerate(run):
                for stage in stages:
                    if not stage.is_first and stage.stage_index - 1 not in held:
                        torch_schedules._wait_batch_p2p(torch_schedules._batch_p2p(stage.get_fwd_recv_ops(index)))
                    output = stage.forward_one_chunk(index, (tokens,) if stage.is_first else (), {"tokens": tokens})
                    if stage.is_last:
                        scoring(output, torch.arange(rows, rows + tokens.shape[0], device=tokens.device))
                    elif stage.stage_index + 1 in held:
                        held[stage.stage_index + 1].set_local_fwd_input(output, index)
                    else:
                        sends.append(torch_schedules._batch_p2p(stage.get_fwd_send_ops(index)))
                rows += tokens.shape[0]
            for work in sends:
                torch_schedules._wait_batch_p2p(work)
            for stage in stages:
                stage.clear_runtime_states()
