"""Long checkpoint saves against the hang watchdog: a save three times longer than the hang timeout
that keeps writing commits; a writer that stops writing is caught."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import FileSystem

import meshtrain.checkpoint.write_progress as write_progress
import meshtrain.train.parts as parts_module
from meshtrain.checkpoint.storage import CheckpointStorage, checkpoint_root
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.train.trainer import Trainer
from trainers import cpu_trainer
from meshtrain.train.watchdog import HangWatchdog


HANG_TIMEOUT_S = 2.0  # long enough for a training step of this model on a busy machine


def config(tmp_path: Path, name: str) -> MeshtrainConfig:
    return load_config(None, [
        "train.steps=3", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=8",
        "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=1",
        "scaling.num_workers=1", "checkpoint.enabled=true", "checkpoint.interval=100", "eval.interval=null",
        f"run.hang_timeout_s={HANG_TIMEOUT_S}", f"run.storage_path={tmp_path}", f"run.name={name}",
    ])


class ThrottledStream:
    """Writes at ``bytes_per_s``; with ``stall`` set, the next write blocks until ``release`` is set."""

    def __init__(self, stream: Any, bytes_per_s: float, stall: threading.Event | None, release: threading.Event) -> None:
        self.stream, self.bytes_per_s, self.stall, self.release = stream, bytes_per_s, stall, release

    def write(self, data: Any) -> int:
        if self.stall is not None and self.stall.is_set():
            self.release.wait()
        time.sleep(len(memoryview(data).cast("B")) / self.bytes_per_s)
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def slow_storage(monkeypatch: pytest.MonkeyPatch, bytes_per_s: float, stall: threading.Event | None = None) -> threading.Event:
    release = threading.Event()
    original = FileSystem.create_stream

    @contextmanager
    def throttled(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield ThrottledStream(stream, bytes_per_s, stall, release)

    monkeypatch.setattr(FileSystem, "create_stream", throttled)
    monkeypatch.setattr(write_progress, "PIECE_BYTES", 64 * 1024)  # progress every 64 KiB
    return release


def run_watched(cfg: MeshtrainConfig, corpus: DataPlan, monkeypatch: pytest.MonkeyPatch, fired: list[str]) -> Trainer:
    monkeypatch.setattr(parts_module, "HangWatchdog",
                        lambda timeout_s, rank, progress, report, on_fire: HangWatchdog(timeout_s, rank, fired.append, progress))
    trainer = cpu_trainer(cfg, corpus)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def test_a_save_three_times_the_hang_timeout_commits_while_it_keeps_writing(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path, "slow")
    fired: list[str] = []
    state_bytes = 11.4e6  # the final checkpoint of this model: parameters and AdamW moments, fp32
    slow_storage(monkeypatch, bytes_per_s=state_bytes / (3.5 * HANG_TIMEOUT_S))
    started = time.monotonic()
    run_watched(cfg, corpus, monkeypatch, fired)
    took = time.monotonic() - started
    assert fired == [], fired
    assert took > 3 * HANG_TIMEOUT_S  # the final (synchronous) save alone took that long
    committed = CheckpointStorage(checkpoint_root(cfg.checkpoint, cfg.run)).committed()
    assert [c.step for c in committed] == [3] and committed[0].manifest["bytes"] > 0.9 * state_bytes
    assert write_progress.bytes_written() >= committed[0].manifest["bytes"]


def test_a_writer_that_stops_writing_is_detected(corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path, "stalled")
    fired: list[str] = []
    stall = threading.Event()
    release = slow_storage(monkeypatch, bytes_per_s=1e9, stall=stall)
    stall.set()  # the first checkpoint write blocks until released

    def release_after_detection() -> None:
        deadline = time.monotonic() + 20
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()

    helper = threading.Thread(target=release_after_detection)
    helper.start()
    run_watched(cfg, corpus, monkeypatch, fired)
    helper.join()
    assert len(fired) == 1, fired
    assert "no progress for" in fired[0] and "while saving the checkpoint of step 3" in fired[0]
