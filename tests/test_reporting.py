"""Hang watchdog, Ray Train reports spaced by time but taken at the same steps, TensorBoard files."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from corpora import stdlib_plan
from meshtrain.config import load_config
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.reporting import RayTrainReporter, TensorBoardWriter
from meshtrain.train.trainer import train
from meshtrain.train.watchdog import HangWatchdog


def test_the_watchdog_fires_once_armed_and_silent_and_not_while_progress_continues() -> None:
    fired: list[str] = []
    watchdog = HangWatchdog(0.4, rank=3, on_hang=fired.append)
    try:
        time.sleep(0.8)
        assert fired == []  # not armed before the first step ends
        for step in range(8):
            watchdog.beat(f"training step {step}", arm=True)
            time.sleep(0.1)
        assert fired == []
        watchdog.beat("saving the checkpoint of step 8")
        time.sleep(1.0)
    finally:
        watchdog.close()
    assert len(fired) == 1
    assert fired[0].startswith("[meshtrain] rank 3: no progress for ")
    assert "while saving the checkpoint of step 8 (run.hang_timeout_s=0.4)" in fired[0]


def test_reports_are_spaced_by_time_but_always_include_the_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train

    reports: list[dict[str, Any]] = []
    monkeypatch.setattr(ray.train, "report", reports.append)
    record = {"step": 0, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 0, "tokens_per_s": 9.0,
              "step_time_s": 0.1, "skipped_steps": 0, "event": "train", "elapsed_s": 1.0}
    spaced = RayTrainReporter(3600.0, rank=0, device=torch.device("cpu"))
    spaced.evaluated({"step": 2, "loss": 1.5, "perplexity": 4.48})
    for step in range(1, 6):
        spaced.logged({**record, "step": step}, last=step == 5)
    assert [r["step"] for r in reports] == [1, 5]
    assert reports[-1]["eval_loss"] == 1.5 and "event" not in reports[-1] and "elapsed_s" not in reports[-1]
    reports.clear()
    every = RayTrainReporter(0.0, rank=0, device=torch.device("cpu"))
    for step in range(1, 4):
        every.logged({**record, "step": step}, last=False)
    assert [r["step"] for r in reports] == [1, 2, 3]
    reports.clear()
    RayTrainReporter(0.0, rank=1, device=torch.device("cpu")).logged(record, last=True)
    assert reports == []  # rank 0 decides; alone, another rank never reports


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalar summaries of TensorBoard event files (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    values: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                values.setdefault(value.tag, []).append((event.step, value.simple_value))
    return values


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path: Path) -> None:
    corpus = stdlib_plan(tmp_path / "stores", validation={"fraction": 0.1})
    cfg = load_config(None, [
        "train.steps=4", "train.log_every=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=1",
        "scaling.num_workers=1", "checkpoint.enabled=false", "eval.interval=2", "eval.batches=1",
    ])
    writer = TensorBoardWriter(tmp_path / "tb")
    records: list[dict[str, Any]] = []

    def both(record: dict[str, Any]) -> None:
        records.append(record)
        writer.record(record)

    train(cfg, corpus, WorkerLayout(), torch.device("cpu"), both)
    writer.close()
    found = scalars(tmp_path / "tb")
    train_records = [r for r in records if r["event"] == "train"]
    assert found["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in train_records]
    assert [step for step, _ in found["eval/loss"]] == [2, 4]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/perplexity"} <= found.keys()


def test_ray_callbacks_are_checked_with_one_line_errors() -> None:
    from meshtrain.cluster.launcher import load_ray_callbacks
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: expected 'module:Class' entries"):
        load_config(None, ["metrics.ray_callbacks=[WandbCallback]"])
    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: cannot import 'no_such_module:Logger' "):
        load_ray_callbacks(["no_such_module:Logger"])
    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: 'json:JSONDecoder' is not a ray.train.UserCallback"):
        load_ray_callbacks(["json:JSONDecoder"])
    [callback] = load_ray_callbacks(["reportlog:ReportLog"])
    assert type(callback).__name__ == "ReportLog"
