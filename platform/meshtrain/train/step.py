"""One optimizer step over a rank's micro-batches: forward, loss, backward, clip, guarded step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtrain.distributed.layout import RankLayout
from meshtrain.distributed.parallelize import clip_grad_norm_
from meshtrain.distributed.torch_support import reset_iteration
from meshtrain.model.flops import AttentionWork
from meshtrain.model.llama import Transformer
from meshtrain.model.loss import loss_sum
from meshtrain.train.guard import StepGuard
from meshtrain.train.pipeline_step import PipelineSchedule
from meshtrain.train.profiling import region


def _sum_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class GroupReduction(Protocol):
    """A sum over groups of ranks that each train a share of the step's samples (the live replica
    groups of fault_tolerance.mode=replica), applied before the guard sees the step."""

    @property
    def groups(self) -> int: ...

    def reduce(self, parameters: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> bool:
        """Sum the gradients and the loss sum over the groups; False when the step must not be applied."""
        ...


@dataclass
class StepOutput:
    """One optimizer step, still on the device: read only at logged steps."""

    loss_sum: torch.Tensor  # summed over every target token of the global batch (all ranks)
    grad_norm: torch.Tensor  # global, before clipping
    tokens: int  # target tokens of the global batch


def _deferrable_hsdp(model: Transformer, micro_batches: int, layout: RankLayout, device: torch.device) -> FSDPModule | None:
    """The model when its replicate-dim gradient all-reduce can wait for the last micro-batch: an
    FSDP2 root whose mesh (``layout.plan``) has more than one replica.

    ``set_requires_all_reduce(False)`` keeps each micro-batch's reduce-scatter and sums its fp32
    output in one buffer per FSDP unit, the size of the sharded gradient that exists anyway, so
    memory stays as it was. (``set_requires_gradient_sync(False)`` would skip the reduce-scatter too,
    but keep every unit's unsharded gradient, shard-size times larger, for the whole step.)
    Not under CPU offload (parameters on the host): the buffer stays on ``device``, where offload keeps
    no gradients.
    """
    if micro_batches < 2 or not isinstance(model, FSDPModule) or layout.plan.replicate < 2:
        return None
    param = next(model.parameters(), None)
    return model if param is not None and param.device == device else None


def _abandon_deferred_reduction(model: FSDPModule) -> None:
    """After a micro-batch raised: all-reduce again, and drop the partially accumulated gradient,
    which ``zero_grad`` cannot reach and the next step's all-reduce would otherwise include."""
    model.set_requires_all_reduce(True)
    reset_iteration(model)


def train_step(
    model: Transformer,
    guard: StepGuard,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    layout: RankLayout,
    grad_clip: float,
    defer_all_reduce: bool = True,
    attention_work: AttentionWork | None = None,
    reduction: GroupReduction | None = None,
    pipeline: PipelineSchedule | None = None,
) -> StepOutput | None:
    """One optimizer step over this rank's micro-batches, skipped by ``guard`` when it goes bad.

    The loss is the mean over every target token of the global batch. Each micro-batch contributes
    its token-summed loss scaled by ``gradient_ranks / global_tokens``: FSDP averages gradients over
    ``layout.gradient_ranks`` ranks, so the result is the gradient of the global mean. Packed windows have no
    ignored targets and every rank holds the same shapes, so the global token count follows from the
    shapes, with no collective or device sync. The loss sum is reduced over the ranks every step
    (one scalar all-reduce, no host sync), so every rank's guard sees the same global loss.

    With HSDP and ``defer_all_reduce``, gradients are all-reduced over the replicate dim once, in the
    last micro-batch's backward, instead of after every micro-batch (see ``_deferrable_hsdp``).

    ``attention_work`` (when given) counts the (query, key) pairs each micro-batch's forward attends.

    ``reduction``: the groups of ranks that each hold a share of the step's samples (the live replica
    groups). Gradients and the loss sum are summed over them before the guard sees them; None is
    returned when the reduction says not to apply the step (the caller trains it again).

    With tensor or context parallel, the gradient ranks are replicate x shard x context (context peers
    hold different tokens of the same samples); the loss sums are added over ``layout.loss_group``
    (not over TP peers, which hold the same sum).

    ``pipeline``: this rank's pipeline stages (parallel.pipeline > 1), which run the micro-batches through
    their schedule; the loss sum then comes from the last stage's ranks and the gradient norm adds every
    stage's squares.
    """
    device = micro_batches[0][1].device
    gradient_ranks = layout.gradient_ranks
    groups = reduction.groups if reduction is not None else 1
    global_tokens = sum(model.local_targets(targets).numel() for _, targets in micro_batches) * gradient_ranks * groups
    scale = gradient_ranks / global_tokens
    if attention_work is not None:
        for inputs, _ in micro_batches:
            attention_work.count_tokens(inputs, model.document_eos, model.context_parallel)
    if pipeline is not None:
        with region("pipeline"):
            total = pipeline.run(micro_batches, scale)
    else:
        hsdp = _deferrable_hsdp(model, len(micro_batches), layout, device) if defer_all_reduce else None
        total = _forward_backward(model, micro_batches, scale, hsdp)
    total = _sum_over_ranks(total, layout.loss_group)
    if reduction is not None:
        with region("replica sum"):
            applied = reduction.reduce(list(model.parameters()), total)
        if not applied:
            guard.optimizer.zero_grad(set_to_none=True)
            return None
    with region("grad clip"):
        grad_norm = clip_grad_norm_(list(model.parameters()), grad_clip,
                                    pipeline.group if pipeline is not None else None)
    with region("optimizer step"):
        guard.step(guard.check(total / global_tokens, grad_norm))
        guard.optimizer.zero_grad(set_to_none=True)
    return StepOutput(total, grad_norm, global_tokens)


def _forward_backward(model: Transformer, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                      hsdp: FSDPModule | None) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn, its summed loss times ``scale``; the summed loss.
    ``hsdp``: the model when its replicate all-reduce waits for the last micro-batch."""
    total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][1].device)
    last = len(micro_batches) - 1
    try:
        for index, (inputs, targets) in enumerate(micro_batches):
            if hsdp is not None:
                hsdp.set_requires_all_reduce(index == last)
            with region("forward"):
                logits = model(inputs)
            with region("loss"):
                summed = loss_sum(logits, model.local_targets(targets))
            del logits  # the loss keeps what its backward needs
            with region("backward"):
                (summed * scale).backward()
            total += summed.detach()
    except BaseException:
        if hsdp is not None:
            _abandon_deferred_reduction(hsdp)
        raise
    return total
