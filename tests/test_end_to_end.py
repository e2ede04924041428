"""The default job, run the way a user runs it: ``python jobs/pretrain.py`` through a local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobs import read_metrics, run_job

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"}

pytestmark = pytest.mark.ray


def test_default_job_trains_and_writes_run_outputs(tmp_path: Path) -> None:
    job = run_job(f"run.storage_path={tmp_path}", "run.name=default")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    log = job.stdout + job.stderr
    assert "[meshtrain] step 200/200 | loss" in log and "tok/s" in log and "ETA" in log
    run_dir = tmp_path / "default"

    records = read_metrics(run_dir)
    saves = [r for r in records if r["event"] == "checkpoint_save"]
    records = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in records] == list(range(5, 201, 5))
    assert [s["step"] for s in saves] == [50, 100, 150, 200]
    for record in records:
        assert STEP_KEYS <= record.keys()
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.5, f"loss should fall clearly: {first:.3f} -> {last:.3f}"
    assert records[-1]["tokens"] == 200 * 16 * 128

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 200
    assert summary["final_loss"] == pytest.approx(records[-1]["loss"])
    assert summary["mesh_shape"] == [1, 2] and summary["world_size"] == 2
    assert summary["mean_tokens_per_s"] > 0 and summary["wall_time_s"] > summary["train_time_s"] > 0

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["name"] == "default" and config["model"]["preset"] == "debug"
    assert (run_dir / "tokenizer.json").is_file()
    committed = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step-*/COMMITTED"))
    assert committed == ["step-00000100", "step-00000150", "step-00000200"]  # checkpoint.keep=3


def test_layout_error_found_on_workers_exits_2_with_the_field(tmp_path: Path) -> None:
    """Workers learn the real workers-per-node from Ray; a wrong expectation is a config error."""
    job = run_job(f"run.storage_path={tmp_path}", "scaling.workers_per_node=1", "train.steps=2", "run.max_failures=0")
    assert job.returncode == 2
    ours = [line for line in job.stderr.splitlines() if line.startswith("meshtrain: config error")]
    assert ours == [
        "meshtrain: config error: scaling.workers_per_node=1, but Ray placed 2 workers per node; "
        "fix scaling.workers_per_node or leave it unset"
    ]
