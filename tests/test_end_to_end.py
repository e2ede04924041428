"""The default job, run the way users run it: submitted with ``ray job submit`` to a Ray head
started with ``ray start --head``, and directly with ``python jobs/pretrain.py`` (a local Ray).

The submitted job is the default config cut to its first 100 of 200 steps (``train.steps=100``): the
same model, data, evaluation and checkpoint cadence, in half the suite's time; the README's first
command runs all 200."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from jobs import REPO, read_metrics, run_job
from meshtrain.observe.run_folder import CheckpointSaveRecord, EvalRecord, TrainRecord
from raynodes import RAY, SharedHead, ray_env, wait_until

STEPS = 100
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"}



def ray_jobs_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The Ray Jobs CLI in its own process (the SDK in this process could hold an auth mode that an
    earlier test's ``import ray`` fixed), with the shared head's token."""
    return subprocess.run(
        [RAY, "job", *args], cwd=REPO, env=ray_env(**SharedHead.join()), capture_output=True, text=True, timeout=timeout
    )


def test_default_job_submitted_with_ray_job_submit(tmp_path: Path) -> None:
    """The README's `ray job submit` to a head started with `ray start` (the session's shared head)."""
    SharedHead.join()
    dashboard = SharedHead.dashboard
    attempts: list[str] = []

    def job_server_up() -> bool:
        listing = ray_jobs_cli("list", "--address", dashboard)
        attempts.append(listing.stderr.strip()[-300:])
        return listing.returncode == 0

    try:
        wait_until(job_server_up, 120, "the Ray head's job server", interval=1)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; last answer: {attempts[-1] if attempts else None}") from None
    # Exactly the README's form, plus where this run's outputs go and its length.
    submission = f"meshtrain-default-{tmp_path.name}"
    submit = ray_jobs_cli(
        "submit", "--address", dashboard, "--submission-id", submission, "--working-dir", ".",
        "--", "python", "jobs/pretrain.py", f"run.storage_path={tmp_path}", "run.name=default",
        f"train.steps={STEPS}",
        timeout=600,
    )
    answer = ray_jobs_cli("status", "--address", dashboard, submission)
    status = answer.stdout + answer.stderr  # the CLI reports through its logger
    log = ray_jobs_cli("logs", "--address", dashboard, submission).stdout
    assert f"job '{submission}' succeeded".lower() in status.lower(), f"{status} {submit.stdout[-2000:]} {submit.stderr[-2000:]} {log[-3000:]}"
    assert submit.returncode == 0
    # Off a terminal the driver prints a handful of progress lines, not one per logged step.
    progress = [line for line in log.splitlines() if line.startswith("[meshtrain] step ")]
    assert progress[-1].startswith(f"[meshtrain] step {STEPS}/{STEPS} | loss") and "tok/s" in log and "ETA" in log
    assert 2 <= len(progress) <= 8, progress
    check_default_run(tmp_path / "default")


def check_default_run(run_dir: Path) -> None:
    records = read_metrics(run_dir)
    saves = [r for r in records if isinstance(r, CheckpointSaveRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    records = [r for r in records if isinstance(r, TrainRecord)]
    assert [r.step for r in records] == list(range(5, STEPS + 1, 5))
    assert [s.step for s in saves] == [50, 100]
    for record in records:
        assert STEP_KEYS <= record.to_json().keys()
    first, last = records[0].loss, sum(r.loss for r in records[-5:]) / 5
    assert last < first - 1.5, f"loss should fall clearly: {first:.3f} -> {last:.3f}"
    assert records[-1].tokens == STEPS * 16 * 128

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["final_loss"] == pytest.approx(records[-1].loss)
    assert summary["mesh_shape"] == [1, 2] and summary["world_size"] == 2
    assert summary["mean_tokens_per_s"] > 0 and summary["wall_time_s"] > summary["train_time_s"] > 0
    # Validation on the held-out 1% every 50 steps; it falls with the training loss.
    # Only documents held out whole are scored: in this corpus of long files, one global batch of windows.
    assert [e.step for e in evals] == [50, 100] and evals[-1].samples == 16
    assert evals[-1].tokens > 1000 and list(evals[-1].sources) == ["stdlib"]
    assert summary["eval_loss_by_source"] == {"stdlib": evals[-1].loss}
    assert evals[-1].loss < evals[0].loss and summary["eval_loss"] == evals[-1].loss
    assert summary["skipped_steps"] == 0 and summary["stopped"] is None

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["name"] == "default" and config["model"]["preset"] == "debug"
    assert (run_dir / "tokenizer.json").is_file()
    committed = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step-*/COMMITTED"))
    assert committed == ["step-00000050", "step-00000100"]
    assert config["checkpoint"]["keep"] == 3 and config["train"]["steps"] == STEPS


def test_layout_error_found_on_workers_exits_2_with_the_field(tmp_path: Path) -> None:
    """Workers learn the real workers-per-node from Ray; a wrong expectation is a config error, which
    stops the run at once (no restart can fix it).

    The job starts its own local Ray even though Ray's "current cluster" file names a cluster that is
    gone (what a killed `ray start` node leaves behind).
    """
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.exists() else None
    current.parent.mkdir(parents=True, exist_ok=True)
    current.write_text("127.0.0.1:1")  # nothing listens there
    try:
        job = run_job(
            f"run.storage_path={tmp_path}", "scaling.workers_per_node=1", "train.steps=2", "optim.warmup_steps=1",
            "run.max_failures=3", "data.max_documents=40",
        )
    finally:
        if before is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(before)
    assert job.returncode == 2
    ours = [line for line in job.stderr.splitlines() if line.startswith("meshtrain: config error")]
    assert ours == [
        "meshtrain: config error: scaling.workers_per_node=1, but Ray placed 2 workers per node; "
        "fix scaling.workers_per_node or leave it unset"
    ]
    # A restart cannot fix a config error: the group started once although run.max_failures=3.
    (starts,) = tmp_path.glob("*/worker_starts.jsonl")
    assert len(starts.read_text().splitlines()) == 1
