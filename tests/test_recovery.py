"""Recovery through Ray Train: workers die (by their own hand, from outside, mid-checkpoint), the
newest checkpoints are damaged or crafted, the driver is interrupted, and the run still finishes with
exactly the weights of a run that never broke. The run killed mid-checkpoint
also has both experiment trackers on: W&B (offline) and MLflow (sqlite) each read back one run
holding every logged step once, with metrics.jsonl's values."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs import REPO, assert_same_weights, job_command, job_env, model_weights, read_metrics, run_job
from meshtrain_bench.faults import Crafted, flip_bit, largest_shard, rewrite_marker_for
from meshtrain.config import FaultToleranceConfig, RunConfig
from meshtrain.config.loading import load_config
from meshtrain.observe.goodput import goodput_of
from meshtrain.observe.mlflow_tracker import RUN_ID_TAG, tracking_uri
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    InterruptedRecord,
    PreemptedRecord,
    ReadRecord,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    RunPaths,
    TextSamplesRecord,
    TrainRecord,
)
from meshtrain.observe.trackers import tracker_run_id, tracker_values
from s3server import moto_s3


SETTINGS = (
    "train.steps=40", "train.log_every=1", "checkpoint.interval=10", "data.max_documents=40", "run.max_failures=2",
)
TRACKERS = ("metrics.wandb=true", "metrics.mlflow=true", "metrics.wandb_tags=[ci,resume]")
DOWNSTREAM = ("eval.downstream.tasks=[meshtrain_mc,meshtrain_ppl]", "eval.downstream.include_path=tests/data/downstream",
              "eval.downstream.limit=4", "eval.downstream.num_cpus=0.01", "eval.samples.prompts=[def main]",
              "eval.samples.max_new_tokens=8")


def final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-00000040"


def loads(run_dir: Path) -> list[int]:
    return [r.step for r in read_metrics(run_dir) if isinstance(r, CheckpointLoadRecord)]


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recovery")


@pytest.fixture(scope="module")
def unbroken(storage: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # The run also hands its metrics to a Ray Train callback (tests/reportlog.py) through Ray's controller,
    # which imports it: the run owns its Ray, whose processes inherit the driver's PYTHONPATH.
    job = run_job(
        f"run.storage_path={storage}", "run.name=unbroken", *SETTINGS, "metrics.ray_callbacks=[reportlog:ReportLog]",
        "metrics.ray_report_interval_s=2", own_ray=True, PYTHONPATH=str(REPO / "tests"),
        MESHTRAIN_TEST_REPORT_LOG=str(storage / "unbroken-reports.jsonl"),
    )
    assert job.returncode == 0, job.stderr[-3000:]
    return model_weights(final_checkpoint(storage / "unbroken"), tmp_path_factory.mktemp("weights"))


def test_logged_metrics_reach_ray_train_callbacks(storage: Path, unbroken: dict) -> None:
    *reports, final = [json.loads(line) for line in (storage / "unbroken-reports.jsonl").read_text().splitlines()]
    logged = {r.step: r for r in read_metrics(storage / "unbroken") if isinstance(r, TrainRecord)}
    evals = [r for r in read_metrics(storage / "unbroken") if isinstance(r, EvalRecord)]
    # The last report carries a checkpoint (what Ray 2.60 builds Result.metrics and Result.checkpoint
    # from): a folder in Ray's run storage pointing at meshtrain's newest committed checkpoint.
    summary = json.loads((storage / "unbroken" / "summary.json").read_text())
    assert (final["step"], final["loss"], final["eval_loss"]) == (40, summary["final_loss"], summary["eval_loss"])
    assert all(report["checkpoint_path"] is None for report in reports)
    assert Path(final["checkpoint_path"]).parent == storage / "unbroken"
    pointer = json.loads((Path(final["checkpoint_path"]) / "meshtrain_result.json").read_text())
    assert pointer == {
        "run_dir": str(storage / "unbroken"), "checkpoint": str(final_checkpoint(storage / "unbroken")), "checkpoint_step": 40,
    }
    assert reports and reports[0]["step"] == 1 and reports[-1]["step"] == 40  # the first and the last step
    assert len(reports) < len(logged)  # spaced by metrics.ray_report_interval_s, not one per logged step
    for report in reports:
        assert report["loss"] == logged[report["step"]].loss and report["lr"] == logged[report["step"]].lr
    assert reports[-1]["eval_loss"] == evals[-1].loss and reports[-1]["eval_step"] == 40


def worker_pids(job_pid: int) -> list[int]:
    """Ray Train worker processes started under this job (its local Ray is the job's child)."""
    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    parent, args = {}, {}
    for line in listing.splitlines():
        pid, ppid, *rest = line.split(maxsplit=2)
        parent[int(pid)], args[int(pid)] = int(ppid), rest[0] if rest else ""

    def under_job(pid: int) -> bool:
        while pid > 1:
            if pid == job_pid:
                return True
            pid = parent.get(pid, 1)
        return False

    return [pid for pid, command in args.items() if "RayTrainWorker" in command and under_job(pid)]


def _wait_for_step(job: subprocess.Popen[str], run_dir: Path, step: int) -> int:
    deadline = time.monotonic() + 240
    while not any(isinstance(r, TrainRecord) and r.step >= step for r in read_metrics(run_dir)):
        assert job.poll() is None and time.monotonic() < deadline, f"the job ended before step {step}"
        time.sleep(0.05)
    return max(r.step for r in read_metrics(run_dir) if isinstance(r, TrainRecord))


def test_sigterm_then_sigkill_from_outside_lose_nothing_then_only_since_the_checkpoint(
    storage: Path, unbroken: dict, tmp_path: Path
) -> None:
    """From outside, by PID, in one run. First a preemption notice, SIGTERM to one of the two workers
    between checkpoints (as a spot reclaim or an eviction sends it): every rank stops at the next step
    boundary, saves that step, and the restarted group loads exactly it. Then SIGKILL to a worker of
    the new group: it restarts from the newest committed checkpoint. The run ends with the unbroken
    run's weights."""
    run_dir = storage / "killed"
    job = subprocess.Popen(
        job_command(f"run.storage_path={storage}", "run.name=killed", *SETTINGS),  # own Ray: its workers are killed
        cwd=REPO, env=job_env(own_ray=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        noticed_after = _wait_for_step(job, run_dir, 13)
        victims = worker_pids(job.pid)
        assert len(victims) == 2
        os.kill(victims[-1], signal.SIGTERM)
        _wait_for_step(job, run_dir, 26)
        victims = worker_pids(job.pid)
        assert len(victims) == 2
        os.kill(victims[0], signal.SIGKILL)
        output, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "preemption notice (SIGTERM)" in output
    records = read_metrics(run_dir)
    [preempted] = [r for r in records if isinstance(r, PreemptedRecord)]
    assert preempted.saved, preempted
    step = preempted.step
    assert noticed_after <= step <= noticed_after + 3 and step % 10, (noticed_after, step)  # not a scheduled save
    assert preempted.notice_to_commit_s < RunConfig().preemption_save_s  # committed within the notice budget
    assert step in [r.step for r in records if isinstance(r, CheckpointSaveRecord)]
    assert loads(run_dir)[0] == step and len(loads(run_dir)) == 2  # the notice lost no step; the SIGKILL a few
    assert loads(run_dir)[1] >= 20
    # The run's own account of what the two restarts cost: their gaps, and the steps after the checkpoint
    # the SIGKILLed group had logged, trained a second time (the notice's restart redid none).
    first_runs, redone = {}, 0.0
    for record in (r for r in records if isinstance(r, TrainRecord)):
        redone += first_runs.get(record.step, 0.0)
        first_runs[record.step] = record.step_time_s
    goodput = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert redone > 0 and goodput["lost_s"]["redone"] == pytest.approx(redone, abs=2e-3), goodput
    assert goodput["lost_s"]["restarts"] > 1.0 and goodput["lost_s"]["replica_waits"] == 0.0, goodput
    assert goodput["productive_s"] + sum(goodput["lost_s"].values()) == pytest.approx(goodput["wall_s"], rel=1e-3)
    assert_same_weights(model_weights(final_checkpoint(run_dir), tmp_path), unbroken)


@pytest.fixture(scope="module")
def midsave(storage: Path) -> Path:
    """A run whose rank 1 is killed while step 20's checkpoint is being written, with both experiment
    trackers on (W&B offline, MLflow's local store) and every checkpoint scored by downstream
    evaluation beside the workers: checked by the checkpoint and tracker tests."""
    job = run_job(
        f"run.storage_path={storage}", "run.name=midsave", *SETTINGS, *TRACKERS, *DOWNSTREAM,
        "fault.kill_rank=1", "fault.at_step=20", "fault.during_checkpoint=true", WANDB_MODE="offline",
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "fault injection: rank 1 sends itself SIGKILL at step 20" in job.stdout + job.stderr
    return storage / "midsave"


def test_replica_mode_loses_a_replica_without_a_restart_and_trains_what_restart_mode_trains(
    storage: Path, unbroken: dict, tmp_path: Path
) -> None:
    """fault_tolerance.mode=replica, two replica groups of two workers splitting every layer with tensor
    parallel (one TorchTrainer each; groups of one worker are tests/test_replicas.py's, groups sharding the
    model tests/test_two_nodes.py's): replica 1's second worker (rank 3) SIGKILLs itself at step 12.
    Replica 0 keeps stepping after about one heartbeat timeout; Ray restarts only replica 1's group, whose
    two workers join by receiving replica 0's tensor-parallel shards, rank to same rank. No checkpoint is
    read and every step is trained once.

    Then the driver, which holds the run's lighthouse, is SIGKILLed after step 24: every worker of both
    groups ends with it (no group trains on without a quorum), and the same command resumes from the
    newest committed checkpoint in replica mode. Losses and weights are the unbroken restart-mode run's
    (two workers sharding one model: the same samples per step)."""
    pytest.importorskip("torchft")
    run_dir = storage / "replicas"
    heartbeat_s = 2.0
    arguments = (f"run.storage_path={storage}", "run.name=replicas", *SETTINGS, "fault_tolerance.mode=replica",
                 "scaling.num_workers=4", "scaling.cpus_per_worker=0.5", "parallel.shard=1", "parallel.tensor=2",
                 "train.micro_batch_size=4", f"fault_tolerance.heartbeat_timeout_s={heartbeat_s}", "fault.kill_rank=3",
                 "fault.at_step=12")
    # Its own Ray: its workers are found as its driver's children, and die with it.
    job = subprocess.Popen(job_command(*arguments), cwd=REPO, env=job_env(own_ray=True), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        killed_after = _wait_for_step(job, run_dir, 24)
        workers = worker_pids(job.pid)
        os.kill(job.pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert len(workers) == 4, workers
    gone = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "workers outlived the driver and its lighthouse"
    assert "fault injection: rank 3 sends itself SIGKILL at step 12" in output
    first = read_metrics(run_dir)
    trained = [r for r in first if isinstance(r, TrainRecord)]
    # The workers end within moments of the driver: one of them may log a step or two more.
    assert [r.step for r in trained] == list(range(1, trained[-1].step + 1)) and trained[-1].step >= killed_after
    lost = [r for r in first if isinstance(r, ReplicaLostRecord)]
    assert [(r.step, r.participants) for r in lost] == [(12, 1)]
    joined = [r for r in first if isinstance(r, ReplicaJoinedRecord) and r.replica == 1 and r.step >= 12]
    assert len(joined) == 1 and joined[0].participants == 2 and joined[0].source == 0
    assert "[meshtrain] replica group 1 joined at step" in output and "with replica group 0's state (" in output
    times = [r.time for r in trained]
    # The lost group stops heartbeating at once: its other worker fails at its next collective with the
    # killed one and leaves the quorum (measured 0.13 s after the kill), or Ray ends the group when that worker
    # waits in the quorum (0.7 s). So the survivors' quorum went on after about one heartbeat timeout (measured
    # 2.4 s), and their stall is that wait plus the discarded attempt: both ended by the heartbeat, never by the
    # cross-replica collective's timeout, and no gap between steps waited that long.
    collective_timeout_s = FaultToleranceConfig().timeout_s
    assert lost[0].quorum_s <= lost[0].stall_s < collective_timeout_s, lost[0]
    assert max(b - a for a, b in zip(times, times[1:])) < collective_timeout_s
    assert loads(run_dir) == []  # nothing was read back from storage
    starts = [entry.get("replica") for entry in map(json.loads, (run_dir / "worker_starts.jsonl").read_text().splitlines())]
    assert sorted(starts) == [0, 1, 1]  # only replica 1's group was restarted
    committed = max(r.step for r in first if isinstance(r, CheckpointSaveRecord))

    rerun = run_job(*arguments)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "mesh (1, 1, 2) on 2 workers x 2 replica groups" in rerun.stdout  # replicate, shard, tensor
    records = read_metrics(run_dir)
    assert loads(run_dir) and set(loads(run_dir)) == {committed}  # the relaunch's groups loaded the newest checkpoint
    again = [r for r in records[len(first):] if isinstance(r, TrainRecord)]
    assert [r.step for r in again] == list(range(committed + 1, 41))
    expected = {r.step: r.loss for r in read_metrics(storage / "unbroken") if isinstance(r, TrainRecord)}
    for record in trained + again:
        assert record.loss == pytest.approx(expected[record.step], rel=1e-4), record.step
    # The first launch's own account (goodput is per launch; the killed driver wrote no summary): no
    # restart gap and nothing redone; the survivor's stall is its replica waits.
    goodput = goodput_of(first, trained[0].time - trained[0].step_time_s, trained[-1].time)
    step_s = statistics.median(r.step_time_s for r in trained)  # the gaps between records are jitter, not a restart
    assert goodput["lost_s"]["redone"] == 0.0 and goodput["lost_s"]["restarts"] < step_s, (goodput, step_s)
    assert goodput["lost_s"]["replica_waits"] + goodput["lost_s"]["replica_lost"] >= heartbeat_s / 2, goodput
    relaunch = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert relaunch["productive_s"] + sum(relaunch["lost_s"].values()) == pytest.approx(relaunch["wall_s"], rel=1e-3)
    assert [r.step for r in records if isinstance(r, CheckpointSaveRecord)][-2:] == [30, 40]
    # Not bitwise: the unbroken run reduce-scatters over a 2-way shard group and clips with a norm summed
    # over shards; the replicas sum whole gradients. After 40 AdamW steps that rounding is ~4e-5 (measured);
    # tests/test_replicas.py holds replica mode to 1e-5 against one worker.
    weights = model_weights(final_checkpoint(run_dir), tmp_path)
    for name, value in unbroken.items():
        drift = ((weights[name] - value).norm() / value.norm()).item()
        assert drift <= 2e-4, (name, drift)


def test_kill_during_a_checkpoint_write_leaves_it_uncommitted_and_resumes_from_the_previous(
    midsave: Path, unbroken: dict, tmp_path: Path
) -> None:
    run_dir = midsave
    # The marker keeps the restarted worker from failing again at the same step.
    assert (run_dir / "faults" / "killed-rank1-step20").is_file()
    assert loads(run_dir) == [10]  # step 20 was never committed, so the restart used step 10
    saves = [r.step for r in read_metrics(run_dir) if isinstance(r, CheckpointSaveRecord)]
    assert saves == [10, 20, 30, 40]  # the second 20 is the resumed run's
    assert_same_weights(model_weights(final_checkpoint(run_dir), tmp_path), unbroken)


def first_values(records: list[ReadRecord]) -> dict[str, dict[int, float]]:
    """Each tracker series from metrics.jsonl, by step, as first logged (a retrained step repeats)."""
    series: dict[str, dict[int, float]] = {}
    for record in records:
        step = getattr(record, "step", None)
        if step is None:
            continue
        for name, value in tracker_values(record).items():
            series.setdefault(name, {}).setdefault(step, value)
    return series


TRACKED_SERIES = ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "checkpoint/save_s",
                  "downstream/meshtrain_mc/acc", "downstream/meshtrain_ppl/bits_per_byte")


def test_every_checkpoint_is_scored_downstream_once(midsave: Path) -> None:
    """Rank 1 died while step 20 was being saved: the steps scored are the committed ones, each once,
    the first group's and the resumed group's, and step 40's after training."""
    records = read_metrics(midsave)
    scored = sorted((r.step, f"downstream_eval/{r.task}") for r in records if isinstance(r, DownstreamEvalRecord))
    assert scored == [(step, f"downstream_eval/{task}") for step in (10, 20, 30, 40)
                      for task in ("meshtrain_mc", "meshtrain_ppl")]
    sampled = [r for r in records if isinstance(r, TextSamplesRecord)]
    assert sorted(r.step for r in sampled) == [10, 20, 30, 40]
    assert all(len(r.samples) == 1 and r.samples[0]["prompt"] == "def main" for r in sampled)
    assert (midsave / "downstream" / "step-00000040" / "text_samples.jsonl").is_file()


def test_mlflow_holds_one_run_with_every_logged_step_once(midsave: Path) -> None:
    from mlflow.tracking import MlflowClient

    paths = RunPaths("midsave", midsave.parent)
    records = read_metrics(midsave)
    assert len([r for r in records if isinstance(r, TrainRecord)]) > 40  # steps 11.. were trained and logged twice
    client = MlflowClient(tracking_uri(load_config(None, [*TRACKERS]).metrics, paths))
    runs = client.search_runs([client.get_experiment_by_name("meshtrain").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags[RUN_ID_TAG] == tracker_run_id(paths)
    assert run.data.params["train.steps"] == "40" and run.data.params["fault.at_step"] == "20"
    expected = first_values(records)
    for name in TRACKED_SERIES:
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == sorted(expected[name]), name  # each step once
        assert {m.step: m.value for m in history} == expected[name], name
    assert [m.value for m in client.get_metric_history(run.info.run_id, "run/resumed_from_step")] == [10.0]
    samples = sorted(artifact.path for artifact in client.list_artifacts(run.info.run_id, "samples"))
    assert samples == [f"samples/step-{step:08d}.json" for step in (10, 20, 30, 40)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "run/restarts")] == [(1, 0.0), (10, 1.0)]


def test_wandb_offline_holds_one_run_with_every_logged_step_once(midsave: Path) -> None:
    from wandb_records import read_run

    paths = RunPaths("midsave", midsave.parent)
    files = sorted((midsave / "wandb").glob("offline-run-*/run-*.wandb"))
    # The driver's: it outlives the worker group that was killed, whose rank 0 never closed a W&B run.
    assert len(files) == 1
    runs = [read_run(path) for path in files]
    assert {run["id"] for run in runs} == {tracker_run_id(paths)}  # one W&B run, resumed
    assert all(run["config"]["train"]["steps"] == 40 and run["config"]["fault"]["at_step"] == 20 for run in runs)
    rows = [row for run in runs for row in run["history"]]
    expected = first_values(read_metrics(midsave))
    for name in TRACKED_SERIES:
        logged = [(row["step"], row[name]) for row in rows if name in row]
        assert sorted(step for step, _ in logged) == sorted(expected[name]), name  # each step once
        assert dict(logged) == expected[name], name
    assert [(row["step"], row["run/restarts"]) for row in rows if "run/restarts" in row] == [(1, 0), (10, 1)]
    assert [row["step"] for row in rows if "run/resumed_from_step" in row] == [10]
    tables = [row for row in rows if row.get("samples._type") == "table-file"]
    assert sorted(row["step"] for row in tables) == [10, 20, 30, 40]  # a text-samples table per step, once
    assert {row["samples.nrows"] for row in tables} == {1}


def test_damaged_newest_checkpoints_are_marked_bad_and_the_run_falls_back_to_the_unbroken_weights(
    storage: Path, unbroken: dict, tmp_path: Path
) -> None:
    """The unbroken run's checkpoints (20, 30, 40) with step 40's .metadata crafted to run code (its
    checksums rewritten to match) and a bit flipped in a shard of step 30: the job resumes from step
    20 without a restart, never runs the payload, keeps both bad checkpoints with their reasons, and
    retrains to exactly the unbroken run's weights."""
    run_dir = storage / "tampered"
    shutil.copytree(storage / "unbroken" / "checkpoints", run_dir / "checkpoints")
    step_40, step_30 = (run_dir / "checkpoints" / f"step-000000{n}" for n in (40, 30))
    proof = tmp_path / "payload-ran"
    metadata = step_40 / ".metadata"
    metadata.write_bytes(pickle.dumps(Crafted(metadata.read_bytes(), proof)))
    rewrite_marker_for(step_40, ".metadata")
    shard = largest_shard(step_30)
    flip_bit(shard, shard.stat().st_size // 2, 6)

    job = run_job(f"run.storage_path={storage}", "run.name=tampered", *SETTINGS)
    assert job.returncode == 0, job.stderr[-3000:]
    assert not proof.exists()
    assert loads(run_dir) == [20]
    assert len((run_dir / "worker_starts.jsonl").read_text().splitlines()) == 1  # no restart
    kept = {p.name.split(".bad-")[0]: json.loads((p / "BAD").read_text())["reason"]
            for p in (run_dir / "checkpoints").glob("step-*.bad-*")}
    assert kept.keys() == {"step-00000040", "step-00000030"}
    assert "never holds" in kept["step-00000040"]
    assert shard.name in kept["step-00000030"]
    assert_same_weights(model_weights(final_checkpoint(run_dir), tmp_path), unbroken)


def test_ctrl_c_saves_then_the_rerun_resumes_there_and_exhausted_restarts_name_the_cause(storage: Path) -> None:
    """SIGINT to the driver: the workers save at the next step boundary, the driver exits 130 naming
    the step; the same command resumes from that checkpoint; there a killed worker with no restarts
    left ends the run with one line naming the rank, the cause and the last committed checkpoint."""
    run_dir = storage / "doomed"
    args = (f"run.storage_path={storage}", "run.name=doomed", *SETTINGS)
    log = storage / "doomed-driver.log"  # a file, not a pipe: a full pipe would stall the driver
    with log.open("w") as output:
        driver = subprocess.Popen(job_command(*args), cwd=REPO, env=job_env(), stdout=output, stderr=output, text=True)
        deadline = time.monotonic() + 240
        while not any(r.step >= 12 for r in read_metrics(run_dir) if isinstance(r, TrainRecord)):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=120)
    stderr = log.read_text()
    assert driver.returncode == 130, stderr[-3000:]
    (interrupted,) = [r for r in read_metrics(run_dir) if isinstance(r, InterruptedRecord)]
    step = interrupted.step
    assert 12 <= step < 30 and interrupted.saved
    assert [line for line in stderr.splitlines() if line.startswith("meshtrain: ")] == [(
        f"meshtrain: interrupted at step {step}; checkpoint step {step} committed; "
        "run the same command (run.name=doomed) to resume"
    )]

    job = run_job(*args, "run.max_failures=0", "fault.kill_rank=0", "fault.at_step=35")
    assert job.returncode == 1
    assert loads(run_dir) == [step]
    lines = [line for line in job.stderr.splitlines() if line.startswith("meshtrain: training failed")]
    assert len(lines) == 1
    checkpoint = run_dir / "checkpoints" / "step-00000030"
    assert lines[0].startswith("meshtrain: training failed: rank 0")
    assert "after 0 restart(s) (run.max_failures=0)" in lines[0]
    assert f"last committed checkpoint: {checkpoint} (step 30)" in lines[0]
    assert "run.name=doomed" in lines[0]


def test_a_diverged_elastic_run_trains_on_the_largest_size_it_can_and_stops_at_max_bad_steps(storage: Path) -> None:
    """An elastic run (scaling.min_workers=1) asks for 4 workers of 0.6 CPU; local Ray holds 3, and 3
    workers cannot split a global batch of 4 micro-batches, so the run trains on 2 (Ray's own policy
    would start 3, fail, and offer 3 again; run.max_failures=0 makes such a failure end the run).
    Rank 1's logits turn NaN from step 12 on: every rank skips steps 12 and 13, the run stops with
    one line, exit 1, and the checkpoint due at step 20 is never reached: step 10 stays the newest."""
    settings = (f"run.storage_path={storage}", "run.name=diverged", *SETTINGS, "train.max_bad_steps=2",
                "train.global_batch_size=8", "train.micro_batch_size=2", "scaling.num_workers=4", "scaling.min_workers=1",
                "scaling.cpus_per_worker=0.6", "run.max_failures=0")
    job = run_job(*settings, "fault.kill_rank=1", "fault.at_step=12", "fault.kind=nan")
    assert job.returncode == 1, job.stderr[-3000:]
    assert "fault injection: rank 1 computes NaN logits from step 12 on" in job.stdout + job.stderr
    lines = [line for line in job.stderr.splitlines() if line.startswith("meshtrain: training stopped")]
    assert len(lines) == 1, job.stderr[-3000:]
    checkpoints = storage / "diverged" / "checkpoints"
    assert "train.max_bad_steps=2: 2 steps in a row up to step 13 were skipped" in lines[0]
    assert f"last committed checkpoint: {checkpoints / 'step-00000010'} (step 10)" in lines[0]
    assert "run.name=diverged" in lines[0]
    run_dir = storage / "diverged"
    records = read_metrics(run_dir)
    assert [r.step for r in records if isinstance(r, CheckpointSaveRecord)] == [10]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == ["step-00000010"]
    assert [r.step for r in records if isinstance(r, TrainRecord)][-1] == 13
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["world_size"] == 2
    assert {r.world_size for r in records if isinstance(r, TrainRecord)} == {2}


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_s3(monkeypatch, "meshtrain") as options:
        yield options["client_kwargs"]["endpoint_url"]


def test_a_hung_worker_is_diagnosed_and_the_run_resumes_from_s3_to_the_same_weights_holding_no_secret(
    storage: Path, unbroken: dict, s3_endpoint: str, tmp_path: Path
) -> None:
    """Checkpoints on S3 (a local moto endpoint); rank 1 hangs at step 15: the watchdog names where,
    the group restarts from S3's step 10 and ends on the unbroken run's weights; no file, object or
    log line holds the secret key."""
    import s3fs

    secret = "meshtrain-test-secret-91c2"  # moto takes any credentials: these must reach s3fs, and no file
    options = '{key: testing, secret: %s, client_kwargs: {endpoint_url: "%s"}}' % (secret, s3_endpoint)
    job = run_job(
        f"run.storage_path={storage}", "run.name=on-s3", *SETTINGS,
        "checkpoint.path=s3://meshtrain/runs", f"checkpoint.storage_options={options}",
        "fault.kill_rank=1", "fault.at_step=15", "fault.kind=hang", "run.hang_timeout_s=5",
        **S3_ENV,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    run_dir = storage / "on-s3"
    output = job.stdout + job.stderr
    assert "fault injection: rank 1 hangs at step 15" in output
    assert "no progress for" in output and "run.hang_timeout_s=5" in output
    # Where it hung, from the flight recorders of both ranks (gloo's collectives are recorded too):
    # rank 0 waits in one of FSDP's collectives of step 15, which the sleeping rank 1 never entered.
    diagnosis = (run_dir / "hangs" / "diagnosis.txt").read_text().strip()
    assert re.fullmatch(
        r"\[meshtrain\] hang: gloo:\w+ #\d+ on process group \S+ \([\w, -]*ranks 0-1\) never completed: rank 0 waits "
        rf"in it; rank 1 never entered it \(last there: #\d+, while training step 15\); dumps in {re.escape(str(run_dir / 'hangs'))}",
        diagnosis,
    ), diagnosis
    assert diagnosis in output
    assert [r.path for r in read_metrics(run_dir) if isinstance(r, CheckpointLoadRecord)] == [
        "s3://meshtrain/runs/on-s3/step-00000010"
    ]
    assert not (run_dir / "checkpoints").exists()  # nothing went to local storage
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_endpoint})
    steps = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("meshtrain/runs/on-s3"))
    assert steps == ["step-00000020", "step-00000030", "step-00000040"]
    assert fs.exists("meshtrain/runs/on-s3/step-00000040/COMMITTED")
    fs.get("meshtrain/runs/on-s3/step-00000040", str(tmp_path / "step-00000040"), recursive=True)
    assert_same_weights(model_weights(tmp_path / "step-00000040", tmp_path), unbroken)
    assert secret not in job.stdout + job.stderr
    assert not [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not [key for key in fs.find("meshtrain/runs/on-s3") if secret.encode() in fs.cat(key)]
