"""Downstream evaluations the driver will not wait for are cancelled, their leases released, and the last
line names the steps left unscored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtrain.checkpoint.storage import run_checkpoints
from meshtrain.cluster.downstream import DownstreamEvaluations
from meshtrain.config.loading import load_config
from meshtrain.observe.run_folder import DownstreamEvalFailedRecord, RunPaths, read_records


def test_evaluations_not_waited_for_are_cancelled_and_release_their_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", "eval.samples.prompts=['def ']",
                             "eval.downstream.final_wait_s=0"])
    storage = run_checkpoints(cfg.checkpoint, cfg.run)
    for step in (10, 20):
        folder = tmp_path / "r" / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMMITTED").write_text(json.dumps({"step": step, "files": {}}))
    lines: list[str] = []
    evaluations = DownstreamEvaluations(cfg.eval, cfg.checkpoint, cfg.run, RunPaths("r", tmp_path),
                                        use_gpu=cfg.scaling.use_gpu, last_step=cfg.train.steps, print_line=lines.append)
    cancelled: list[object] = []
    monkeypatch.setattr(ray, "cancel", lambda ref, force=False: cancelled.append(ref))
    for checkpoint in storage.committed():  # as _submit_new leaves them: leased, their tasks running
        storage.lease(checkpoint.path, holder="downstream evaluation of run r")
        evaluations.pending[f"task-{checkpoint.step}"] = checkpoint
    assert all(storage.leased(c.path) for c in storage.committed())

    evaluations._cancel_pending(0)

    assert sorted(cancelled) == ["task-10", "task-20"] and evaluations.pending == {}
    assert not any(storage.leased(c.path) for c in storage.committed())  # pruning may take them again
    failed = read_records(tmp_path / "r" / "metrics.jsonl", DownstreamEvalFailedRecord)
    assert [r.step for r in failed] == [10, 20] and all("final_wait_s=0s" in r.error for r in failed)
    assert lines == [f"[meshtrain] downstream evaluation of step(s) 10, 20 not scored (cancelled: the driver waited "
                     f"eval.downstream.final_wait_s=0s after training); score them with python jobs/evaluate.py "
                     f"{tmp_path / 'r'}, or raise eval.downstream.final_wait_s"]
