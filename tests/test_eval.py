"""Validation loss: the same value on any mesh, no effect on training, and the set it reads."""

from __future__ import annotations

import math

import pytest
import torch

from corpora import stdlib_plan
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan, stdlib_source_files
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.progress import progress_line
from meshtrain.observe.run_folder import (
    EvalRecord,
    EvictionRecord,
    PreemptedRecord,
    Record,
    ResizeSaveRecord,
    StoppedRecord,
    StragglerRecord,
    TrainRecord,
    WarningRecord,
    parse_record,
)
from meshtrain.train.evaluation import validation_samples
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks
from record_samples import make


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> DataPlan:
    """A mixture of two sources, 10% of each held out."""
    root = tmp_path_factory.mktemp("eval")
    tail = root / "tail"
    tail.mkdir()
    for index, path in enumerate(stdlib_source_files()[-16:]):
        (tail / f"{index}.txt").write_text(path.read_text())
    sources = [{"source": "stdlib", "max_documents": 24, "weight": 0.6}, {"source": str(tail), "weight": 0.4}]
    return stdlib_plan(root / "token_stores", sources=sources, validation={"fraction": 0.1})


def config(*overrides: str) -> MeshtrainConfig:
    return load_config(
        None,
        [
            "train.steps=6", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
            "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2",
            "scaling.num_workers=1", "checkpoint.enabled=false", "eval.interval=4", "eval.batches=3", *overrides,
        ],
    )


def events_of(cfg: MeshtrainConfig, corpus: DataPlan, layout: WorkerLayout = WorkerLayout()) -> list[Record]:
    events: list[Record] = []
    train(worker_plan(cfg, corpus), layout, torch.device("cpu"), events.append)
    return events


def _rank_events(rank: int, world: int, cfg: MeshtrainConfig, corpus: DataPlan) -> list[Record]:
    return events_of(cfg, corpus, WorkerLayout(rank, world, rank % 2, 2, rank // 2))


def test_validation_loss_is_the_same_on_one_process_and_a_2x2_mesh(corpus: DataPlan) -> None:
    single = [e for e in events_of(config(), corpus) if isinstance(e, EvalRecord)]
    ranks = run_on_ranks(_rank_events, 4, config("scaling.num_workers=4", "parallel.shard=2"), corpus)
    meshed = [e for e in ranks[0] if isinstance(e, EvalRecord)]
    assert [e.step for e in single] == [e.step for e in meshed] == [4, 6]  # every interval and the end
    assert all(e.samples == 24 for e in single + meshed)
    for a, b in zip(single, meshed):
        assert math.isfinite(a.loss) and abs(a.loss - b.loss) <= 1e-5 * a.loss, (a, b)
        assert a.perplexity == pytest.approx(math.exp(a.loss))
        # Every source is evaluated, on its own, with the same tokens and loss on either mesh.
        assert list(a.sources) == list(b.sources) == ["stdlib", "tail"]
        for name, scores in a.sources.items():
            assert scores["tokens"] > 0 and scores["tokens"] == b.sources[name]["tokens"]
            assert abs(scores["loss"] - b.sources[name]["loss"]) <= 1e-5 * scores["loss"], (name, a, b)
        total = sum(s["loss"] * s["tokens"] for s in a.sources.values()) / a.tokens
        assert total == pytest.approx(a.loss, rel=1e-9)  # overall = every scored token alike
    print(f"eval 1x1 vs 2x2: {[(a.loss, b.loss) for a, b in zip(single, meshed)]}")


def test_evaluation_does_not_change_training(corpus: DataPlan) -> None:
    with_eval = [e for e in events_of(config("eval.interval=1"), corpus) if isinstance(e, TrainRecord)]
    without = [e for e in events_of(config("eval.interval=null"), corpus) if isinstance(e, TrainRecord)]
    assert [(e.loss, e.grad_norm) for e in with_eval] == [(e.loss, e.grad_norm) for e in without]


def test_the_validation_set_is_whole_global_batches_of_what_is_held_out() -> None:
    assert validation_samples(available=1000, batches=4, global_batch_size=16) == 64
    assert validation_samples(available=50, batches=4, global_batch_size=16) == 48
    assert validation_samples(available=15, batches=4, global_batch_size=16) == 0


def test_eval_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^eval.interval: Input should be greater than 0"):
        load_config(None, ["eval.interval=0"])
    with pytest.raises(ConfigError, match=r"^eval.interval=50 needs validation data; set data.validation.fraction"):
        load_config(None, ["data.validation.fraction=0"])
    assert load_config(None, ["data.validation.fraction=0", "eval.interval=null"]).eval.interval is None
    # A separate validation source replaces the default held-out fraction.
    assert load_config(None, ["data.validation.source=stdlib"]).data.validation.fraction == 0


def test_progress_shows_evaluations_skips_and_stops() -> None:
    assert progress_line(make(EvalRecord, step=50, loss=5.0, perplexity=148.41, samples=64), 200) == (
        "[meshtrain] eval step 50: validation loss 5.0000, perplexity 148.41 (64 sequences)"
    )
    assert progress_line(StoppedRecord(step=7, reason="why"), 9) == "[meshtrain] stopped at step 7: why"


def test_progress_shows_every_kind_of_record_and_never_fails_on_an_unknown_one() -> None:
    """The driver prints what the workers record; a record it does not know is shown as it is (a
    KeyError here once ended a finished run with 'training failed')."""
    lines = {
        "straggler": make(StragglerRecord, step=9, rank=2, node="10.0.0.2", slowdown=3.0, logged_steps=3),
        "eviction": make(EvictionRecord, step=9, rank=2, node="10.0.0.2", evicted=True, reason="drained"),
        "preempted": make(PreemptedRecord, step=15, reason="SIGTERM", saved=True, save_s=0.25),
        "resize_save": ResizeSaveRecord(step=10, saved=True, save_s=0.5),
        "warning": make(WarningRecord, step=4, message="run.preemption_save_s=1 is short"),
        "future": parse_record({"event": "something_new", "step": 3, "value": 1}),
    }
    shown = {name: progress_line(record, 30) for name, record in lines.items()}
    assert shown["straggler"].startswith("[meshtrain] straggler: rank 2 on node 10.0.0.2 computes 3.00x slower")
    assert shown["eviction"] == "[meshtrain] evicting straggler rank 2's node 10.0.0.2: drained"
    assert shown["preempted"] == ("[meshtrain] preemption notice (SIGTERM): step 15 saved and committed in 0.2s; the group "
                                  "restarts from it")
    assert shown["resize_save"].startswith("[meshtrain] growing the group: step 10 saved in 0.5s")
    assert shown["warning"] == "[meshtrain] warning: run.preemption_save_s=1 is short"
    assert shown["future"] == "[meshtrain] something_new at step 3: value=1"
