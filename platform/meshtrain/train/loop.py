"""The training loop's parts: each behaviour of the loop (checkpoints, evaluation, the step log, votes,
faults...) is one object with the hooks it needs, and the loop calls the hooks of every part in the
order ``train.parts.loop_parts`` lists them; it names none of them."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the step imports the parts of the model and the guard; the parts need only its types
    from meshtrain.train.step import GroupReduction, StepOutput


@dataclass
class StepStart:
    """The step about to be trained, as the parts before it settle it: a replica group that joined
    its peers moves ``step`` to theirs and hands the step the ``reduction`` over the live groups."""

    step: int
    first: bool  # the first step of this run of the loop (the watchdog does not time it: it may compile)
    reduction: GroupReduction | None = None


@dataclass(frozen=True)
class StepDone:
    """A step that was applied, as the parts after it see it."""

    step: int
    last: bool  # train.steps reached
    logged: bool  # the step log writes a record at this step
    lr: float  # the learning rate the step was taken with
    output: StepOutput
    data_wait_s: float  # this rank's wait for the step's batch
    groups: int = 1  # replica groups that trained the step (fault_tolerance.mode=replica)


class LoopPart:
    """A behaviour of the loop. Each hook does nothing unless the part overrides it."""

    def at_start(self) -> None:
        """The loop is about to take its first step."""

    def before_step(self, start: StepStart) -> None:
        """Before the step's batch is read."""

    def around_step(self, step: int) -> AbstractContextManager[None]:
        """Wraps the forward, backward and optimizer step."""
        return contextlib.nullcontext()

    def step_abandoned(self, start: StepStart) -> None:
        """The step's reduction was not committed (a replica group failed during it): it is trained again."""

    def after_step(self, done: StepDone) -> bool:
        """After the step was applied; False ends the loop (the parts after this one do not see the step)."""
        return True

    def rewound(self, step: int) -> None:
        """The run went back to the checkpoint of ``step`` (a rollback) and trains on from there."""

    def at_end(self, step: int) -> None:
        """The loop ended without an error at ``step``."""

    def close(self) -> None:
        """Always, last (in the reverse of the parts' order): release threads, hooks and signal routes."""


def _overrides(part: LoopPart, hook: str) -> bool:
    return getattr(type(part), hook) is not getattr(LoopPart, hook)


class LoopParts:
    """The parts in their order; each hook is called only on the parts that define it."""

    def __init__(self, parts: Sequence[LoopPart]) -> None:
        self.parts = list(parts)
        self._start = [p for p in self.parts if _overrides(p, "at_start")]
        self._before = [p for p in self.parts if _overrides(p, "before_step")]
        self._around = [p for p in self.parts if _overrides(p, "around_step")]
        self._abandoned = [p for p in self.parts if _overrides(p, "step_abandoned")]
        self._after = [p for p in self.parts if _overrides(p, "after_step")]
        self._rewound = [p for p in self.parts if _overrides(p, "rewound")]
        self._end = [p for p in self.parts if _overrides(p, "at_end")]

    def at_start(self) -> None:
        for part in self._start:
            part.at_start()

    def before_step(self, start: StepStart) -> StepStart:
        for part in self._before:
            part.before_step(start)
        return start

    def around_step(self, step: int) -> AbstractContextManager[object]:
        if not self._around:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for part in self._around:
            stack.enter_context(part.around_step(step))
        return stack

    def step_abandoned(self, start: StepStart) -> None:
        for part in self._abandoned:
            part.step_abandoned(start)

    def after_step(self, done: StepDone) -> bool:
        return all(part.after_step(done) for part in self._after)

    def rewound(self, step: int) -> None:
        for part in self._rewound:
            part.rewound(step)

    def at_end(self, step: int) -> None:
        for part in self._end:
            part.at_end(step)

    def close(self) -> None:
        for part in reversed(self.parts):
            part.close()
