"""Goodput: the share of a launch's wall time that trained steps which count, and where the rest went.

Built from ``metrics.jsonl`` alone, so it reads the same in restart and replica mode and after any
number of restarts. Each train record covers the ``interval_steps`` steps since the writer's previous
record, back to back in time within a worker group's life, so its interval is
``interval_steps * step_time_s`` seconds ending at its ``time``. Inside an interval, the data wait, the
replica-mode waits, evaluation and checkpoint saves that blocked the loop are lost time; the rest is
productive. Time no interval covers is start-up (before the first), restarts (between intervals: a
failure's detection, Ray's restart, the model build and checkpoint load, and the unlogged steps the
failed group had trained) and finishing (after the last: the final save, the workers' exit). When a
later record covers steps an earlier one covered (a restart resumed from a checkpoint behind them),
the earlier interval's share of those steps is redone work; after a rollback (a ``rollback`` record),
those steps and the reload are the rollback's. The replica-mode waits of a step that went on without a
replica group (a ``replica_lost`` record, up to its ``stall_s``) are lost to that group's cause
(``replica_hung``, ``replica_frozen``, ``replica_lost``, ``replica_slow``) instead of ``replica_waits``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypedDict

from meshtrain.observe.run_folder import CheckpointSaveRecord, EvalRecord, ReplicaLostRecord, RollbackRecord, TrainRecord

# Lost time inside a train record's interval, by cause.
STALL_CAUSES = ("replica_hung", "replica_frozen", "replica_lost", "replica_slow")  # a replica_lost record's cause
IN_STEP_CAUSES = ("data_wait", "replica_waits", *STALL_CAUSES, "evaluation", "checkpoints")
CAUSES = ("start_up", "restarts", "redone", "rollbacks", *IN_STEP_CAUSES, "finishing", "other")


class GoodputReport(TypedDict):
    goodput: float  # productive_s / wall_s
    wall_s: float  # from the launch to the end of training
    productive_s: float  # step time of the steps that count, less what the steps waited for
    lost_s: dict[str, float]  # CAUSES: seconds


@dataclass
class _Interval:
    first: int  # steps (first, last]
    last: int
    seconds: float
    losses: dict[str, float]
    kept_steps: int = field(init=False)

    def __post_init__(self) -> None:
        self.kept_steps = self.last - self.first

    @property
    def steps(self) -> int:
        return self.last - self.first

    @property
    def productive(self) -> float:
        return max(0.0, self.seconds - sum(self.losses.values()))


class GoodputLedger:
    """Running totals, one record at a time (the driver follows metrics.jsonl with it); ``started`` is
    the launch's wall-clock time."""

    def __init__(self, started: float) -> None:
        self.started = started
        self._intervals: list[_Interval] = []
        self._productive = 0.0
        self._lost = dict.fromkeys(CAUSES, 0.0)
        self._pending = dict.fromkeys(("evaluation", "checkpoints"), 0.0)  # for the next train record's interval
        self._first_start: float | None = None
        self._last_end: float | None = None
        self._covered = 0.0
        self._reloads = 0.0  # rollbacks' reload seconds: between intervals, not a restart's
        self._redone_cause = "redone"  # what the next record's superseded steps are lost to
        self._stalls = dict.fromkeys(STALL_CAUSES, 0.0)  # replica_lost stalls, for the next train record's waits

    def add(self, record: object) -> None:
        """One record of ``metrics.jsonl`` (a kind the account does not use is passed over)."""
        if isinstance(record, EvalRecord):
            self._pending["evaluation"] += record.seconds
        elif isinstance(record, CheckpointSaveRecord):
            self._pending["checkpoints"] += record.blocking_s
        elif isinstance(record, TrainRecord):
            self._add_train(record)
            self._redone_cause = "redone"
        elif isinstance(record, RollbackRecord):
            self._reloads += record.seconds
            self._redone_cause = "rollbacks"
        elif isinstance(record, ReplicaLostRecord):
            self._stalls[f"replica_{record.cause}"] += record.stall_s

    def _add_train(self, record: TrainRecord) -> None:
        steps = record.interval_steps
        seconds = steps * record.step_time_s
        losses = {"data_wait": steps * record.data_wait_s,
                  "replica_waits": steps * (record.replica_wait_s or 0.0), **self._pending}
        self._pending = dict.fromkeys(self._pending, 0.0)
        end = record.time
        first = record.step - steps
        if self._intervals and first >= self._intervals[-1].last and self._last_end is not None:
            # A writer handover (replica mode): a group that joined began its step while the previous
            # writer's interval ran, waiting for the quorum and its healing; that wait is already wall time.
            overlap = min(seconds, max(0.0, self._last_end - (end - seconds)))
            seconds -= overlap
            losses["replica_waits"] = max(0.0, losses["replica_waits"] - overlap)
        for cause, stall in self._stalls.items():
            moved = min(stall, losses["replica_waits"])
            losses["replica_waits"] -= moved
            losses[cause] = moved
        self._stalls = dict.fromkeys(STALL_CAUSES, 0.0)
        interval = _Interval(first, record.step, seconds, losses)
        self._supersede(interval.first)
        self._intervals.append(interval)
        self._count(interval, 1.0)
        start = end - seconds
        self._first_start = start if self._first_start is None else min(self._first_start, start)
        if self._last_end is None or end > self._last_end:
            self._covered += end - max(start, self._last_end if self._last_end is not None else start)
            self._last_end = end

    def _supersede(self, first: int) -> None:
        """Earlier intervals' steps after ``first`` are trained again: their share becomes redone work."""
        for earlier in reversed(self._intervals):
            if earlier.last <= first:
                break
            again = min(earlier.kept_steps, earlier.last - max(earlier.first, first))
            if again <= 0:
                continue
            share = again / earlier.steps
            self._count(earlier, -share)
            self._lost[self._redone_cause] += share * earlier.seconds
            earlier.kept_steps -= again

    def _count(self, interval: _Interval, share: float) -> None:
        self._productive += share * interval.productive
        for cause, seconds in interval.losses.items():
            self._lost[cause] += share * seconds

    def report(self, ended: float) -> GoodputReport:
        """The launch from ``started`` to ``ended`` (wall-clock seconds)."""
        wall = max(ended - self.started, 1e-9)
        lost = dict(self._lost)
        if self._first_start is not None and self._last_end is not None:
            lost["start_up"] = max(0.0, self._first_start - self.started)
            gaps = max(0.0, (self._last_end - self._first_start) - self._covered)
            lost["rollbacks"] += min(self._reloads, gaps)
            lost["restarts"] = gaps - min(self._reloads, gaps)
            lost["finishing"] = max(0.0, ended - self._last_end)
        else:
            lost["start_up"] = wall
        productive = min(self._productive, wall)
        lost["other"] = max(0.0, wall - productive - sum(seconds for cause, seconds in lost.items() if cause != "other"))
        return {"goodput": productive / wall, "wall_s": wall, "productive_s": productive,
                "lost_s": {cause: round(seconds, 3) for cause, seconds in lost.items()}}


def goodput_of(records: Iterable[object], started: float, ended: float) -> GoodputReport:
    ledger = GoodputLedger(started)
    for record in records:
        ledger.add(record)
    return ledger.report(ended)


def goodput_line(report: GoodputReport) -> str:
    """``goodput 93.1% of 120.0s (lost: restarts 12.0s, redone 8.1s)``: the causes of 1% of the wall time or more."""
    wall = report["wall_s"]
    big = sorted(((s, c) for c, s in report["lost_s"].items() if s >= 0.01 * wall), reverse=True)
    lost = ", ".join(f"{cause.replace('_', ' ')} {seconds:.1f}s" for seconds, cause in big)
    return f"goodput {report['goodput']:.1%} of {wall:.1f}s" + (f" (lost: {lost})" if lost else "")
