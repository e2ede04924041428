"""Goodput from metrics.jsonl: productive step time over the launch's wall time, and every lost second
named by its cause, in the runs a restart, a replica loss or an interval of several steps makes."""

from __future__ import annotations

from typing import Any

import pytest

from meshtrain.observe.goodput import CAUSES, GoodputLedger, goodput_line, goodput_of
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    EvalRecord,
    GroupStartRecord,
    ReplicaLostRecord,
    RollbackRecord,
    TrainRecord,
    parse_record,
)
from record_samples import make


def train(step: int, end: float, steps: int = 1, step_s: float = 1.0, data_wait_s: float = 0.0, **extra: Any) -> TrainRecord:
    return make(TrainRecord, step=step, time=end, interval_steps=steps, step_time_s=step_s, data_wait_s=data_wait_s,
                  **extra)


def accounted(report: dict) -> float:
    return report["productive_s"] + sum(report["lost_s"].values())


def test_an_unbroken_run_loses_its_start_its_waits_its_saves_and_its_end() -> None:
    # Launch at 0, first step from 5 to 6, ten steps of 1 s (0.1 s of each waiting for data), an eval of
    # 0.5 s and a save blocking 0.25 s inside step 10's second, training over at 17.
    records = [train(step, 5.0 + step, data_wait_s=0.1) for step in range(1, 10)]
    records += [make(EvalRecord, step=10, seconds=0.5), make(CheckpointSaveRecord, step=10, blocking_s=0.25),
                train(10, 15.0, data_wait_s=0.1)]
    report = goodput_of(records, started=0.0, ended=17.0)
    lost = report["lost_s"]
    assert set(lost) == set(CAUSES)
    assert (lost["start_up"], lost["finishing"], lost["restarts"], lost["redone"]) == (5.0, 2.0, 0.0, 0.0)
    assert lost["data_wait"] == pytest.approx(1.0) and lost["evaluation"] == 0.5 and lost["checkpoints"] == 0.25
    assert report["productive_s"] == pytest.approx(10 - 1.0 - 0.75)
    assert report["goodput"] == pytest.approx(8.25 / 17) and accounted(report) == pytest.approx(17.0)
    assert goodput_line(report) == "goodput 48.5% of 17.0s (lost: start up 5.0s, finishing 2.0s, data wait 1.0s, evaluation 0.5s, checkpoints 0.2s)"


def test_a_restart_loses_the_gap_and_the_steps_after_the_checkpoint_once() -> None:
    # Steps 1..8 at one per second from t=1; the group dies, and the next one starts training at t=20
    # from the checkpoint of step 5: steps 6..8 are trained again, 9 and 10 follow.
    first_life = [train(step, 1.0 + step) for step in range(1, 9)]
    second_life: list[object] = [make(GroupStartRecord, restarts=1), make(CheckpointLoadRecord, step=5)]
    second_life += [train(step, 20.0 + step - 5) for step in range(6, 11)]
    report = goodput_of(first_life + second_life, started=0.0, ended=25.0)
    lost = report["lost_s"]
    assert lost["redone"] == pytest.approx(3.0)
    assert lost["restarts"] == pytest.approx(20.0 - 9.0)  # from step 8's end to step 6's second start
    assert report["productive_s"] == pytest.approx(10.0) and accounted(report) == pytest.approx(25.0)


def test_a_rollback_loses_its_reload_and_the_steps_it_undid_to_rollbacks() -> None:
    # Steps 1..9 at one per second from t=1; at step 9 the run goes back to the checkpoint of step 6 in 2 s
    # (t=10 to 12) and trains steps 7..12 again and on: steps 7..9 and the reload are the rollback's loss.
    records: list[object] = [train(step, 1.0 + step) for step in range(1, 10)]
    records += [make(RollbackRecord, step=9, to_step=6, seconds=2.0)]
    records += [train(step, 12.0 + step - 6) for step in range(7, 13)]
    report = goodput_of(records, started=0.0, ended=18.0)
    lost = report["lost_s"]
    assert lost["rollbacks"] == pytest.approx(3.0 + 2.0) and lost["redone"] == 0.0 and lost["restarts"] == 0.0
    assert report["productive_s"] == pytest.approx(12.0) and accounted(report) == pytest.approx(18.0)


def test_records_of_several_steps_are_redone_in_part() -> None:
    # log_every=4: records at steps 4 and 8 (2 s a step); the restart resumes from step 6, so half of
    # the second record's interval is trained again.
    records = [train(4, 8.0, steps=4, step_s=2.0), train(8, 16.0, steps=4, step_s=2.0), train(10, 30.0, steps=4, step_s=2.0)]
    report = goodput_of(records, started=0.0, ended=30.0)
    assert report["lost_s"]["redone"] == pytest.approx(4.0)
    assert report["productive_s"] == pytest.approx(20.0)  # steps 1..10 once, 2 s each
    assert report["lost_s"]["restarts"] == pytest.approx(22.0 - 16.0)


def test_a_second_restart_does_not_count_the_same_steps_redone_twice() -> None:
    records = [train(step, float(step)) for step in range(1, 7)]  # 1..6
    records += [train(step, 10.0 + step) for step in range(5, 8)]  # resumed from 4: 5, 6 again; then 7
    records += [train(step, 30.0 + step) for step in range(5, 11)]  # resumed from 4 again: 5, 6, 7 again
    report = goodput_of(records, started=0.0, ended=40.0)
    assert report["lost_s"]["redone"] == pytest.approx(2.0 + 3.0)
    assert report["productive_s"] == pytest.approx(10.0) and accounted(report) == pytest.approx(40.0)


def test_replica_mode_loses_its_waits_and_a_new_writer_continues_the_timeline() -> None:
    # Replica 0 writes steps 1..5, replica 1 (its intervals back to back with its own unwritten ones)
    # takes over at 6; step 4 waited 3 s for its quorum after a peer was lost.
    records = [train(step, float(step) + (3.0 if step >= 4 else 0.0), step_s=4.0 if step == 4 else 1.0,
                     replica_wait_s=3.0 if step == 4 else 0.05) for step in range(1, 6)]
    records.insert(3, make(ReplicaLostRecord, step=4, stall_s=2.9, cause="hung"))  # written as step 4 began
    records.append(make(GroupStartRecord, restarts=1))
    records += [train(step, float(step) + 3.0 + 0.01, replica_wait_s=0.05) for step in range(6, 9)]
    report = goodput_of(records, started=0.0, ended=11.1)
    lost = report["lost_s"]
    assert lost["redone"] == 0.0 and lost["restarts"] == pytest.approx(0.0, abs=0.02)
    # The stall the replica_lost record names goes to its cause; the rest of the waits stay waits.
    assert lost["replica_hung"] == pytest.approx(2.9) and lost["replica_frozen"] == 0.0
    assert lost["replica_waits"] == pytest.approx(3.0 - 2.9 + 7 * 0.05)
    assert accounted(report) == pytest.approx(11.1, abs=0.02)


def test_a_joining_writers_wait_during_the_previous_writers_step_is_counted_once() -> None:
    """A group joins while the first trains step 1 alone and becomes the writer: its step 2 began when it
    asked for a quorum (its 3.5 s wait for the quorum and its healing ran during step 1), so its interval
    overlaps step 1's. Measured through Ray: counted whole, productive and lost time exceeded the wall
    time by the overlap, 2.5 s. The overlap is counted once, out of the joiner's replica waits."""
    records = [train(1, 10.0, step_s=4.0, replica_wait_s=0.03),
               train(2, 13.3, step_s=5.8, replica_wait_s=3.5), train(3, 14.3, replica_wait_s=0.0)]
    report = goodput_of(records, started=0.0, ended=15.0)
    lost = report["lost_s"]
    assert accounted(report) == pytest.approx(15.0, abs=1e-6)
    assert lost["start_up"] == pytest.approx(6.0) and lost["restarts"] == pytest.approx(0.0, abs=1e-6)
    assert lost["replica_waits"] == pytest.approx(0.03 + 3.5 - 2.5)
    assert report["productive_s"] == pytest.approx(3.97 + 2.3 + 1.0)


def test_records_without_intervals_and_an_untrained_launch_count_as_start_up() -> None:
    ledger = GoodputLedger(started=100.0)
    older = {"event": "train", "step": 3, "time": 104.0, "step_time_s": 1.0}  # an older writer's record: no interval
    assert parse_record(older) is None  # a reader never hands it over
    report = ledger.report(ended=110.0)
    assert report["productive_s"] == 0.0 and report["lost_s"]["start_up"] == 10.0 and report["goodput"] == 0.0
