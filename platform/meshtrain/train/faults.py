"""Fault injection for tests and demos: a worker that kills itself once with SIGKILL, hangs, freezes, turns
NaN or computes slowly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtrain.config import FaultConfig
from meshtrain.train.loop import LoopPart, StepStart


def maybe_kill_self(fault: FaultConfig, rank: int, step: int, during_checkpoint: bool, marker_dir: Path) -> None:
    """SIGKILL this process (``fault.kind=hang``: sleep forever; ``freeze``: SIGSTOP, and SIGCONT from a
    helper process ``fault.freeze_s`` later) if ``fault`` names this rank and step, unless it already happened.

    A marker file in the run directory records the fault, so the restarted worker passes the same
    step without failing again.
    """
    named = (fault.kill_rank, fault.at_step, fault.during_checkpoint)
    if fault.kind in ("nan", "slow") or named != (rank, step, during_checkpoint):
        return
    marker = marker_dir / f"killed-rank{rank}-step{step}"
    if marker.exists():
        return
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{os.getpid()}\n")
    where = "while its checkpoint is being written" if during_checkpoint else "before the step"
    if fault.kind == "hang":
        sys.stdout.write(f"[meshtrain] fault injection: rank {rank} hangs at step {step} {where}\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
    if fault.kind == "freeze":
        sys.stdout.write(f"[meshtrain] fault injection: rank {rank} freezes for {fault.freeze_s:g}s at step {step} {where}\n")
        sys.stdout.flush()
        subprocess.Popen(["sh", "-c", f"sleep {fault.freeze_s}; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    sys.stdout.write(f"[meshtrain] fault injection: rank {rank} sends itself SIGKILL at step {step} {where}\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_poison_outputs(fault: FaultConfig, rank: int, step: int, model: torch.nn.Module) -> None:
    """``fault.kind=nan``: from ``fault.at_step`` on, this rank's logits are NaN. The loss sum is
    reduced over the ranks and FSDP reduces the gradients, so every rank's step guard sees the step
    go bad, as with a real divergence. Called before each step; a resumed run reaches the step again.
    Under pipeline parallel the rank's stages' outputs are NaN (the loss, on the last stage, follows).
    """
    if fault.kind != "nan" or (fault.kill_rank, fault.at_step) != (rank, step):
        return
    sys.stdout.write(f"[meshtrain] fault injection: rank {rank} computes NaN logits from step {step} on\n")
    sys.stdout.flush()
    for module in getattr(model, "stages", ()) or (model,):
        module.register_forward_hook(lambda _module, _inputs, outputs: outputs * float("nan"))


def maybe_slow_down(fault: FaultConfig, rank: int, node: str, step: int, model: torch.nn.Module) -> None:
    """``fault.kind=slow``: from ``fault.at_step`` on, every transformer block of this rank sleeps
    ``fault.slow_factor - 1`` times its own forward time after computing it, inside the span the
    straggler timer measures, as a throttled GPU would. Its peers wait for it at every collective.
    A slow device stays slow: a group restarted past ``fault.at_step`` on it is slowed from its first step."""
    struck = fault.node == node if fault.node is not None else fault.kill_rank == rank
    if fault.kind != "slow" or not struck or fault.at_step is None or step < fault.at_step:
        return
    if getattr(model, "_slowed_by_fault", False):
        return
    setattr(model, "_slowed_by_fault", True)  # noqa: B010 (a mark on a module, outside its declared attributes)
    sys.stdout.write(f"[meshtrain] fault injection: rank {rank} computes {fault.slow_factor:g}x slower from step {step} on\n")
    sys.stdout.flush()
    started: dict[int, float] = {}

    def begin(module: torch.nn.Module, _args: object) -> None:
        started[id(module)] = time.perf_counter()

    def end(module: torch.nn.Module, _args: object, _output: object) -> None:
        time.sleep((fault.slow_factor - 1) * (time.perf_counter() - started.pop(id(module), time.perf_counter())))

    layers = getattr(model, "layers", None)  # keyed by each block's index in the whole model
    for block in layers.values() if isinstance(layers, torch.nn.ModuleDict) else []:
        block.register_forward_pre_hook(torch.compiler.disable(begin))
        block.register_forward_hook(torch.compiler.disable(end), prepend=True)


@dataclass(frozen=True)
class FaultInjection(LoopPart):
    """The faults ``fault.*`` asks of this rank, at the two points of the loop where they strike:
    before a step (of ``model``), and while a checkpoint is being written."""

    fault: FaultConfig
    rank: int
    marker_dir: Path
    node: str = ""
    model: torch.nn.Module | None = field(default=None, compare=False)

    def before_step(self, start: StepStart) -> None:
        maybe_kill_self(self.fault, self.rank, start.step, False, self.marker_dir)
        if self.model is not None:
            maybe_poison_outputs(self.fault, self.rank, start.step, self.model)
            maybe_slow_down(self.fault, self.rank, self.node, start.step, self.model)

    def while_saving(self, step: int) -> None:
        maybe_kill_self(self.fault, self.rank, step, True, self.marker_dir)
