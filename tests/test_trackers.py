"""Experiment trackers: what the driver hands W&B and MLflow, checked without Ray (the Ray job that is
killed and resumed with both trackers on is in test_recovery.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jobs import REPO
from meshtrain.cluster.preflight import preflight
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.observe.progress import StepRecorder
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    GroupStartRecord,
    RecordFollower,
    ResizeRecord,
    RunPaths,
    SourceEval,
    StragglerRecord,
    TextSample,
    TextSamplesRecord,
    TrainRecord,
    append_records,
    read_records,
)
from meshtrain.observe.tracker_relay import TrackerRelay
from meshtrain.observe.trackers import TrackerSink, logged_keys, tracker_run_id, tracker_values
from record_samples import make


class Recording:
    name = "fake"

    def __init__(self, fail_at: set[int] | None = None) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.fail_at = fail_at or set()
        self.closed: bool | None = None

    def log(self, step: int, values: dict[str, float], timestamp: float | None) -> None:
        if step in self.fail_at:
            raise ConnectionError("tracker down")
        self.rows.append((step, values))

    def log_text(self, step: int, name: str, rows: list[dict[str, str]]) -> None:
        self.rows.append((step, {name: rows}))  # type: ignore[dict-item]

    def close(self, finished: bool) -> None:
        self.closed = finished


def config(tmp_path: Path, *overrides: str) -> MeshtrainConfig:
    return load_config(None, [f"run.storage_path={tmp_path}", "run.name=tracked", *overrides])


TRAIN = TrainRecord(step=5, loss=2.5, lr=1e-3, grad_norm=0.5, tokens=640, tokens_per_s=100.0, step_time_s=0.2,
                    data_wait_s=0.01, interval_steps=1, elapsed_s=1.0, skipped_steps=0, world_size=2, time=1.0,
                    samples=[1, 2])


def test_records_become_named_numbers() -> None:
    assert tracker_values(TRAIN) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tokens": 640.0, "train/tokens_per_s": 100.0,
        "train/step_time_s": 0.2, "train/data_wait_s": 0.01, "train/skipped_steps": 0.0, "run/workers": 2.0,
    }
    evaluation = make(EvalRecord, step=10, loss=3.0, perplexity=20.1, samples=16,
                        sources={"web": SourceEval(loss=2.9, tokens=10), "code/py": SourceEval(loss=3.1, tokens=5),
                                 "empty": SourceEval(loss=None, tokens=0)})
    assert tracker_values(evaluation) == {
        "eval/loss": 3.0, "eval/perplexity": 20.1, "eval/web/loss": 2.9, "eval/code_py/loss": 3.1,
    }
    save = CheckpointSaveRecord(step=10, path="x", blocking_s=0.1, total_s=2.0, bytes=99, mode="async")
    assert tracker_values(save) == {"checkpoint/save_s": 2.0, "checkpoint/loop_stall_s": 0.1, "checkpoint/bytes": 99.0}
    assert tracker_values(make(StragglerRecord, step=3, rank=1)) == {}


def test_each_step_is_logged_once_across_restarts_and_a_failing_tracker_never_raises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    earlier = [replace(TRAIN, step=s) for s in (1, 2, 3)] + [make(CheckpointSaveRecord, step=2, total_s=1.0)]
    append_records(metrics, earlier)
    with metrics.open("ab") as file:
        file.write(b'{"event": "train", "st')  # a torn last line
    assert logged_keys(read_records(metrics)) == {("train", 1), ("train", 2), ("train", 3), ("checkpoint_save", 2)}

    backend = Recording(fail_at={5})
    sink = TrackerSink(backend, logged_keys(read_records(metrics)))
    sink.record(make(GroupStartRecord, restarts=1, workers=2))
    sink.record(make(ResizeRecord, from_workers=4, to_workers=2, reason="capacity lost"))
    sink.record(make(CheckpointLoadRecord, step=2, rng_restored=True))
    for step in (3, 4, 5, 6):  # step 3 was logged before the restart; the tracker fails at step 5
        sink.record(replace(TRAIN, step=step))
    sink.close(finished=True)
    assert [step for step, _ in backend.rows] == [2, 4, 6]
    assert backend.rows[0][1] == {"run/restarts": 1.0, "run/workers": 2.0, "run/resumed_from_step": 2.0}
    assert "run/restarts" not in backend.rows[1][1]
    assert backend.closed is True
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "[meshtrain] fake: logging failed at step 5 (ConnectionError: tracker down); training goes on, "
        "records that fail are dropped",
        "[meshtrain] fake: 1 records not logged",
    ]


def test_the_driver_relays_every_record_once_across_group_restarts_and_relaunches(tmp_path: Path) -> None:
    """The driver follows metrics.jsonl while rank 0 and its own downstream evaluations append to it:
    each (event, step) and each downstream task reaches the tracker once, a restarted group's retrained
    steps are skipped, a line torn by a killed rank 0 costs nothing of the next group's, the records
    left after training are handed over on exit, and a relaunch logs only what is new."""
    metrics = tmp_path / "metrics.jsonl"

    def relay(backend: Recording) -> TrackerRelay:
        follower = RecordFollower(metrics)
        return TrackerRelay([TrackerSink(backend, logged_keys(follower.new_records()))], follower, poll_s=0.01)

    scored = [make(DownstreamEvalRecord, step=2, task="mc/x", scores={"acc": 0.25, "acc_norm": 0.5}, samples=8),
              make(DownstreamEvalRecord, step=2, task="ppl", scores={"bits_per_byte": 2.5}, samples=8)]
    samples = make(TextSamplesRecord, step=2, samples=[
        TextSample(prompt="def", continuation=" f():", new_tokens=3, stopped_at_eos=False)])
    first = Recording()
    with relay(first) as running:
        group = StepRecorder(metrics)
        group.record(make(GroupStartRecord, restarts=0, workers=2))
        for step in (1, 2, 3):
            group.record(replace(TRAIN, step=step))
        append_records(metrics, [*scored, samples])  # the driver's evaluations of step 2
        with metrics.open("ab") as file:
            file.write(b'{"event": "train", "st')  # rank 0 killed mid-line
        group = StepRecorder(metrics)  # the restarted group resumes from step 2
        group.record(make(GroupStartRecord, restarts=1, workers=2))
        group.record(make(CheckpointLoadRecord, step=2, path="x", load_s=0.1))
        for step in (3, 4):
            group.record(replace(TRAIN, step=step))
        running.poll()
        append_records(metrics, [replace(scored[0], step=4)])  # lands after training: handed over on exit
    assert first.closed is True
    assert [(step, sorted(values)) for step, values in first.rows] == [
        (1, ["run/restarts", *sorted(tracker_values(TRAIN))]),
        (2, sorted(tracker_values(TRAIN))),
        (3, sorted(tracker_values(TRAIN))),
        (2, ["downstream/mc_x/acc", "downstream/mc_x/acc_norm"]),
        (2, ["downstream/ppl/bits_per_byte"]),
        (2, ["samples"]),
        (2, ["run/restarts", "run/resumed_from_step"]),
        (4, sorted(tracker_values(TRAIN))),
        (4, ["downstream/mc_x/acc", "downstream/mc_x/acc_norm"]),
    ]
    assert first.rows[6][1]["run/restarts"] == 1.0

    again = Recording()  # a relaunch: everything above was logged by the first driver
    with pytest.raises(KeyboardInterrupt):
        with relay(again):
            StepRecorder(metrics).record(replace(TRAIN, step=4))
            StepRecorder(metrics).record(replace(TRAIN, step=5))
            raise KeyboardInterrupt
    assert [step for step, _ in again.rows] == [5] and again.closed is False


def test_the_tracker_run_id_is_stable_per_run_directory(tmp_path: Path) -> None:
    first = tracker_run_id(RunPaths("my run/1", tmp_path / "a"))
    assert first == tracker_run_id(RunPaths("my run/1", tmp_path / "a"))
    assert first.startswith("my_run_1-") and first != tracker_run_id(RunPaths("my run/1", tmp_path / "b"))


def test_an_mlflow_run_is_continued_by_a_restart(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from meshtrain.observe.mlflow_tracker import MlflowTracker, tracking_uri

    cfg = config(tmp_path, "metrics.mlflow=true", "train.steps=70")
    paths = RunPaths("tracked", tmp_path)
    first = MlflowTracker(cfg.metrics, paths, cfg.model_dump(mode="json"))
    first.log(1, {"train/loss": 3.0}, 10.0)
    first.close(finished=False)
    second = MlflowTracker(cfg.metrics, paths, cfg.model_dump(mode="json"))
    second.log(2, {"train/loss": 2.5}, None)
    second.close(finished=True)
    assert second.run_id == first.run_id
    client = MlflowClient(tracking_uri(cfg.metrics, paths))
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "70"
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss")] == [(1, 3.0), (2, 2.5)]


def test_a_tracker_that_cannot_work_is_refused_before_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    with pytest.raises(ConfigError, match=r"^metrics.mlflow_tracking_uri=http://127.0.0.1:9 cannot be reached \(.*\); "
                                           r"start the server, fix the URI, or set metrics.mlflow=false$"):
        preflight(config(tmp_path, "metrics.mlflow=true", "metrics.mlflow_tracking_uri=http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match=r"^metrics.mlflow_tracking_uri=http://alice:<redacted>@127.0.0.1:9 cannot"):
        preflight(config(tmp_path, "metrics.mlflow=true", "metrics.mlflow_tracking_uri=http://alice:hunter2@127.0.0.1:9"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(ConfigError, match=r"^metrics.wandb=true needs W&B credentials: run `wandb login` or set "
                                           r"WANDB_API_KEY .* set WANDB_MODE=offline and `wandb sync` the run later$"):
        preflight(config(tmp_path, "metrics.wandb=true"))
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^metrics.wandb=true: W&B at http://127.0.0.1:9 cannot be reached "
                                           r"\(ConnectionError\); .* set WANDB_MODE=offline and `wandb sync` the run later$"):
        preflight(config(tmp_path, "metrics.wandb=true"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    preflight(config(tmp_path, "metrics.wandb=true"))

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else find_spec(name, *a))
    for tracker, extra in (("wandb", "wandb"), ("mlflow", "mlflow")):
        with pytest.raises(ConfigError, match=rf"^metrics.{tracker}=true needs {tracker}: pip install -e '.\[{extra}\]', "
                                               rf"or set metrics.{tracker}=false$"):
            preflight(config(tmp_path, f"metrics.{tracker}=true"))


def test_a_run_without_trackers_imports_neither_package(tmp_path: Path) -> None:
    """The driver's tracker setup and the launch checks of a default config load neither W&B nor MLflow."""
    code = f"""
import sys
from pathlib import Path
from meshtrain.cli.pretrain import main
from meshtrain.cluster.preflight import preflight
from meshtrain.observe.tracker_relay import TrackerRelay
from meshtrain.config.loading import load_config
from meshtrain.observe.run_folder import RunPaths
cfg = preflight(load_config(None, ["run.storage_path={tmp_path}", "run.name=plain"]))
assert TrackerRelay.open(cfg.metrics, RunPaths("plain", Path("{tmp_path}")), cfg.model_dump(mode="json")) is None
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("wandb", "mlflow"))
assert not loaded, loaded
print("neither")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "neither", result.stderr[-2000:]
