"""Async checkpoint staging: one set of host buffers, refilled at every save (CPU; gloo ranks for FSDP2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import CheckpointStorage
from ranks import run_on_ranks


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def spy_on_staging(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every state dict DefaultStager hands to the writer, as it was returned."""
    staged: list[dict[str, Any]] = []
    original = DefaultStager.stage

    def stage(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        result = original(self, state_dict, **kwargs)
        staged.append(result)
        return result

    monkeypatch.setattr(DefaultStager, "stage", stage)
    return staged


def buffers(staged: dict[str, Any]) -> dict[str, int]:
    """Where every model and optimizer tensor of a staged state dict lives in host memory."""
    found: dict[str, int] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, torch.Tensor) and value.numel() > 1:
            found[where] = _local(value).data_ptr()

    walk({"model": staged["train"]["model"], "optimizer": staged["train"]["optimizer"]}, "")
    return found


def train_one_step(state: TrainState) -> None:
    loss = state.model(torch.arange(8.0).reshape(1, 8)).square().mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.progress.step += 1


def new_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return TrainState(model, optimizer, scheduler, Progress(), rank=0)


def snapshot(state: TrainState) -> dict[str, torch.Tensor]:
    return {name: _local(p.detach()).clone() for name, p in state.model.named_parameters()}


def load_back(storage: CheckpointStorage, step: int, state: TrainState, no_dist: bool, group: Any) -> dict[str, torch.Tensor]:
    state.include_rng = False
    dcp.load({"train": state}, storage_reader=storage.reader(storage.step_dir(step)), no_dist=no_dist, process_group=group)
    return snapshot(state)


def test_async_saves_refill_the_same_host_buffers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    staged = spy_on_staging(monkeypatch)
    storage = CheckpointStorage(str(tmp_path))
    manager = CheckpointManager(storage, rank=0, world_size=1, interval=1, keep=5, asynchronous=True)
    state = new_state(0)
    expected = {}
    for _ in range(3):
        train_one_step(state)
        manager.save(state, {})
        expected[state.progress.step] = snapshot(state)
        with torch.no_grad():  # training goes on while the save is written: the staged copy must not see it
            for param in state.model.parameters():
                param.add_(100.0)
    manager.close()

    assert len(staged) == 3
    first = buffers(staged[0])
    assert len(first) == 12  # 4 parameters, each with its two AdamW moments
    assert all(buffers(later) == first for later in staged[1:])
    sources = {_local(p).data_ptr() for p in state.model.parameters()}
    assert sources.isdisjoint(first.values())  # a copy, not the live weights
    for step, weights in expected.items():
        loaded = load_back(storage, step, new_state(1), True, None)
        assert loaded.keys() == weights.keys()
        for name in weights:
            assert torch.equal(loaded[name], weights[name]), (step, name)


def test_sync_saves_do_not_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    staged = spy_on_staging(monkeypatch)
    manager = CheckpointManager(CheckpointStorage(str(tmp_path)), rank=0, world_size=1, interval=1, keep=5, asynchronous=False)
    state = new_state(0)
    train_one_step(state)
    manager.save(state, {})
    manager.close()
    assert staged == [] and (tmp_path / "step-00000001" / "COMMITTED").is_file()


def _sharded_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two async saves of an FSDP2 model (DTensor shards) on a 1x2 mesh; both loaded back."""
    from meshtrain.config.loading import load_config
    from meshtrain.distributed.layout import WorkerLayout
    from meshtrain.train.optim import build_lr_scheduler, build_optimizer
    from trainers import sharded_model

    staged = spy_on_staging(pytest.MonkeyPatch())  # a spawned process: the patch ends with it
    cfg = load_config(None, [
        "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
        f"scaling.num_workers={world}", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optim.warmup_steps=1", "train.steps=10",
    ])
    layout = WorkerLayout(rank, world, rank, world, 0)

    def fresh() -> TrainState:
        model, _ = sharded_model(cfg, 64, layout, torch.device("cpu"))
        optimizer = build_optimizer(model, cfg.optim)
        return TrainState(model, optimizer, build_lr_scheduler(optimizer, cfg.optim, 10), Progress(), rank)

    def step(state: TrainState) -> None:
        state.model(torch.randint(0, 64, (2, 16))).float().square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.progress.step += 1

    storage = CheckpointStorage(root)
    manager = CheckpointManager(storage, rank=rank, world_size=world, interval=1, keep=5, asynchronous=True)
    state, expected = fresh(), {}
    for _ in range(2):
        step(state)
        manager.save(state, {})
        expected[state.progress.step] = snapshot(state)
        step(state)  # moves the weights while the save is in flight
    manager.finish_pending()
    target = fresh()
    loaded = {s: load_back(storage, s, target, False, manager.group) for s in expected}
    manager.close()
    same = all(torch.equal(loaded[s][n], expected[s][n]) for s in expected for n in expected[s])
    is_dtensor = isinstance(staged[0]["train"]["model"]["tok_embeddings.weight"], DTensor)
    first, second = expected.values()
    moved = not all(torch.equal(first[name], second[name]) for name in first)
    return {"buffers": [buffers(s) for s in staged], "equal": same, "dtensor": is_dtensor, "moved": moved}


def test_fsdp2_shards_are_staged_into_the_same_buffers(tmp_path: Path) -> None:
    for result in run_on_ranks(_sharded_saves, 2, str(tmp_path)):
        first, second = result["buffers"]
        assert result["dtensor"] and len(first) > 10 and first == second
        assert result["moved"] and result["equal"]
