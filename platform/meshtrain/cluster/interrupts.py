"""Ctrl-C and ``ray job stop`` on the driver: the workers save where they are, then the run ends.

The first SIGINT (Ctrl-C) or SIGTERM (``ray job stop``; Ray waits ``RAY_JOB_STOP_WAIT_TIME_S``,
3 s by default, before it kills the driver) writes a stop request into the run directory; every
rank sees it within half a second, the ranks save at the next step boundary (within
``run.preemption_save_s``) and finish, and the driver exits 130 naming the committed step. A
second signal stops the driver at once. Without preemption handling (``run.preemption_save_s``
null) the workers cannot save on notice, so the first signal stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from meshtrain.observe.run_folder import StopRequest

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DriverInterrupts:
    """While entered (in the main thread), the first interrupt asks the workers to save and stop."""

    def __init__(self, request: StopRequest, preemption_save_s: float | None) -> None:
        self.request, self.preemption_save_s = request, preemption_save_s
        self.received: str | None = None  # the first signal's name
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DriverInterrupts:
        self.request.clear()  # a request left by an earlier launch is for its workers only
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None or self.preemption_save_s is None:
            raise KeyboardInterrupt(name)
        self.received = name
        self.request.write(f"{name} to the driver")
        sys.stderr.write(
            f"[meshtrain] {name}: the workers save at the next step boundary (within run.preemption_save_s="
            f"{self.preemption_save_s:g}s) and stop; interrupt again to stop at once without saving\n"
        )
        sys.stderr.flush()

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        self.request.clear()
