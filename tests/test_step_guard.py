"""The step guard: a non-finite or spiking step leaves the state bitwise untouched, is never
checkpointed, is counted, and too many in a row stop the run. Also scheduled garbage collection and
RNG state stored as tensors."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import meshtrain.model.loss as loss_module
from meshtrain.checkpoint.storage import CheckpointStorage, checkpoint_root
from meshtrain.cluster.outcome import stopped_message
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.config import ConfigError
from meshtrain.observe.run_folder import (
    CheckpointSkippedRecord, Record, RollbackRecord, StoppedRecord, TrainRecord, read_left_out,
)
from meshtrain.train.gc_schedule import ScheduledCollection
from meshtrain.train.trainer import Trainer
from trainers import cpu_trainer

MICRO_BATCHES_PER_STEP = 4  # global batch 8 in micro-batches of 2, one process


def config(tmp_path: Path, *overrides: str) -> MeshtrainConfig:
    return load_config(
        None,
        [
            "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32",
            "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2", "optim.schedule_steps=20",
            "scaling.num_workers=1", "checkpoint.enabled=false", "eval.interval=null",
            f"run.storage_path={tmp_path}", "run.name=guard", *overrides,
        ],
    )


def corrupt_losses(monkeypatch: pytest.MonkeyPatch, factor: float, steps: set[int] | None, from_step: int = 0) -> None:
    """Multiply the training loss of ``steps`` (or of every step from ``from_step``) by ``factor``."""
    calls = [0]
    original = loss_module.token_cross_entropy_sum

    def corrupted(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step = calls[0] // MICRO_BATCHES_PER_STEP + 1
        calls[0] += 1
        value = original(logits, targets)
        hit = step in steps if steps is not None else step >= from_step
        return value * factor if hit else value

    monkeypatch.setattr(loss_module, "token_cross_entropy_sum", corrupted)


def run(cfg: MeshtrainConfig, corpus: DataPlan, metrics: TrainingMetrics | None = None) -> tuple[Trainer, list]:
    events: list[Record] = []
    trainer = cpu_trainer(cfg, corpus, events.append, metrics)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer, events


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {f"param.{name}": p.detach().clone() for name, p in trainer.model.named_parameters()}
    for index, (param, values) in enumerate(trainer.optimizer.state.items()):
        state.update({f"optim.{index}.{key}": value.clone() for key, value in values.items()})
    return state


@pytest.mark.parametrize(
    "implementation, factor, spike",
    [("fused", math.nan, False), ("foreach", math.nan, False), ("fused", math.inf, False), ("fused", 50.0, True)],
    ids=["nan-fused", "nan-foreach", "inf-fused", "spike-fused"],
)
def test_a_bad_step_leaves_model_and_optimizer_bitwise_untouched(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, implementation: str, factor: float, spike: bool
) -> None:
    spike_rule = ["train.loss_spike_factor=3", "train.loss_spike_window=3"] if spike else []
    settings = [f"optim.implementation={implementation}", *spike_rule]
    clean, _ = run(config(tmp_path, "train.steps=5", *settings), corpus)
    corrupt_losses(monkeypatch, factor, {6})
    guarded, events = run(config(tmp_path, "train.steps=6", *settings), corpus)
    expected, got = snapshot(clean), snapshot(guarded)
    assert expected.keys() == got.keys() and len(got) > 10
    assert all(torch.equal(got[key], expected[key]) for key in expected), "a skipped step changed the state"
    records = [e for e in events if isinstance(e, TrainRecord)]
    assert [r.skipped_steps for r in records] == [0, 0, 0, 0, 0, 1]
    assert guarded.result.skipped_steps == 1 and guarded.result.stopped is None
    if spike:
        assert math.isfinite(records[-1].loss) and records[-1].loss > 3 * records[-2].loss
    if implementation == "fused" and math.isnan(factor):  # once: the step after a skipped one trains again
        monkeypatch.undo()
        corrupt_losses(monkeypatch, factor, {6})
        resumed, _ = run(config(tmp_path, "train.steps=7", *settings), corpus)
        assert resumed.result.skipped_steps == 1
        assert not torch.equal(snapshot(resumed)["param.output.weight"], got["param.output.weight"])


def test_bad_steps_are_never_checkpointed_and_too_many_in_a_row_stop_the_run(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path, "train.steps=10", "train.max_bad_steps=3", "checkpoint.enabled=true",
                 "checkpoint.interval=2", "checkpoint.mode=sync")
    metrics = TrainingMetrics(run="guard", rank=0, node="127.0.0.1", device=torch.device("cpu"),
                              flops_per_token=1.0, peak_flops_per_s=None)
    corrupt_losses(monkeypatch, math.nan, None, from_step=4)
    trainer, events = run(cfg, corpus, metrics)

    stopped = [e for e in events if isinstance(e, StoppedRecord)]
    assert stopped == [StoppedRecord(step=6, reason=trainer.result.stopped)]
    assert "train.max_bad_steps=3: 3 steps in a row up to step 6 were skipped" in trainer.result.stopped
    assert [e.step for e in events if isinstance(e, CheckpointSkippedRecord)] == [4]
    assert max(e.step for e in events if isinstance(e, TrainRecord)) == 5  # stopped before logging step 6
    storage = CheckpointStorage(checkpoint_root(cfg.checkpoint, cfg.run))
    assert [c.step for c in storage.committed()] == [2]
    assert metrics.registry.get_sample_value(
        "meshtrain_skipped_steps_total", {"run": "guard", "replica": "0", "rank": "0", "node": "127.0.0.1"}
    ) == 3

    message = stopped_message(cfg.checkpoint, cfg.run, trainer.result.stopped)
    assert "\n" not in message and "step 6" in message and "step-00000002 (step 2)" in message

    # Each rank's RNG state and the progress are stored as tensors: nothing is unpickled on load.
    metadata = FileSystemReader(str(storage.committed()[0].path)).read_metadata().state_dict_metadata
    stored = {key: value for key, value in metadata.items() if key.startswith(("train.rng_rank0.", "train.progress."))}
    assert {"train.rng_rank0.torch", "train.rng_rank0.python_mt", "train.progress.data_position"} <= stored.keys()
    assert all(isinstance(value, TensorStorageMetadata) for value in stored.values())


def test_garbage_is_collected_by_schedule_not_automatically(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    gc.enable()
    schedule = ScheduledCollection(every=3)
    assert not gc.isenabled() and collected == [2]
    for step in range(1, 10):
        schedule.step(step)
    assert collected == [2, 1, 1, 1]  # steps 3, 6 and 9
    schedule.close()
    assert gc.isenabled()
    ScheduledCollection(every=0).step(3)
    assert gc.isenabled() and len(collected) == 4


def test_a_streak_that_ends_between_two_readings_still_stops_the_run() -> None:
    """Three skipped steps, then good ones, all between two readings: the longest streak is kept on
    the device, so the next reading sees it and the run stops."""
    from meshtrain.checkpoint.state import Progress
    from meshtrain.train.guard import BadStepLimit, SpikeRules, StepGuard
    from meshtrain.train.records import LoopOutputs

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    guard = StepGuard(optimizer, torch.device("cpu"), SpikeRules(window=5))
    events: list[Record] = []
    limit = BadStepLimit(guard, 3, Progress(), LoopOutputs(events.append, None, None))
    good, nan = torch.tensor(1.0), torch.tensor(math.nan)
    for loss in (good, nan, nan, nan, good, good):
        weight.grad = torch.ones(3)
        guard.step(guard.check(loss, torch.tensor(1.0)))
    assert guard.bad_in_a_row.item() == 0  # the streak is over by the time the loop reads
    assert limit.check(6) is None
    assert limit.stopped == ("train.max_bad_steps=3: 3 steps in a row before step 6 were skipped "
                             "(non-finite or spiking loss or gradient norm)")
    assert len([e for e in events if isinstance(e, StoppedRecord)]) == 1
    # A new reading window starts after each read: two shorter streaks do not add up.
    guard2 = StepGuard(optimizer, torch.device("cpu"), SpikeRules(window=5))
    limit2 = BadStepLimit(guard2, 3, Progress(), LoopOutputs(None, None, None))
    for loss in (nan, nan, good, nan, nan, good):
        weight.grad = torch.ones(3)
        guard2.step(guard2.check(loss, torch.tensor(1.0)))
    assert limit2.check(6) == 0 and limit2.stopped is None


POISON = 511  # the token of a poisoned window (the vocabulary's last)


def poison(trainer: Trainer, ranges: list[tuple[int, int]]) -> None:
    """The run's one source holds poisoned windows at the sample indices ``ranges``: every token POISON."""
    source = trainer.batches.samples.components[0]
    original = source.locate

    class Poisoned:
        def __init__(self, ref: Any) -> None:
            self.ref = ref

        def read(self) -> Any:
            return self.ref.read() * 0 + POISON

    source.locate = lambda index: Poisoned(original(index)) if any(a <= index < b for a, b in ranges) else original(index)


def poisoned_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A poisoned window's loss counts 100 times: the data sends the step's loss up."""
    original = loss_module.token_cross_entropy_sum

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = (targets == POISON).all(dim=-1)
        return original(logits[~rows], targets[~rows]) + 100 * original(logits[rows], targets[rows])

    monkeypatch.setattr(loss_module, "token_cross_entropy_sum", loss)


def test_repeated_spikes_roll_back_and_leave_out_the_samples_behind_them(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Poisoned samples at [50, 56) and [66, 70) spike steps 7 and 9 (steps read 8 samples); at step 9 the
    run goes back to the checkpoint of step 6 (the one of step 8, saved between the spikes, is set aside),
    leaves out samples [48, 72) and finishes with the weights, bitwise, of a run told from the start to
    leave them out. A relaunch honours the ranges; one that drops them is refused."""
    poisoned_losses(monkeypatch)
    common = ["train.steps=12", "train.loss_spike_factor=3", "train.loss_spike_window=3", "checkpoint.enabled=true",
              "checkpoint.interval=2", "checkpoint.mode=sync"]
    events: list[Record] = []
    rolled = cpu_trainer(config(tmp_path, *common, "train.rollback_after_spikes=2", "train.rollback_window=4"),
                         corpus, events.append)
    poison(rolled, [(50, 56), (66, 70)])
    try:
        rolled.run()
    finally:
        rolled.close()
    rollbacks = [e for e in events if isinstance(e, RollbackRecord)]
    assert len(rollbacks) == 1 and (rollbacks[0].step, rollbacks[0].to_step, rollbacks[0].skipped_steps) == (9, 6, [7, 9])
    assert rollbacks[0].left_out == [{"stage": None, "start": 48, "stop": 72, "rollback": 1, "step": 9,
                                      "rolled_back_to": 6, "sources": {"stdlib": 24}}]
    trained = [e.step for e in events if isinstance(e, TrainRecord)]
    assert trained == [*range(1, 10), *range(7, 13)]
    assert rolled.result.skipped_steps == 0 and rolled.result.stopped is None  # the spikes were undone
    storage = CheckpointStorage(checkpoint_root(rolled.plan.checkpoint, rolled.plan.run))
    assert [c.step for c in storage.committed()] == [12, 10, 8, 6, 4, 2][: rolled.plan.checkpoint.keep]
    assert any(".bad-" in str(path) for path in Path(storage.root).iterdir())  # the step-8 save of the spike window
    assert read_left_out(rolled.plan.paths.left_out)[0].stop == 72

    reference = cpu_trainer(config(tmp_path / "reference", *common, "data.skip_samples=[{start: 48, stop: 72}]"), corpus)
    poison(reference, [(50, 56), (66, 70)])  # inside the left-out range: never read
    try:
        reference.run()
    finally:
        reference.close()
    expected, got = snapshot(reference), snapshot(rolled)
    assert all(torch.equal(got[key], expected[key]) for key in expected), "the rolled-back run differs"

    # A relaunch keeps what the run folder lists; dropping a range the checkpoint read past is refused.
    Path(rolled.plan.paths.left_out).write_text("[]")
    with pytest.raises(ConfigError, match=r"data.skip_samples: samples \[48, 72\) of the run's samples"):
        cpu_trainer(config(tmp_path, *common, "train.steps=14"), corpus).close()


def test_the_spike_rules_and_the_rollback_window_read_nothing_back_from_the_device() -> None:
    """Every device-to-host read (``.item()``, ``bool()``, ``.tolist()``) runs aten._local_scalar_dense; counted
    under a dispatch mode, the guard's check and its fused step run none, with both spike rules and the
    rollback window on: the step stays free of host syncs. The one read is the guard's own, at logged steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtrain.train.guard import SpikeRules, StepGuard

    class DeviceReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                DeviceReads.count += 1
            return func(*args, **(kwargs or {}))

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    guard = StepGuard(optimizer, torch.device("cpu"), SpikeRules(3.0, 3.0, window=3, rollback_window=4), step=10)
    losses = [1.0, 1.1, 0.9, 1.0, 50.0, 1.0, 1.0, 1.0]
    norms = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 20.0, 1.0]  # step 17's gradient norm spikes, its loss does not
    with DeviceReads():
        for loss, norm in zip(losses, norms):
            weight.grad = torch.ones(3)
            guard.step(guard.check(torch.tensor(loss), torch.tensor(norm)))
    assert DeviceReads.count == 0
    reading = guard.read()
    assert reading.recent == (15, 17) and reading.skipped_total == 2  # steps 11-18: the 5th and the 7th
    assert guard.history_state()["losses"] == pytest.approx([1.0, 1.0, 1.0])
    # With train.max_rollbacks used up, spikes that call for a rollback stop the run instead, in one line.
    from meshtrain.checkpoint.state import Progress
    from meshtrain.train.guard import BadStepLimit, RollbackRule
    from meshtrain.train.records import LoopOutputs

    limit = BadStepLimit(guard, 5, Progress(), LoopOutputs(None, None, None), RollbackRule(2, 4, 0, 1, done=1))
    guard.check(torch.tensor(math.nan), torch.tensor(1.0))
    guard.check(torch.tensor(math.nan), torch.tensor(1.0))
    assert limit.check(20) is None and limit.rollback is None
    assert limit.stopped == ("train.max_rollbacks=1: 3 of the last 4 steps up to step 20 were skipped (non-finite or "
                             "spiking loss or gradient norm) after 1 rollback(s)")
    assert BadStepLimit(guard, 5, Progress(), LoopOutputs(None, None, None), RollbackRule(2, 4, 0, 2, done=1)).check(20) == 2
