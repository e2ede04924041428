"""A run owns its folder: one driver per run name, committed work never silently replaced, damaged run
files named in one line. All of it before Ray starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import meshtrain.cluster.launcher
from meshtrain.cli.pretrain import main
from meshtrain.cluster.run_lease import LOCK_FILE, RunHeld, RunLease


def _refuse_launch(*args: object, **kwargs: object) -> None:
    raise AssertionError("Ray was started")


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meshtrain.cluster.launcher, "init_ray", _refuse_launch)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_a_second_driver_on_a_live_run_stops_at_once_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    run_dir = tmp_path / "r"
    with RunLease.take(run_dir, "r", "first-launch"):
        code, err = run([f"run.storage_path={tmp_path}", "run.name=r"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"run.name=r: another driver is running this run (host {os.uname().nodename}, PID {os.getpid()}, since" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # the refused driver wrote nothing
    with RunLease.take(run_dir, "r", "second-launch"):  # released: the next driver takes it
        pass


def test_drivers_started_together_get_one_lease(tmp_path: Path) -> None:
    barrier, outcomes, leases = threading.Barrier(8), [], []

    def take() -> None:
        barrier.wait()
        try:
            leases.append(RunLease.take(tmp_path / "r", "r", f"launch-{threading.get_ident()}"))
            outcomes.append("took")
        except RunHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["took"]
    leases[0].release()


def test_a_killed_driver_leaves_no_lease_behind(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from meshtrain.cluster.run_lease import RunLease\n"
         f"lease = RunLease.take(Path({str(tmp_path / 'r')!r}), 'r', 'killed')\nprint('held', flush=True)\n"
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunHeld, match=f"PID {holder.pid}"):
            RunLease.take(tmp_path / "r", "r", "while-alive")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        RunLease.take(tmp_path / "r", "r", "after-the-kill").release()
    finally:
        holder.kill()


def _committed(tmp_path: Path, *steps: int) -> None:
    for step in steps:
        folder = tmp_path / "r" / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMMITTED").write_text(json.dumps({"step": step, "files": {}}))


def test_resume_false_over_committed_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    _committed(tmp_path, 10, 20, 30)
    before = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    code, err = run([f"run.storage_path={tmp_path}", "run.name=r", "checkpoint.resume=false"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "checkpoint.resume=false: run r holds committed checkpoints (steps 10, 20, 30) that this launch would " \
           "replace; choose another run.name, or delete" in err
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == before
    assert not (tmp_path / "r" / "config.yaml").exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "not yaml"])
def test_a_damaged_config_yaml_is_one_line_naming_it(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    _committed(tmp_path, 10)
    text = {"truncated": "model:\n  preset: debug\ndata:\n  seq_len: 1", "empty": "", "not yaml": "model: [unclosed"}
    (tmp_path / "r" / "config.yaml").write_text(text[damage])
    code, err = run([f"run.storage_path={tmp_path}", "run.name=r"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"run.name=r: {tmp_path / 'r' / 'config.yaml'} is damaged (" in err and "delete it" in err


def test_a_truncated_tokenizer_json_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "tokenizer.json").write_text('{"version": "1.0", "truncation": null, "added_tok')
    code, err = run([f"run.storage_path={tmp_path}", "run.name=r"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"run.name=r: {tmp_path / 'r' / 'tokenizer.json'} is damaged (" in err and "delete it" in err


def test_the_fault_matrix_round_two_rows_are_right(tmp_path: Path) -> None:
    """jobs/bench_faults.py's rows for bad input and a busy run folder: each refused in one line, exit 2,
    before Ray starts, with nothing of the run written or replaced (each row one jobs/pretrain.py)."""
    from meshtrain_bench.faults import Matrix

    rows = list(Matrix(tmp_path, print).round_two())
    assert len(rows) == 14 and [row.fault for row in rows if not row.right] == [], [r.wrong for r in rows]
