"""Replica groups (fault_tolerance.mode=replica) without Ray: two replica groups of one worker each,
each in its own process around the real trainer, under a lighthouse in this process. One is
SIGKILLed mid-run; the other keeps stepping, and a replacement joins by receiving its state from the
survivor's memory. Every step is trained once, on the same samples as one worker would, with the
same losses and weights."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from meshtrain.config import MeshtrainConfig, load_config
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import read_records

pytestmark = pytest.mark.processes
pytest.importorskip("torchft")

STEPS, KILL_AT, HEARTBEAT_S = 24, 5, 1.0
STEP_S = 0.25  # each replica's step time, so a replacement starts while the survivor still trains


def config(tmp_path: Path, name: str, *overrides: str) -> MeshtrainConfig:
    return load_config(None, [
        "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32",
        "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2", "optim.schedule_steps=30",
        f"train.steps={STEPS}", "eval.interval=null", "checkpoint.enabled=true", "checkpoint.interval=4",
        "checkpoint.mode=sync", f"run.storage_path={tmp_path}", f"run.name={name}", *overrides,
    ])


def replica_config(tmp_path: Path, name: str, *overrides: str) -> MeshtrainConfig:
    return config(tmp_path, name, "scaling.num_workers=2", "parallel.strategy=hybrid_shard", "parallel.shard=1",
                  "fault_tolerance.mode=replica", f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_S}",
                  "fault_tolerance.timeout_s=10", "fault_tolerance.join_timeout_s=1", *overrides)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def replica_process(cfg: MeshtrainConfig, corpus: DataPlan, index: int, lighthouse: str, joining: bool,
                    out: str) -> None:
    """One replica group's only worker: the real trainer, each step taking at least STEP_S."""
    import meshtrain.train.trainer as trainer_module
    from meshtrain.distributed.replicas import ReplicaPlacement
    from meshtrain.observe.progress import StepRecorder
    from meshtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    original = trainer_module.train_step

    def paced(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        output = original(*args, **kwargs)
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - started)))
        return output

    trainer_module.train_step = paced
    from meshtrain.data import open_data

    recorder = StepRecorder(Path(cfg.run.storage_path) / cfg.run.name / "metrics.jsonl")
    trainer = Trainer(cfg, open_data(corpus, cfg.data.seq_len, cfg.train.seed), WorkerLayout(), torch.device("cpu"),
                      recorder.record, None, replica=ReplicaPlacement(index, 2, lighthouse, joining))
    try:
        trainer.run()
    finally:
        trainer.close()
    torch.save(weights(trainer.model), out)


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if r["event"] == "train"]


@pytest.fixture(scope="module")
def reference(corpus: DataPlan, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same steps on one worker in restart mode: the losses and weights replica mode must give."""
    from meshtrain.train.trainer import Trainer
    from meshtrain.data import open_data

    cfg = config(tmp_path_factory.mktemp("reference"), "reference", "scaling.num_workers=1")
    records: list[dict[str, Any]] = []
    trainer = Trainer(cfg, open_data(corpus, cfg.data.seq_len, cfg.train.seed), WorkerLayout(), torch.device("cpu"),
                      records.append, None)
    try:
        trainer.run()
    finally:
        trainer.close()
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}, weights(trainer.model)


@pytest.mark.parametrize("killed", [1, 0], ids=["the-other-replica", "the-replica-writing-the-records"])
def test_a_killed_replica_costs_the_survivor_no_restart_and_its_replacement_heals_from_memory(
    corpus: DataPlan, tmp_path: Path, reference: tuple[dict[int, float], dict[str, torch.Tensor]], killed: int
) -> None:
    from meshtrain.distributed.replicas import LighthouseServer

    expected_losses, expected_weights = reference
    cfg = replica_config(tmp_path, "replicas", f"fault.kill_rank={killed}", f"fault.at_step={KILL_AT}")
    run_dir = tmp_path / "replicas"
    lighthouse = LighthouseServer(cfg.fault_tolerance, replicas=2)
    spawn = multiprocessing.get_context("spawn")
    out = {index: str(tmp_path / f"replica{index}.pt") for index in (0, 1)}
    processes = {index: spawn.Process(target=replica_process, args=(cfg, corpus, index, lighthouse.address, False,
                                                                     out[index]))
                 for index in (0, 1)}
    try:
        for process in processes.values():
            process.start()
        processes[killed].join(timeout=120)
        assert processes[killed].exitcode == -9, processes[killed].exitcode  # SIGKILL at step KILL_AT
        killed_at = time.time()
        replacement = spawn.Process(target=replica_process, args=(cfg, corpus, killed, lighthouse.address, True,
                                                                  out[killed]))
        replacement.start()
        survivor = processes[1 - killed]
        for process in (survivor, replacement):
            process.join(timeout=180)
            assert process.exitcode == 0, process.exitcode
    finally:
        for process in [*processes.values()]:
            if process.is_alive():
                process.kill()
        lighthouse.close()

    records = read_records(run_dir / "metrics.jsonl")
    trained = train_records(run_dir)
    # Every step trained and logged once, in order, by the first live group: the killed one before its
    # death when it was writing, the survivor after.
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    for record in trained:
        assert record["loss"] == pytest.approx(expected_losses[record["step"]], rel=1e-4), record["step"]
    # The survivor stalled about one heartbeat timeout, not a restart.
    times = [r["time"] for r in trained]
    assert max(b - a for a, b in zip(times, times[1:])) <= HEARTBEAT_S + 2 + STEP_S
    lost = [r for r in records if r["event"] == "replica_lost"]
    assert [(r["step"], r["participants"]) for r in lost] == [(KILL_AT, 1)]
    joined = [r for r in records if r["event"] == "replica_joined"]
    assert len(joined) == 1 and joined[0]["replica"] == killed and joined[0]["participants"] == 2
    assert KILL_AT <= joined[0]["step"] < STEPS
    assert joined[0]["time"] - killed_at <= 60
    assert not [r for r in records if r["event"] == "checkpoint_load"]  # no checkpoint was read
    saved = [r["step"] for r in records if r["event"] == "checkpoint_save"]
    assert saved == list(range(4, STEPS + 1, 4))  # by one group each
    final = {index: torch.load(out[index]) for index in (0, 1)}
    for name, value in expected_weights.items():
        assert torch.equal(final[0][name], final[1][name]), name  # the replicas hold one model
        drift = ((final[0][name] - value).norm() / value.norm()).item()
        assert drift <= 1e-5, (name, drift)  # summed over replicas in another order than on one worker
    summary = {"joined_after_kill_s": round(joined[0]["time"] - killed_at, 1),
               "longest_gap_s": round(max(b - a for a, b in zip(times, times[1:])), 2)}
    print(json.dumps(summary))
