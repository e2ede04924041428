"""Python garbage collection at fixed steps instead of whenever the allocator's counters say so.

An automatic collection pauses one rank at a random moment, and every other rank then waits for it
at the next collective; with many ranks some rank is almost always collecting. With the automatic
collector off, every rank collects at the same steps, so the pauses line up.
"""

from __future__ import annotations

import gc

from meshtrain.train.loop import LoopPart, StepStart


class ScheduledCollection(LoopPart):
    def __init__(self, every: int) -> None:
        self.every = every
        self.was_enabled = gc.isenabled()
        if every:
            gc.disable()
            gc.collect()  # start clean: setup leaves many short-lived objects behind

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)  # the young generations; the long-lived model objects are not rescanned

    def before_step(self, start: StepStart) -> None:
        self.step(start.step)

    def close(self) -> None:
        if self.every and self.was_enabled:
            gc.enable()
