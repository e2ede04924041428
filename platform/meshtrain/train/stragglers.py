"""Stragglers: one slow GPU (throttled clocks, a failing HBM stack) slows every rank of a synchronous
job, because every collective waits for it. Here each rank times its own compute and, at logged
steps, the ranks compare.

What is timed is the forward of every transformer block, from just after FSDP's pre-forward hook
(which waits for the block's all-gather) to just before its post-forward hook: the block's compute,
without the collective waits in which fast ranks sit idle for the slow one. On CUDA the two ends are
events on the compute stream (the stream waits for the all-gather before the first one), read at
logged steps, which synchronize anyway; on CPU they are host times. Backward costs about twice the
forward on every rank alike, so the forward is a fair sample of a rank's speed.

At each logged step the ranks all-gather their mean compute time per step. A rank's slowdown is its
time over the median of the others'. A rank whose slowdown stays at least ``metrics.straggler_factor``
for ``metrics.straggler_patience`` logged steps in a row is a straggler: one ``straggler`` record in
metrics.jsonl (and a job-log line) naming the rank, its node and its slowdown, and the gauges
``meshtrain_rank_slowdown_ratio`` and ``meshtrain_straggler`` on that rank until it recovers.
A slow network link is not seen here: it slows the collectives, not a rank's compute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.observe.run_folder import StragglerRecord
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.records import LoopOutputs


class ComputeTimer:
    """Forward compute time of ``blocks`` on this rank, collective waits excluded, as the whole model's
    ``model_blocks`` would take at that pace (pipeline ranks hold different numbers of blocks; their speeds
    compare per block)."""

    def __init__(self, blocks: Iterable[nn.Module], device: torch.device, model_blocks: int | None = None) -> None:
        blocks = list(blocks)
        self._scale = (model_blocks / len(blocks)) if model_blocks and blocks else 1.0
        self.cuda = device.type == "cuda"
        self._host_seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._open: dict[int, Any] = {}
        self._handles = []
        # Compiled blocks (parallel.compile) trace their hooks too: these run eagerly, around the graph.
        begin, end = torch.compiler.disable(self._begin), torch.compiler.disable(self._end)
        for block in blocks:
            self._handles.append(block.register_forward_pre_hook(begin))  # after FSDP's (prepended) pre-hook
            self._handles.append(block.register_forward_hook(end, prepend=True))  # before FSDP's post-hook

    def _begin(self, module: nn.Module, _args: Any) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[id(module)] = event
        else:
            self._open[id(module)] = time.perf_counter()

    def _end(self, module: nn.Module, _args: Any, _output: Any) -> None:
        start = self._open.pop(id(module), None)
        if start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        else:
            self._host_seconds += time.perf_counter() - start

    def take(self) -> float:
        """Seconds of block compute since the last call, as the whole model would take (a device sync on CUDA)."""
        if self.cuda:
            events, self._events = self._events, []
            if events:
                events[-1][1].synchronize()
            return sum(start.elapsed_time(end) for start, end in events) / 1000 * self._scale
        seconds, self._host_seconds = self._host_seconds, 0.0
        return seconds * self._scale

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def slowdowns(times: list[float]) -> list[float]:
    """Each rank's time over the median of the other ranks' (1.0 alone, or when the others took 0)."""
    result = []
    for rank, own in enumerate(times):
        others = times[:rank] + times[rank + 1 :]
        median = statistics.median(others) if others else 0.0
        result.append(own / median if median > 0 else 1.0)
    return result


class Streaks:
    """Which of several (ranks, or replica groups) stay slow: each one's run of logged steps at or above
    ``factor`` times the median of the others, and those whose run reached ``patience``."""

    def __init__(self, factor: float, patience: int) -> None:
        self.factor, self.patience = factor, patience
        self.runs: dict[int, int] = {}
        self.flagged: set[int] = set()

    def update(self, ratios: dict[int, float]) -> list[int]:
        """Each one's slowdown at a logged step; the ones that just became stragglers."""
        self.runs = {key: self.runs.get(key, 0) + 1 if ratio >= self.factor else 0 for key, ratio in ratios.items()}
        self.flagged &= {key for key, run in self.runs.items() if run}
        new = [key for key, run in self.runs.items() if run >= self.patience and key not in self.flagged]
        self.flagged.update(new)
        return new


class StragglerWatch(LoopPart):
    """Compares the ranks' compute at logged steps and names a rank that stays slow."""

    def __init__(
        self,
        timer: ComputeTimer,
        factor: float,
        patience: int,
        rank: int,
        node: str,
        outputs: LoopOutputs,
        group: Any,
        set_gauges: Callable[[float, float, bool], None] | None = None,
        on_straggler: Callable[[StragglerRecord], None] | None = None,
        replicas: Callable[[int, float, str], None] | None = None,
    ) -> None:
        self.timer, self.factor, self.patience = timer, factor, patience
        self.rank, self.node, self.outputs, self.group = rank, node, outputs, group
        self.set_gauges, self.on_straggler = set_gauges, on_straggler
        self.streaks = Streaks(factor, patience)
        self.replicas = replicas  # replica mode: hears the group's compute per step (and slowest node) at each logged step
        self._steps = 0

    def step_done(self) -> None:
        self._steps += 1

    def after_step(self, done: StepDone) -> bool:
        self.step_done()
        if done.logged:
            self.at_logged_step(done.step)
        return True

    def at_logged_step(self, step: int) -> None:
        per_step = self.timer.take() / max(self._steps, 1)
        self._steps = 0
        mine = (per_step, self.node)
        if self.group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        self.observe(step, gathered)
        if self.replicas is not None:  # the group steps at its slowest rank's pace
            self.replicas(step, *max(gathered))

    def observe(self, step: int, gathered: list[tuple[float, str]]) -> None:
        """Every rank's (compute seconds per step, node) at a logged step: update the streaks, report
        a rank that became a straggler, and set this rank's gauges."""
        times = [seconds for seconds, _ in gathered]
        ratios = slowdowns(times)
        for rank in self.streaks.update(dict(enumerate(ratios))):
            self._report(step, rank, gathered[rank][1], ratios[rank], times)
        if self.set_gauges is not None:
            self.set_gauges(times[self.rank], ratios[self.rank], self.rank in self.streaks.flagged)

    def _report(self, step: int, rank: int, node: str, ratio: float, times: list[float]) -> None:
        others = times[:rank] + times[rank + 1 :]
        record = StragglerRecord(
            step=step, rank=rank, node=node, slowdown=ratio, compute_s=times[rank],
            median_others_s=statistics.median(others), logged_steps=self.streaks.runs[rank],
        )
        self.outputs.emit(record)  # the driver prints it in the job log, from metrics.jsonl
        if self.on_straggler is not None:
            self.on_straggler(record)

    def close(self) -> None:
        self.timer.close()
