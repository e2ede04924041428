"""Validation loss: the mean next-token loss over a fixed held-out set, overall and per source, the same on any mesh."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtrain.config import OVERALL_LABEL
from meshtrain.data import IGNORE_INDEX, ValidationSet, ValidationWindow
from meshtrain.distributed.layout import RankLayout
from meshtrain.model.llama import Transformer
from meshtrain.model.loss import loss_sum
from meshtrain.observe.run_folder import EvalRecord, SourceEval
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.pipeline_step import PipelineSchedule
from meshtrain.train.records import LoopOutputs, TrainResult


def validation_samples(available: int, batches: int, global_batch_size: int) -> int:
    """How many held-out samples one evaluation reads: ``batches`` global batches, or as many whole
    global batches as the held-out set holds. A whole number of global batches divides evenly over
    every data-parallel degree the run can have, so every rank runs the same number of forwards
    (FSDP's all-gathers need that) and the set does not depend on the mesh."""
    return min(batches, available // global_batch_size) * global_batch_size


def evaluate(
    model: Transformer,
    validation: ValidationSet,
    chosen: Sequence[ValidationWindow],
    micro_batch_size: int,
    layout: RankLayout,
    device: torch.device,
    pipeline: PipelineSchedule | None = None,
) -> dict[str, tuple[float, int]]:
    """Mean token loss and scored tokens over the ``chosen`` held-out windows, split over the
    data-parallel ranks of ``layout``: per source, and overall under ``OVERALL_LABEL`` (every scored
    token alike). ``pipeline``: this rank's pipeline stages, which run the windows (the last stage's ranks
    score them)."""
    parts = len(validation.names)
    totals = torch.zeros(2, parts, dtype=torch.float64, device=device)  # per source: loss sum, scored tokens

    def score(logits: torch.Tensor, targets: torch.Tensor, sources: torch.Tensor) -> None:
        local_targets = model.local_targets(targets)  # this rank's share under context parallel
        for part in sources.unique().tolist():
            rows = sources == part
            targets = local_targets[rows]
            totals[0, part] += loss_sum(logits, targets, rows).double()
            totals[1, part] += (targets != IGNORE_INDEX).sum()

    batches = validation.batches(chosen, micro_batch_size, layout.data_rank, layout.data_ranks, device)
    with torch.no_grad():
        if pipeline is None:
            for batch in batches:
                score(model(batch.inputs), batch.targets, batch.sources)
        else:
            mine = list(batches)
            targets, sources = (torch.cat([getattr(batch, name) for batch in mine]) for name in ("targets", "sources"))
            pipeline.score([batch.inputs for batch in mine],
                           lambda logits, rows: score(logits, targets[rows], sources[rows]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals, group=layout.loss_group)  # TP peers hold the same sums
    # Units that keep their parameters gathered after forward (for backward) are resharded here:
    # no backward follows an evaluation.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    sums, counts = totals.cpu().tolist()

    def mean(loss_sum: float, tokens: float) -> tuple[float, int]:
        return (loss_sum / tokens if tokens else math.nan), int(tokens)

    losses = {name: mean(sums[k], counts[k]) for k, name in enumerate(validation.names)}
    losses[OVERALL_LABEL] = mean(sum(sums), sum(counts))
    return losses


class Evaluation(LoopPart):
    """The loop's evaluations: every ``interval`` steps and after the last, on a fixed held-out set;
    the last one's losses go into ``result``."""

    def __init__(
        self,
        model: Transformer,
        validation: ValidationSet | None,
        interval: int | None,
        batches: int,
        global_batch_size: int,
        micro_batch_size: int,
        layout: RankLayout,
        device: torch.device,
        outputs: LoopOutputs,
        beat: Callable[[str], None],
        result: TrainResult,
        pipeline: PipelineSchedule | None = None,
    ) -> None:
        self.model, self.validation, self.interval, self.pipeline = model, validation, interval, pipeline
        self.micro_batch_size, self.layout, self.device, self.outputs, self.beat = (
            micro_batch_size, layout, device, outputs, beat
        )
        self.batches, self.global_batch_size, self.result = batches, global_batch_size, result
        self._chosen: list[ValidationWindow] | None = None  # chosen at the first evaluation (it reads the data)
        self.last_by_source: dict[str, float | None] = {}  # the last evaluation's loss per source

    @property
    def chosen(self) -> list[ValidationWindow]:
        """The windows every evaluation reads: whole global batches of the set's selection."""
        if self._chosen is None:
            assert self.validation is not None
            wanted = self.batches * self.global_batch_size
            selected = self.validation.select(wanted)
            self._chosen = selected[: validation_samples(len(selected), self.batches, self.global_batch_size)]
            if not self._chosen and self.layout.writes_records:
                print(
                    f"[meshtrain] warning: no evaluation: the held-out data has {len(selected)} windows with whole "
                    f"documents, fewer than one global batch ({self.global_batch_size}); raise data.validation.fraction "
                    "or data.validation.span_tokens (documents longer than a span are never held out whole)",
                    flush=True,
                )
        return self._chosen

    def after_step(self, done: StepDone) -> bool:
        if self.due(done.step, done.last):
            self.result.eval_loss = self.run(done.step)
            self.result.eval_loss_by_source = self.last_by_source
        return True

    def due(self, step: int, last: bool) -> bool:
        if self.validation is None or not self.interval or not (step % self.interval == 0 or last):
            return False
        return bool(self.chosen)

    def run(self, step: int) -> float:
        """The validation loss at ``step``, recorded as an ``eval`` event."""
        assert self.validation is not None
        self.beat(f"evaluating at step {step}")
        started = time.perf_counter()
        self.model.eval()
        losses = evaluate(self.model, self.validation, self.chosen, self.micro_batch_size, self.layout, self.device,
                          self.pipeline)
        self.model.train()
        loss, tokens = losses.pop(OVERALL_LABEL)
        self.last_by_source = {name: None if math.isnan(value) else value for name, (value, _) in losses.items()}
        record = EvalRecord(
            step=step, loss=loss, perplexity=math.exp(min(loss, 700.0)), samples=len(self.chosen), tokens=tokens,
            sources={name: SourceEval(loss=self.last_by_source[name], tokens=count) for name, (_, count) in losses.items()},
            seconds=time.perf_counter() - started,
        )
        self.outputs.evaluated(record)
        self.beat(f"training after the evaluation at step {step}")
        return loss
