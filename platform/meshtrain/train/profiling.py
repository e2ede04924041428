"""Profiler traces of chosen training steps (``profile.*``).

Each window of ``profile.active_steps`` steps, from ``profile.start_step`` and every
``profile.every`` steps after it, runs under its own ``torch.profiler.profile``; the step before a
window warms the profiler up (a first traced step would carry its start-up cost). When a window
ends, the rank writes a Chrome/Perfetto trace, ``<run dir>/profile/rank<R>.<first step>.pt.trace.json``
(the name TensorBoard's profiler plugin reads: worker ``rank<R>``), and prints one line: its top ops
by self time per step and the trace's path. Outside the windows no profiler exists: with profiling
off the loop pays one comparison per step, between windows a little arithmetic.

Named ranges make the trace read as the loop does: ``ProfilerStep#N`` (N the training step),
``data wait``, ``forward``, ``block I`` (FSDP's gather wait, the block's compute and its reshard),
``attention``, ``loss``, ``backward``, ``grad clip`` and ``optimizer step``. Under ``parallel.compile`` a range
inside a block would break its graph, so there is no ``attention`` range: the block's
``Torch-Compiled Region`` holds attention's kernels.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.hooks import RemovableHandle

from meshtrain.config.observability import ProfileConfig
from meshtrain.observe.run_folder import ProfileRecord
from meshtrain.train.loop import LoopPart, StepStart

_LONGEST_NAME = 60  # characters of an op's name in the summary line (CUDA kernel names run to hundreds)


def region(name: str) -> AbstractContextManager[Any]:
    """A named range in the trace of a profiled step; nothing at all while no profiler records."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class _Ranges:
    """``block I`` around each transformer block's call and ``attention`` around each attention call,
    opened by forward hooks for one window (removed with :meth:`remove`)."""

    def __init__(self, blocks: Sequence[nn.Module], compiled: bool) -> None:
        self._open: dict[int, list[record_function]] = {}
        self._handles: list[RemovableHandle] = []
        for index, block in enumerate(blocks):
            # Prepended, the block's range encloses FSDP's pre-forward hook (the all-gather wait) too.
            self._hook(block, f"block {index}", prepend=True)
            if not compiled:  # hooks inside a compiled block would be traced into its graph and break it
                self._hook(block.get_submodule("attention"), "attention", prepend=False)

    def _hook(self, module: nn.Module, name: str, prepend: bool) -> None:
        def begin(called: nn.Module, _args: Any) -> None:
            record = record_function(name)
            record.__enter__()
            self._open.setdefault(id(called), []).append(record)

        def end(called: nn.Module, _args: Any, _output: Any) -> None:
            opened = self._open.get(id(called))
            if opened:
                opened.pop().__exit__(None, None, None)

        # A compiled block's call runs its own hooks eagerly, around its graph, when they are disabled.
        self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(begin), prepend=prepend))
        self._handles.append(module.register_forward_hook(torch.compiler.disable(end), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for opened in self._open.values():
            for record in reversed(opened):
                record.__exit__(None, None, None)
        self._open.clear()


def top_ops(events: Any, device: bool, count: int, steps: int) -> list[tuple[str, float]]:
    """The ``count`` ops (on a device: kernels) with the most self time in ``events`` (a profiler's
    ``key_averages()``), as (name, milliseconds per step); named ranges are left out."""
    if device:
        timed = [(e.key, e.self_device_time_total) for e in events
                 if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events if not e.is_user_annotation]
    timed.sort(key=lambda item: item[1], reverse=True)
    return [(name, micros / 1000 / steps) for name, micros in timed[:count] if micros > 0]


def summary_line(rank: int, first: int, last: int, device: bool, ops: list[tuple[str, float]], trace: Path) -> str:
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    kind = "device kernels" if device else "CPU ops"
    shown = " | ".join(
        f"{name if len(name) <= _LONGEST_NAME else name[: _LONGEST_NAME - 3] + '...'} {ms:.2f}" for name, ms in ops
    )
    return f"[meshtrain] profile rank {rank} {steps}: top {kind} by self ms/step: {shown}; trace {trace}"


class StepProfiler(LoopPart):
    """This rank's windows of ``profile.*`` in a run of ``last_step`` steps: :meth:`step` as each step
    begins, :meth:`close` when the loop ends (which saves a window the run cut short)."""

    def __init__(
        self, cfg: ProfileConfig, folder: Path, rank: int, last_step: int, blocks: Sequence[nn.Module],
        compiled: bool, device: torch.device, on_record: Callable[[ProfileRecord], None] | None = None,
    ) -> None:
        assert cfg.start_step is not None, "profiling is off: build no StepProfiler"
        self.cfg, self.folder, self.rank, self.last_step = cfg, folder, rank, last_step
        self.on_record = on_record
        self._blocks, self._compiled = blocks, compiled
        self._device = device.type == "cuda"
        self._profiler: profile | None = None
        self._ranges: _Ranges | None = None
        # The traced steps of the window under way (from the step the run began at, if later), and the step under way.
        self._first = self._last = self._step = 0
        self.traces: list[Path] = []

    @classmethod
    def of(
        cls, cfg: ProfileConfig, folder: Path, rank: int, last_step: int, blocks: Sequence[nn.Module],
        compiled: bool, device: torch.device, on_record: Callable[[ProfileRecord], None] | None = None,
    ) -> StepProfiler | None:
        """The profiler of this rank, or None when profiling is off or traces only other ranks.
        ``on_record`` gets a ``profile`` record per window (the summary line's figures)."""
        if not cfg.enabled or (cfg.ranks is not None and rank not in cfg.ranks):
            return None
        return cls(cfg, folder, rank, last_step, blocks, compiled, device, on_record)

    def _window_of(self, step: int) -> int | None:
        """The first step of the window that traces ``step``, if one does."""
        start, every = self.cfg.start_step, self.cfg.every
        assert start is not None
        if step < start or step > self.last_step:
            return None
        first = start if every is None else step - (step - start) % every
        return first if step < first + self.cfg.active_steps else None

    def step(self, step: int) -> None:
        """Step ``step`` begins: end a window that is over, or begin one (warming up before it)."""
        self._step = step
        if self._profiler is not None:
            self._profiler.step()  # past the window's last step, this saves its trace
            if step <= self._last:
                return
            self._end()
        if self._window_of(step + 1) == step + 1:
            self._begin(step, warmup=1, first=step + 1)
        elif self._window_of(step) is not None:  # the run begins inside a window (step 1, a resumed run): no warmup
            self._begin(step, warmup=0, first=step)

    def before_step(self, start: StepStart) -> None:
        self.step(start.step)

    def at_end(self, step: int) -> None:
        self.close()

    def _begin(self, step: int, warmup: int, first: int) -> None:
        window = self._window_of(first)
        assert window is not None
        self._first, self._last = first, min(window + self.cfg.active_steps - 1, self.last_step)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            steps = schedule(skip_first=step, wait=0, warmup=warmup, active=self._last - first + 1, repeat=1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._device else [])
        profiler = profile(
            activities=activities, schedule=steps, on_trace_ready=self._save, record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory, with_stack=self.cfg.with_stack,
        )
        # Numbered from the training step, so that ProfilerStep#N in the trace is step N (as torchtitan does).
        profiler.step_num = step - 1
        profiler.start()
        profiler.step()
        self._profiler = profiler
        self._ranges = _Ranges(self._blocks, self._compiled)

    def _end(self) -> None:
        assert self._profiler is not None and self._ranges is not None
        self._ranges.remove()
        self._profiler.stop()
        self._profiler = self._ranges = None

    def _save(self, profiler: profile) -> None:
        last = min(self._step, self._last)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.{self._first}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        self.traces.append(trace)
        ops = top_ops(profiler.key_averages(), self._device, self.cfg.top, last - self._first + 1)
        # Not print: Ray Train patches it to log the line as well, and the job log would show it twice.
        sys.stdout.write(summary_line(self.rank, self._first, last, self._device, ops, trace) + "\n")
        sys.stdout.flush()
        if self.on_record is not None:
            self.on_record(ProfileRecord(
                step=last, rank=self.rank, first_step=self._first, device="cuda" if self._device else "cpu",
                top_ms_per_step=[[name, ms] for name, ms in ops], trace=str(trace),
            ))

    def close(self) -> None:
        """The loop ended: a window it cut short is saved with the steps it traced."""
        if self._profiler is not None:
            self._end()
