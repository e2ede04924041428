"""jobs/bench_recovery.py without running a job: the scale arithmetic, and what the real part reads from
a run's records (a hand-built restart-mode and replica-mode metrics.jsonl)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    GroupStartRecord,
    ReadRecord,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    TrainRecord,
)
from meshtrain_bench.recovery import (
    bytes_read, goodput, kill_gap, rejoin_s, steps_redone, tokens_per_s, unbroken_step_s,
)
from meshtrain_bench.recovery_scale import (
    CASES, ScaleInputs, assumptions, evaluate, model_shape, parameter_count, scale,
)
from record_samples import make


def test_parameter_count_is_the_models() -> None:
    from meshtrain.model.llama import build_model, count_parameters

    for preset in ("llama3_8b", "llama3.2_1b"):  # untied and tied embeddings
        args = model_shape(preset)
        assert parameter_count(args) == count_parameters(build_model(args, "meta")), preset


def test_healing_and_reload_bytes_follow_the_parameter_count() -> None:
    inputs = ScaleInputs()
    small, large = (evaluate(case, inputs) for case in CASES)
    assert large.parameters > 8 * small.parameters
    for row in (small, large):
        assert row.state_bytes == 12 * row.parameters  # fp32 weight and two fp32 AdamW moments
        assert row.reload_bytes == row.state_bytes * row.replicas
        assert row.replicas * row.group_gpus == inputs.gpus
    assert small.replicas == 2048
    doubled = dataclasses.replace(inputs, network_gbit_per_node=2 * inputs.network_gbit_per_node)
    assert evaluate(CASES[0], doubled).heal_s == pytest.approx(small.heal_s / 2)


def test_goodput_falls_as_interruptions_rise_and_replica_mode_wins_by_default() -> None:
    inputs = ScaleInputs()
    for case in CASES:
        base = evaluate(case, inputs)
        assert 0.98 <= base.goodput_replica < 1 and base.goodput_restart < base.goodput_replica
        assert base.local_cost_s < base.replica_cost_s < base.restart_cost_s
        worse = evaluate(case, dataclasses.replace(inputs, interruptions=2 * inputs.interruptions))
        assert worse.goodput_restart < base.goodput_restart and worse.goodput_replica < base.goodput_replica
        all_whole = evaluate(case, dataclasses.replace(inputs, whole_run_interruptions=inputs.interruptions))
        assert all_whole.goodput_replica == pytest.approx(all_whole.goodput_restart)


def test_the_inputs_are_printed() -> None:
    inputs = dataclasses.replace(ScaleInputs(), gpus=8192, interruptions=123, group_start_s=456.0,
                                 checkpoint_interval_s=789.0, network_gbit_per_node=321.0)
    text = "\n".join(assumptions(inputs))
    for shown in ("8,192 GPUs", "123 in 54 days", "group start 456 s", "789 s checkpoint interval", "321 Gb/s"):
        assert shown in text, shown
    lines, data = scale(inputs)
    assert data["inputs"]["gpus"] == 8192 and len(data["rows"]) == len(CASES)
    assert sum(line.startswith("goal: ") for line in lines) == len(CASES)


def train(step: int, time: float, step_time_s: float = 0.2) -> TrainRecord:
    return make(TrainRecord, step=step, time=time, step_time_s=step_time_s, tokens_per_s=2048 / step_time_s)


def restart_records(checkpoint: Path) -> list[ReadRecord]:
    """Steps 1-6 at 1 s each, a checkpoint at 4, rank killed before step 7; the group restarts 10 s
    later, loads step 4 and trains 5 and 6 again before 7 and 8."""
    records: list[ReadRecord] = [train(step, 100.0 + step) for step in range(1, 7)]
    records.insert(4, make(CheckpointSaveRecord, step=4, path=str(checkpoint), bytes=999))
    records.append(GroupStartRecord(restarts=1, workers=2, time=114.0))
    records.append(make(CheckpointLoadRecord, step=4, path=str(checkpoint), load_s=0.1))
    records += [train(5, 116.0), train(6, 117.0), train(7, 118.0), train(8, 119.0)]
    return records


def test_restart_mode_records(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step-00000004"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "a.distcp").write_bytes(b"x" * 100)
    (checkpoint / "sub" / ".metadata").write_bytes(b"y" * 20)
    records = restart_records(checkpoint)
    assert kill_gap(records, 7) == (10.0, 12.0)  # step 6 at 106, step 5 again at 116, step 7 at 118
    assert steps_redone(records) == 2
    assert rejoin_s(records, 7) is None
    assert bytes_read(records, readers=2) == 240  # the folder, read whole by both ranks
    (checkpoint / "a.distcp").unlink()
    (checkpoint / "sub" / ".metadata").unlink()
    (checkpoint / "sub").rmdir()
    checkpoint.rmdir()
    assert bytes_read(records, readers=1) == 999  # pruned since: its save record's bytes
    assert unbroken_step_s(records, before=7) == pytest.approx(0.2)  # steps 4-6: after warm-up, before the kill
    job, training = goodput(records, step_s=0.25, wall_s=40.0)
    # 8 committed steps at 0.25 s, over the wall and over the window 100.8 .. 119.
    assert job == pytest.approx(8 * 0.25 / 40) and training == pytest.approx(8 * 0.25 / 18.2)


def test_replica_mode_records() -> None:
    records: list[ReadRecord] = [train(step, 100.0 + step) for step in range(1, 7)]
    records.append(ReplicaLostRecord(step=7, participants=1, replicas=2, stall_s=3.0, quorum_s=1.1, time=107.5))
    records += [train(7, 109.5, step_time_s=3.3), train(8, 110.0, step_time_s=0.4)]
    records.append(ReplicaJoinedRecord(step=8, replica=1, participants=2, seconds=0.3, source=0, bytes=4096, time=115.0))
    records.append(train(9, 116.0))
    assert kill_gap(records, 7) == (3.5, 3.5)
    assert steps_redone(records) == 0
    assert bytes_read(records, readers=1) == 0
    assert rejoin_s(records, 7) == pytest.approx(9.0)  # from step 6 at 106 to the join at 115
    job, training = goodput(records, step_s=unbroken_step_s(records, before=7), wall_s=20.0)
    # The stall inside step 7's time is not productive: 9 steps at 0.2 s over 100.8 .. 116.
    assert job == pytest.approx(9 * 0.2 / 20) and training == pytest.approx(9 * 0.2 / 15.2)
    assert tokens_per_s(records, before=7) == pytest.approx(2048 / 0.2)
