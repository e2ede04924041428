"""Logged steps: every ``train.log_every`` steps (and the last), one record of the interval's mean step
time, throughput, data wait and model FLOPs per token, where the guard is read too."""

from __future__ import annotations

import time
from collections.abc import Callable

from meshtrain.checkpoint.state import Progress
from meshtrain.config import ModelArgs
from meshtrain.model.flops import AttentionWork, ModelFlops
from meshtrain.observe.run_folder import TrainRecord
from meshtrain.train.guard import BadStepLimit
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.records import LoopOutputs


class StepLog(LoopPart):
    def __init__(
        self,
        global_batch_size: int,
        world_size: int,
        progress: Progress,
        bad_steps: BadStepLimit,
        outputs: LoopOutputs,
        records: list[TrainRecord],
        attention: tuple[AttentionWork, ModelArgs] | None = None,
        replicas: bool = False,
        stage_of: Callable[[int], str | None] | None = None,
    ) -> None:
        """``attention``: what the training steps count of the attention they compute, and the model's
        shape, for the record's FLOPs per token; None leaves them out. ``replicas``: replica mode, whose
        records say how long the steps waited for the other replica groups. ``stage_of``: data.stages'
        stage of a global sample, named in each record."""
        self.global_batch_size, self.world_size = global_batch_size, world_size
        self.progress, self.bad_steps, self.outputs, self.records = progress, bad_steps, outputs, records
        self.attention, self.replicas, self.stage_of = attention, replicas, stage_of

    def at_start(self) -> None:
        self.started = self.interval_start = time.perf_counter()
        self.interval_steps, self.interval_wait, self.interval_replica_wait = 0, 0.0, 0.0
        if self.attention is not None:
            self.attention[0].take()  # what forwards before the loop counted is not the first interval's

    def rewound(self, step: int) -> None:
        """A rollback: the next record's interval starts now (the reload is not step time)."""
        self.interval_start = time.perf_counter()
        self.interval_steps, self.interval_wait, self.interval_replica_wait = 0, 0.0, 0.0
        if self.attention is not None:
            self.attention[0].take()

    def _flops(self) -> tuple[float, float] | None:
        """The interval's training FLOPs per token (MFU's numerator per token): ``flops_per_token`` with
        attention over the (query, key) pairs its masks allowed, counted exactly (causal, and within each
        document under model.document_mask); ``flops_per_token_full_attention`` with every query against
        the whole window, the PaLM / torchtitan convention that other frameworks' MFU uses."""
        if self.attention is None:
            return None
        work, args = self.attention
        attended = work.take()
        if attended is None:
            return None
        keys_per_query, window = attended
        flops = ModelFlops.of(args)
        return flops.per_token(keys_per_query), flops.per_token(window)

    def waited_for_replicas(self, seconds: float) -> None:
        """fault_tolerance.mode=replica: time this step spent in its quorum (healing a joining peer
        included) or in an attempt a failed peer left uncommitted."""
        self.interval_replica_wait += seconds

    def after_step(self, done: StepDone) -> bool:
        """Count the step, and at a logged step write its record; False when the guard says stop."""
        step, output, last = done.step, done.output, done.last
        self.interval_steps += 1
        self.interval_wait += done.data_wait_s
        if not done.logged:
            return True
        # The step's end, on both clocks: the record's time is when its interval ended, not when the record
        # was built (reading the loss and the guard waits for the device), so the driver's goodput account
        # sees consecutive intervals meet instead of overlapping.
        now, ended = time.perf_counter(), time.time()
        step_time = (now - self.interval_start) / self.interval_steps
        allowed = self.bad_steps.check(step) is not None
        flops = self._flops()
        record = TrainRecord(
            step=step,
            loss=output.loss_sum.item() / output.tokens,
            lr=done.lr,
            grad_norm=output.grad_norm.item(),
            tokens=self.progress.tokens,
            tokens_per_s=output.tokens / step_time,
            step_time_s=step_time,
            data_wait_s=self.interval_wait / self.interval_steps,  # mean per step, this rank waiting for its batch
            interval_steps=self.interval_steps,  # the steps since the previous record, which step_time_s averages
            elapsed_s=now - self.started,
            skipped_steps=self.progress.skipped_steps,
            world_size=self.world_size,
            time=ended,
            # The global samples the step read: the same on any number of ranks.
            samples=[self.progress.data_position - self.global_batch_size, self.progress.data_position],
            flops_per_token=flops[0] if flops is not None else None,
            flops_per_token_full_attention=flops[1] if flops is not None else None,
            replica_wait_s=self.interval_replica_wait / self.interval_steps if self.replicas else None,
            replicas=done.groups if self.replicas else None,
            stage=self.stage_of(self.progress.data_position - 1) if self.stage_of is not None else None,
        )
        self.records.append(record)
        self.outputs.logged(record, self.world_size, last or not allowed)
        self.interval_start, self.interval_steps, self.interval_wait, self.interval_replica_wait = now, 0, 0.0, 0.0
        return allowed
