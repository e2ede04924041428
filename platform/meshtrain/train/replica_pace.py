"""How long a replica group waits for its peers in a step before it declares the late ones hung.

The bound comes from the run's own steps: ``fault_tolerance.hang_factor`` times the median duration of
this group's recent committed steps (from the quorum to the commit, the wait for slower peers
included, so a peer that is slow but steady raises the bound with it), and never less than
``fault_tolerance.hang_floor_s``. Until a few steps are measured (the first compiles) there is no
bound: the collective's own timeout (``fault_tolerance.timeout_s``) applies. A group that joins takes
its peer's recent durations with the rest of its state (``train/healing.py``): it has measured nothing
yet, and without them a peer frozen in its first steps would hold it for the collective's timeout.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 20  # recent steps the median is taken over
MEASURED_BEFORE_BOUND = 3


class StepPace:
    def __init__(self, factor: float, floor_s: float) -> None:
        self.factor, self.floor_s = factor, floor_s
        self._durations: deque[float] = deque(maxlen=WINDOW)

    def committed(self, seconds: float) -> None:
        self._durations.append(seconds)

    def recent(self) -> list[float]:
        """The measured durations, oldest first (what a joining group takes over)."""
        return list(self._durations)

    def take_over(self, durations: list[float]) -> None:
        """A peer's recent durations in place of this group's own (it just joined, from that peer)."""
        self._durations.clear()
        self._durations.extend(durations)

    def median_s(self) -> float | None:
        return statistics.median(self._durations) if len(self._durations) >= MEASURED_BEFORE_BOUND else None

    def bound_s(self) -> float | None:
        """The longest a step may take before its late peers are declared hung (None: not measured yet)."""
        median = self.median_s()
        return None if median is None else max(self.floor_s, self.factor * median)
