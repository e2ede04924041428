"""Both trackers on a Ray job that loses a worker and resumes: W&B (offline) and MLflow (sqlite) each
read back one run holding every logged step once, with metrics.jsonl's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs import read_metrics, run_job
from meshtrain.config import load_config
from meshtrain.observe.mlflow_tracker import RUN_ID_TAG, tracking_uri
from meshtrain.observe.outputs import RunPaths
from meshtrain.observe.trackers import tracker_run_id, tracker_values

pytestmark = pytest.mark.ray

SETTINGS = (
    "train.steps=20", "optim.warmup_steps=5", "train.log_every=1", "checkpoint.interval=10", "data.max_documents=40", "run.max_failures=1",
    "eval.interval=10", "metrics.wandb=true", "metrics.mlflow=true", "metrics.wandb_tags=[ci,resume]",
    "fault.kill_rank=1", "fault.at_step=15",
)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    storage = tmp_path_factory.mktemp("tracked")
    job = run_job(f"run.storage_path={storage}", "run.name=tracked", *SETTINGS, WANDB_MODE="offline")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "fault injection: rank 1 sends itself SIGKILL at step 15" in job.stdout + job.stderr
    records = read_metrics(storage / "tracked")
    assert [r["step"] for r in records if r["event"] == "checkpoint_load"] == [10]  # killed once, resumed once
    cfg = load_config(None, [f"run.storage_path={storage}", "run.name=tracked", *SETTINGS])
    return {"paths": RunPaths("tracked", storage), "cfg": cfg, "records": records}


def first_values(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Each tracker series from metrics.jsonl, by step, as first logged (a retrained step repeats)."""
    series: dict[str, dict[int, float]] = {}
    for record in records:
        if "step" not in record:
            continue
        for name, value in tracker_values(record).items():
            series.setdefault(name, {}).setdefault(record["step"], value)
    return series


def test_mlflow_holds_one_run_with_every_logged_step_once(tracked: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(tracked["cfg"], tracked["paths"]))
    experiment = client.get_experiment_by_name("meshtrain")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags[RUN_ID_TAG] == tracker_run_id(tracked["paths"])
    assert run.data.params["train.steps"] == "20" and run.data.params["fault.at_step"] == "15"
    expected = first_values(tracked["records"])
    retrained = [r["step"] for r in tracked["records"] if r["event"] == "train"]
    assert len(retrained) > 20  # steps 11.. were logged twice in metrics.jsonl, once before the kill
    for name in ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "checkpoint/save_s"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == sorted(expected[name]), name  # each step once
        assert {m.step: m.value for m in history} == expected[name], name
    assert [m.value for m in client.get_metric_history(run.info.run_id, "run/resumed_from_step")] == [10.0]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "run/restarts")] == [(1, 0.0), (10, 1.0)]


def test_wandb_offline_holds_one_run_with_every_logged_step_once(tracked: dict[str, Any]) -> None:
    from wandb_records import read_run

    paths: RunPaths = tracked["paths"]
    files = sorted((paths.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per worker-group start: before the kill and after the resume
    runs = [read_run(path) for path in files]
    assert {run["id"] for run in runs} == {tracker_run_id(paths)}  # one W&B run, resumed
    assert all(run["config"]["train"]["steps"] == 20 and run["config"]["fault"]["at_step"] == 15 for run in runs)
    rows = [row for run in runs for row in run["history"]]
    expected = first_values(tracked["records"])
    for name in ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "checkpoint/save_s"):
        logged = [(row["step"], row[name]) for row in rows if name in row]
        assert sorted(step for step, _ in logged) == sorted(expected[name]), name  # each step once
        assert dict(logged) == expected[name], name
    assert [(row["step"], row["run/restarts"]) for row in rows if "run/restarts" in row] == [(1, 0), (10, 1)]
    assert [row["step"] for row in rows if "run/resumed_from_step" in row] == [10]
