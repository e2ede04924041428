"""A per-worker watchdog: a worker that stops making progress exits, so Ray restarts the group.

A rank stuck in a collective (a peer died without its process exiting, a network partition, a
deadlock) would otherwise wait for the process group's timeout (``scaling.timeout_s``, 30 minutes
by default) while every other rank waits for it. The loop reports progress at every step and
around checkpoint saves and evaluations; a thread checks that the last report is younger than
``run.hang_timeout_s``. Blocking collectives release the GIL, so the thread runs while the main
thread is stuck. The watchdog is armed after the first step, which may compile.

Bytes written into checkpoint storage count as progress too (``progress``, from
:mod:`meshtrain.checkpoint.write_progress`): a save of hundreds of GB that keeps writing, in the
foreground at the last step or in the background while the next save waits for it, is never taken
for a hang, however long it takes; one whose writes stop is.

A wait bounded by its own timeout (the replica quorum, which waits for a hung replica group until that
group's own watchdog ends it) is ``excused``: not a hang, however long. ``on_fire`` runs first when the
watchdog fires: a replica group's worker stops its heartbeats there, so the other groups go on without
waiting for the diagnosis and the exit.

Before the process exits, ``report`` (a :class:`~meshtrain.train.hangs.HangReport`, when the flight
recorder is on) writes which collectives this rank was in and, on the lowest rank that reports,
prints the line naming the collective the group is stuck in and the ranks that never entered it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from meshtrain.train.hangs import HangReport, watch_period_s
from meshtrain.train.loop import LoopPart, StepStart


def _exit_worker(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # the main thread may be blocked inside a collective: only leaving the process ends it


class HangWatchdog:
    def __init__(
        self,
        timeout_s: float,
        rank: int,
        on_hang: Callable[[str], None] | None = None,
        progress: Callable[[], int] | None = None,
        report: HangReport | None = None,
        on_fire: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.on_hang = on_hang or _exit_worker
        self.progress, self.report, self.on_fire = progress, report, on_fire
        self._excused = False
        self._progress_seen = progress() if progress is not None else 0
        self._last = time.monotonic()
        self._doing = "starting"
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtrain-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, doing: str, arm: bool = False) -> None:
        """Progress: ``doing`` names what comes next (shown if it never finishes)."""
        self._last, self._doing = time.monotonic(), doing
        self._armed = self._armed or arm

    @contextlib.contextmanager
    def excused(self, doing: str) -> Iterator[None]:
        """``doing`` waits under its own timeout: the watchdog does not fire during it, and the clock
        restarts after it."""
        self._doing, self._excused = doing, True
        try:
            yield
        finally:
            self._excused = False
            self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(watch_period_s(self.timeout_s)):
            if self.progress is not None:
                seen = self.progress()
                if seen != self._progress_seen:  # a checkpoint write moved on
                    self._progress_seen, self._last = seen, time.monotonic()
            silent = time.monotonic() - self._last
            if self._armed and not self._excused and silent > self.timeout_s:
                if self.on_fire is not None:
                    try:
                        self.on_fire()
                    except Exception as exc:  # nothing may keep the worker from exiting
                        sys.stderr.write(f"[meshtrain] rank {self.rank}: could not leave the replica quorum ({exc!r})\n")
                if self.report is not None:
                    try:
                        self.report(self._doing, silent)
                    except Exception as exc:  # the diagnosis must never keep the worker from exiting
                        sys.stderr.write(f"[meshtrain] rank {self.rank}: could not report the hang ({exc!r})\n")
                self.on_hang(
                    f"[meshtrain] rank {self.rank}: no progress for {silent:.0f}s while {self._doing} "
                    f"(run.hang_timeout_s={self.timeout_s:g}); exiting so Ray restarts the worker group "
                    "from the last committed checkpoint"
                )
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Heartbeat(LoopPart):
    """What this rank is doing, told to its watchdog (``run.hang_timeout_s``; none: nothing is watched).
    Every step beats it; the parts that wait (saves, evaluations, quorums) beat or are excused here too.
    The watchdog is attached last, once the rest of the loop is built, so a setup that fails leaves no
    thread behind."""

    def __init__(self) -> None:
        self.watchdog: HangWatchdog | None = None

    def beat(self, doing: str, arm: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(doing, arm)

    def excused(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return self.watchdog.excused(doing) if self.watchdog is not None else contextlib.nullcontext()

    def before_step(self, start: StepStart) -> None:
        self.beat(f"training step {start.step}", arm=not start.first)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
