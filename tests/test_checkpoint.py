"""Checkpoints: exact resume, resharding across meshes, corruption fallback (gloo ranks, no Ray)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import COMMIT_MARKER, CheckpointStorage
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import CheckpointLoadRecord, CheckpointSaveRecord, Record, RollbackRecord, TrainRecord
from meshtrain.train.optim import build_lr_scheduler, build_optimizer
from trainers import sharded_model
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks



def config(storage: Path, name: str, world: int, *overrides: str) -> MeshtrainConfig:
    return load_config(
        None,
        [
            "train.steps=12", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
            "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=3",
            f"scaling.num_workers={world}", "checkpoint.interval=4", "checkpoint.keep=10",
            f"run.storage_path={storage}", f"run.name={name}", *overrides,
        ],
    )


def _train_rank(rank: int, world: int, cfg: MeshtrainConfig, corpus: DataPlan, shard: int) -> dict[str, Any]:
    events: list[Record] = []
    result = train(worker_plan(cfg, corpus), WorkerLayout(rank, world, rank % shard, shard, rank // shard), torch.device("cpu"), events.append)
    return {"events": events, "mesh": result.mesh_shape}


def run(cfg: MeshtrainConfig, corpus: DataPlan, world: int, shard: int | None = None) -> dict[str, Any]:
    return run_on_ranks(_train_rank, world, cfg, corpus, shard or world)[0]


def losses(outcome: dict[str, Any]) -> dict[int, float]:
    return {e.step: e.loss for e in outcome["events"] if isinstance(e, TrainRecord)}


def ckpt_dir(storage: Path, name: str, step: int) -> Path:
    return storage / name / "checkpoints" / f"step-{step:08d}"


def consolidated(path: Path, tmp_path: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint (model and optimizer), gathered into one process."""
    out = tmp_path / f"consolidated-{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)["train"]
    return {"model": state["model"], "optimizer": optimizer_moments(state["optimizer"]), "progress": state["progress"]}


def optimizer_moments(optimizer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state, by its name, from a checkpoint's optimizer entry (kept by name:
    ``state.<parameter>.<moment>``)."""
    moments: dict[str, dict[str, Any]] = {}
    for key, value in optimizer.items():
        if key.startswith("state."):
            name, _, moment = key.removeprefix("state.").rpartition(".")
            moments.setdefault(name, {})[moment] = value
    return moments


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def seed_run_with(storage: Path, name: str, source: Path) -> None:
    """Start a run whose only checkpoint is a copy of ``source`` (a run stopped at that step)."""
    target = storage / name / "checkpoints" / source.name
    shutil.copytree(source, target)


@pytest.fixture(scope="module")
def unbroken(corpus: DataPlan, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    storage = tmp_path_factory.mktemp("runs")
    outcome = run(config(storage, "unbroken", 2), corpus, 2)
    return {"storage": storage, "outcome": outcome}


def test_saves_are_committed_on_the_cadence_with_their_measurements(unbroken: dict) -> None:
    storage = unbroken["storage"]
    saves = [e for e in unbroken["outcome"]["events"] if isinstance(e, CheckpointSaveRecord)]
    assert [s.step for s in saves] == [4, 8, 12]
    for save in saves:
        assert save.mode == "async" and save.bytes > 0 and 0 < save.blocking_s <= save.total_s
        assert (ckpt_dir(storage, "unbroken", save.step) / COMMIT_MARKER).is_file()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_resume_is_bitwise_identical_to_never_stopping(unbroken: dict, corpus: DataPlan, tmp_path: Path, mode: str) -> None:
    storage = unbroken["storage"]
    name = f"resumed-{mode}"
    seed_run_with(storage, name, ckpt_dir(storage, "unbroken", 4))
    outcome = run(config(storage, name, 2, f"checkpoint.mode={mode}"), corpus, 2)
    loads = [e for e in outcome["events"] if isinstance(e, CheckpointLoadRecord)]
    assert [(e.step, e.rng_restored) for e in loads] == [(4, True)]
    expected = losses(unbroken["outcome"])
    assert losses(outcome) == {step: expected[step] for step in range(5, 13)}  # exact float equality
    assert_bitwise_equal(
        consolidated(ckpt_dir(storage, name, 12), tmp_path),
        consolidated(ckpt_dir(storage, "unbroken", 12), tmp_path),
    )


def _restore_and_gather(rank: int, world: int, cfg: MeshtrainConfig, shard: int) -> dict[str, Any]:
    """Restore the newest checkpoint on this mesh; return the full model and optimizer state."""
    layout = WorkerLayout(rank, world, rank % shard, shard, rank // shard)
    model, _ = sharded_model(cfg, 512, layout, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.train.steps)
    progress = Progress()
    from meshtrain.checkpoint.storage import checkpoint_root

    manager = CheckpointManager(
        CheckpointStorage(checkpoint_root(cfg.checkpoint, cfg.run)), rank=rank, world_size=world, interval=4, keep=10, asynchronous=True
    )
    manager.restore(TrainState(model, optimizer, scheduler, progress, rank))
    manager.close()

    def full(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "model": {name: full(p.detach()) for name, p in model.named_parameters()},
        "optimizer": {names[id(p)]: {k: full(v) for k, v in s.items()} for p, s in optimizer.state.items()},
        "progress": vars(progress),
        "last_epoch": scheduler.last_epoch,
    }


def test_resharding_2x2_to_1x2_to_1x4_restores_state_and_continues_the_data(
    corpus: DataPlan, tmp_path: Path
) -> None:
    storage = tmp_path
    first = run(config(storage, "mesh2x2", 4, "parallel.shard=2"), corpus, 4, 2)
    assert first["mesh"] == (2, 2)
    reference = losses(first)

    # 2x2 -> 1x2: the step-4 state loads exactly, and training continues at the same data position.
    seed_run_with(storage, "mesh1x2", ckpt_dir(storage, "mesh2x2", 4))
    saved = consolidated(ckpt_dir(storage, "mesh2x2", 4), tmp_path)
    restored = run_on_ranks(_restore_and_gather, 2, config(storage, "mesh1x2", 2), 2)[0]
    assert restored["progress"] == {"step": 4, "tokens": 4 * 8 * 32, "data_position": 4 * 8, "skipped_steps": 0}
    assert restored["last_epoch"] == 4
    assert_bitwise_equal(restored["model"], saved["model"], "model")
    assert_bitwise_equal(restored["optimizer"], saved["optimizer"], "optimizer")
    second = run(config(storage, "mesh1x2", 2), corpus, 2)
    assert second["mesh"] == (1, 2)
    assert [e.step for e in second["events"] if isinstance(e, CheckpointLoadRecord)] == [4]

    # 1x2 -> 1x4, from the 1x2 run's step-8 checkpoint.
    seed_run_with(storage, "mesh1x4", ckpt_dir(storage, "mesh1x2", 8))
    third = run(config(storage, "mesh1x4", 4), corpus, 4)
    assert third["mesh"] == (1, 4)
    assert [(e.step, e.rng_restored) for e in third["events"] if isinstance(e, CheckpointLoadRecord)] == [(8, False)]

    continued = {**losses(second), **losses(third)}
    assert sorted(continued) == list(range(5, 13))
    for step, loss in continued.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def hf_logits_difference(checkpoint: Path, tmp_path: Path) -> float:
    """Export ``checkpoint`` to a Hugging Face folder; the largest logit difference between transformers
    loading it and meshtrain's model holding the checkpoint's weights in one process."""
    from transformers import LlamaForCausalLM

    from meshtrain.checkpoint.export import export_checkpoint
    from meshtrain.checkpoint.reading import load_model_state
    from meshtrain.model.llama import build_model

    out = tmp_path / f"hf-{checkpoint.parent.parent.name}"
    export_checkpoint(str(checkpoint), "hf", out)
    state, args, _ = load_model_state(str(checkpoint))
    model = build_model(args, "cpu")
    model.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (LlamaForCausalLM.from_pretrained(out).eval()(tokens).logits - model.eval()(tokens)).abs().max().item()


def test_checkpoints_move_between_tensor_context_and_data_parallel_layouts(corpus: DataPlan, tmp_path: Path) -> None:
    """DCP reshards across layouts: a TP=2 run's step 4 continues on 2-way FSDP, whose step 8 continues
    with CP=2, whose step 10 continues on one worker; every step's loss is the unbroken TP run's, and
    the TP and CP checkpoints export to Hugging Face with the model's logits."""
    storage, horizon = tmp_path, "optim.schedule_steps=12"
    unbroken = run(config(storage, "tp", 2, horizon, "parallel.tensor=2"), corpus, 2)
    assert unbroken["mesh"] == (1, 1, 2)
    chain = [
        ("fsdp", "tp", 4, 2, ["train.steps=8"], (1, 2)),
        ("cp", "fsdp", 8, 2, ["train.steps=10", "checkpoint.interval=2", "parallel.context=2"], (1, 1, 2)),
        ("single", "cp", 10, 1, [], (1, 1)),
    ]
    continued: dict[int, float] = {}
    for name, source, step, world, overrides, mesh in chain:
        seed_run_with(storage, name, ckpt_dir(storage, source, step))
        outcome = run(config(storage, name, world, horizon, *overrides), corpus, world)
        assert outcome["mesh"] == mesh and [e.step for e in outcome["events"] if isinstance(e, CheckpointLoadRecord)] == [step]
        continued.update(losses(outcome))
    reference = losses(unbroken)
    assert sorted(continued) == list(range(5, 13))
    worst = max(abs(loss - reference[step]) / reference[step] for step, loss in continued.items())
    print(f"\n[layouts] largest relative loss difference, resumed across layouts vs unbroken TP=2: {worst:.2e}")
    assert worst <= 1e-4
    for checkpoint in (ckpt_dir(storage, "tp", 12), ckpt_dir(storage, "cp", 10)):
        difference = hf_logits_difference(checkpoint, tmp_path)
        print(f"[layouts] {checkpoint.parent.parent.name} checkpoint exported: max |logit difference| = {difference:.2e}")
        assert difference <= 1e-4


def corrupt_run(storage: Path, unbroken_storage: Path, name: str) -> Path:
    for step in (4, 8):
        seed_run_with(storage, name, ckpt_dir(unbroken_storage, "unbroken", step))
    return ckpt_dir(storage, name, 8)


@pytest.mark.parametrize("damage", ["truncated shard", "missing metadata"])
def test_broken_newest_checkpoint_falls_back_to_the_previous_one(
    unbroken: dict, corpus: DataPlan, tmp_path: Path, capfd: pytest.CaptureFixture[str], damage: str
) -> None:
    broken = corrupt_run(tmp_path, unbroken["storage"], "broken")
    if damage == "truncated shard":
        shard = sorted(broken.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        detail = f"{shard.name} has 100 bytes, expected"
    else:
        (broken / ".metadata").unlink()
        detail = ".metadata is missing"
    outcome = run(config(tmp_path, "broken", 2), corpus, 2)
    assert [e.step for e in outcome["events"] if isinstance(e, CheckpointLoadRecord)] == [4]
    out = capfd.readouterr().out
    assert f"checkpoint {broken}: {detail}" in out and "falling back to the previous committed checkpoint" in out
    expected = losses(unbroken["outcome"])
    assert losses(outcome) == {step: expected[step] for step in range(5, 13)}
    assert_bitwise_equal(
        consolidated(ckpt_dir(tmp_path, "broken", 12), tmp_path),
        consolidated(ckpt_dir(unbroken["storage"], "unbroken", 12), tmp_path),
    )


def test_only_broken_checkpoints_stop_the_run_instead_of_starting_over(unbroken: dict, corpus: DataPlan, tmp_path: Path) -> None:
    seed_run_with(tmp_path, "hopeless", ckpt_dir(unbroken["storage"], "unbroken", 8))
    (ckpt_dir(tmp_path, "hopeless", 8) / ".metadata").unlink()
    with pytest.raises(AssertionError, match="NoLoadableCheckpoint: no loadable checkpoint in .*hopeless/checkpoints"):
        run(config(tmp_path, "hopeless", 2), corpus, 2)
    assert not ckpt_dir(tmp_path, "hopeless", 12).exists()


def test_uncommitted_checkpoint_is_ignored_and_cleared(unbroken: dict, corpus: DataPlan, tmp_path: Path) -> None:
    seed_run_with(tmp_path, "partial", ckpt_dir(unbroken["storage"], "unbroken", 4))
    seed_run_with(tmp_path, "partial", ckpt_dir(unbroken["storage"], "unbroken", 8))
    (ckpt_dir(tmp_path, "partial", 8) / COMMIT_MARKER).unlink()  # as if killed before the commit
    outcome = run(config(tmp_path, "partial", 2, "train.steps=12"), corpus, 2)
    assert [e.step for e in outcome["events"] if isinstance(e, CheckpointLoadRecord)] == [4]
    assert (ckpt_dir(tmp_path, "partial", 8) / COMMIT_MARKER).is_file()  # rewritten by this run


SOURCES = ("data.sources=[{source: stdlib, name: early, max_documents: 12}, {source: stdlib, name: late, max_documents: 24}, "
           "{source: stdlib, name: extra, max_documents: 6}]")


def stages(main: str = "{early: 1, late: 3}", tail: str = "{late: 1, extra: 1}", tail_len: int = 64, after: str = "") -> str:
    return (f"data.stages=[{{name: warm, until_step: 4, weights: {{early: 1}}}}, "
            f"{{name: main, until_step: 12, weights: {main}}}, {{name: tail, seq_len: {tail_len}, weights: {tail}{after}}}]")


def test_data_stages_resume_at_their_boundaries_as_if_never_stopped_and_a_begun_stage_cannot_change(
    tmp_path: Path,
) -> None:
    """Steps 1-4 read only `early`; steps 5-12 `late` joins, 1:3; from step 13 `extra` joins, `early` leaves
    and the sequences double to 64 tokens. A run stopped at the first boundary trains steps 5-16 bitwise as
    the unbroken one; one stopped at the second, or inside the main stage, and resumed on two ranks trains
    the rest within 1e-6,
    each checkpoint counting the samples and tokens per stage and source exactly alike; a relaunch may
    change only the stages that have not begun."""
    from meshtrain.cluster.resume import data_for_resume
    from meshtrain.config import ConfigError
    from meshtrain.checkpoint.storage import run_checkpoints
    from meshtrain.data.pipeline import prepare_data

    steps = "train.steps=16"
    base = config(tmp_path, "staged", 1, SOURCES, stages(), steps, "eval.interval=null", "data.validation.fraction=0")
    plan = prepare_data(base.data, str(tmp_path / "stores"), base.data.seq_len, use_ray=False, log=lambda _: None)
    unbroken = run(base, plan, 1)
    records = [e for e in unbroken["events"] if isinstance(e, TrainRecord)]
    assert [(r.step, r.stage) for r in records if r.step in (4, 5, 12, 13)] == [
        (4, "warm"), (5, "main"), (12, "main"), (13, "tail")]
    assert records[12].tokens - records[11].tokens == 8 * 64  # step 13: 8 sequences of 64 tokens
    manifests = {c.step: c.manifest for c in run_checkpoints(base.checkpoint, base.run).committed()}
    assert manifests[4]["data_samples"] == {"warm": {"early": 32}}
    main = manifests[8]["data_samples"]["main"]
    assert main.keys() == {"early", "late"} and sum(main.values()) == 32 and main["late"] > main["early"]
    tail = manifests[16]["data_samples"]["tail"]
    assert tail.keys() == {"late", "extra"} and sum(tail.values()) == 32
    assert manifests[16]["data_tokens"]["tail"] == {source: 64 * count for source, count in tail.items()}

    def same_run(name: str, *overrides: str) -> MeshtrainConfig:
        return config(tmp_path, name, 1, SOURCES, stages(), steps, "eval.interval=null", "data.validation.fraction=0",
                      *overrides)

    expected = losses(unbroken)
    seed_run_with(tmp_path, "staged-resumed", ckpt_dir(tmp_path, "staged", 4))
    resumed = run(same_run("staged-resumed"), plan, 1)
    assert losses(resumed) == {step: expected[step] for step in range(5, 17)}  # exact float equality
    seed_run_with(tmp_path, "staged-wider", ckpt_dir(tmp_path, "staged", 12))
    wider = run(same_run("staged-wider", "scaling.num_workers=2"), plan, 2)
    assert losses(wider) == pytest.approx({step: expected[step] for step in range(13, 17)}, rel=1e-6)
    seed_run_with(tmp_path, "staged-midway", ckpt_dir(tmp_path, "staged", 8))  # inside a stage, on two ranks
    midway = run(same_run("staged-midway", "scaling.num_workers=2"), plan, 2)
    assert losses(midway) == pytest.approx({step: expected[step] for step in range(9, 17)}, rel=1e-6)
    wider_manifest = CheckpointStorage(str(ckpt_dir(tmp_path, "staged-wider", 16))).read_marker(
        str(ckpt_dir(tmp_path, "staged-wider", 16)))
    assert wider_manifest["data_tokens"] == manifests[16]["data_tokens"]

    def relaunch(*overrides: str) -> None:
        cfg = config(tmp_path, "staged", 1, *overrides, steps, "eval.interval=null", "data.validation.fraction=0")
        data_for_resume(cfg.checkpoint, cfg.run, plan, allow_fingerprint_change=False,
                        stages=worker_plan(cfg, plan).data_stages)

    # A stage after step 16 has not begun; the same proportions are the same stage.
    relaunch(SOURCES, stages(main="{early: 2, late: 6}", after=", until_step: 20}, {name: cool, weights: {early: 1}"))
    for changed in (stages(main="{early: 1, late: 1}"), stages().replace("until_step: 4", "until_step: 5"),
                    stages(tail_len=32)):
        with pytest.raises(ConfigError, match=r"^data.stages: stage '(main|warm|tail)' had begun by the checkpoint of step 16"):
            relaunch(SOURCES, changed)
    with pytest.raises(ConfigError, match="were trained in data.stages and this config drops them"):
        relaunch(SOURCES)


def test_a_run_started_from_another_runs_checkpoint_takes_its_weights_optimizer_and_learning_rate(
    unbroken: dict, corpus: DataPlan, tmp_path: Path
) -> None:
    """An anneal from step 8 of the two-rank run, in one process: the weights and AdamW moments are the
    checkpoint's, bitwise; its first step's learning rate is the one the source's cosine schedule gave
    step 9; a linear decay to zero over its 5 steps ends at 0; its records, checkpoints and summary name
    the source by run, step and fingerprint."""
    from meshtrain.checkpoint.start_point import fingerprint
    from meshtrain.cluster.start_point import resolve_start
    from meshtrain.observe.run_folder import StartedFromRecord
    from trainers import cpu_trainer

    storage = unbroken["storage"]
    (storage / "unbroken" / "tokenizer.json").write_text(corpus.tokenizer_json)  # as the launcher keeps it
    source = ckpt_dir(storage, "unbroken", 8)
    cfg = config(tmp_path, "anneal", 1, f"checkpoint.start_from={storage / 'unbroken'}", "checkpoint.start_from_optimizer=true",
                 "optim.schedule=linear", "optim.warmup_steps=0", "optim.min_lr_ratio=0", "train.steps=5",
                 "checkpoint.interval=5")
    newest = ckpt_dir(storage, "unbroken", 12)
    assert resolve_start(cfg)[1].step == 12  # a run folder names its newest checkpoint
    cfg, start, tokenizer = resolve_start(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
        update={"start_from": str(source)})}))
    assert start is not None and tokenizer == corpus.tokenizer_json and newest.is_dir()
    step9_lr = next(e.lr for e in unbroken["outcome"]["events"] if isinstance(e, TrainRecord) and e.step == 9)
    assert start.lr == pytest.approx(step9_lr, rel=1e-9) and cfg.optim.lr == start.lr
    assert start.fingerprint == fingerprint(CheckpointStorage(str(source)).read_marker(str(source)))

    events: list[Record] = []
    anneal = cpu_trainer(cfg, corpus, events.append, start_from=start)
    try:
        saved = consolidated(source, tmp_path)
        ours = {name: param.detach() for name, param in anneal.model.named_parameters()}
        assert all(torch.equal(ours[name], saved["model"][name]) for name in ours)
        moments = {name: anneal.optimizer.state[param]["exp_avg"] for name, param in anneal.model.named_parameters()}
        assert all(torch.equal(moments[name], saved["optimizer"][name]["exp_avg"]) for name in moments)
        anneal.run()
        assert anneal.scheduler.get_last_lr()[0] == 0.0
    finally:
        anneal.close()
    trained = [e for e in events if isinstance(e, TrainRecord)]
    assert trained[0].lr == pytest.approx(step9_lr, rel=1e-9) and trained[-1].lr == pytest.approx(step9_lr / 5)
    started = [e for e in events if isinstance(e, StartedFromRecord)]
    assert [(e.run, e.step, e.fingerprint) for e in started] == [("unbroken", 8, start.fingerprint)]
    manifest = CheckpointStorage(str(ckpt_dir(tmp_path, "anneal", 5))).read_marker(str(ckpt_dir(tmp_path, "anneal", 5)))
    assert manifest["started_from"] == start.to_json()

    # Bad input is one line, before any worker: a path that holds no checkpoint, another model's shape.
    from meshtrain.cluster.start_point import check_start_model
    from meshtrain.config import ConfigError, ModelArgs

    missing = config(tmp_path, "anneal2", 1, f"checkpoint.start_from={tmp_path / 'nothing'}")
    with pytest.raises(ConfigError, match=r"^checkpoint.start_from: .*nothing") as refused:
        resolve_start(missing)
    assert "\n" not in str(refused.value)
    wider = ModelArgs(**{**start.model_args, "dim": start.model_args["dim"] * 2})
    with pytest.raises(ConfigError, match=r"^model: checkpoint.start_from .* another model shape: dim="):
        check_start_model(wider, start)


POISON = 511  # a poisoned window's every token (the vocabulary's last)


def _poisoned_rank(rank: int, world: int, cfg: MeshtrainConfig, corpus: DataPlan, poisoned: tuple[int, int]) -> dict[str, Any]:
    """A rank whose one source holds poisoned windows at the sample indices ``poisoned``, whose loss counts
    100 times (the data sends the loss up)."""
    import meshtrain.model.loss as loss_module
    from meshtrain.data.sampling import PackedSequences

    locate, loss = PackedSequences.locate, loss_module.token_cross_entropy_sum

    class Poisoned:
        def __init__(self, ref: Any) -> None:
            self.ref = ref

        def read(self) -> Any:
            return self.ref.read() * 0 + POISON

    def poisoned_locate(self: PackedSequences, index: int) -> Any:
        return Poisoned(locate(self, index)) if poisoned[0] <= index < poisoned[1] else locate(self, index)

    def poisoned_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = (targets == POISON).all(dim=-1)
        return loss(logits[~rows], targets[~rows]) + 100 * loss(logits[rows], targets[rows])

    PackedSequences.locate = poisoned_locate  # type: ignore[method-assign]
    loss_module.token_cross_entropy_sum = poisoned_loss
    return _train_rank(rank, world, cfg, corpus, world)


def test_a_rollback_on_two_ranks_goes_back_and_leaves_out_the_poisoned_samples_alike(corpus: DataPlan, tmp_path: Path) -> None:
    """Two FSDP ranks, poisoned samples 50-59 (steps 7 and 8 read them): both ranks skip both steps, go
    back to the checkpoint of step 6 together, leave out samples [48, 64) and save the checkpoints of a run
    told from its start to leave them out, bitwise."""
    common = ("train.steps=10", "train.loss_spike_factor=3", "train.loss_spike_window=3", "checkpoint.interval=2",
              "checkpoint.mode=sync")
    rolled = run_on_ranks(_poisoned_rank, 2, config(tmp_path, "rolled", 2, *common, "train.rollback_after_spikes=2",
                                                    "train.rollback_window=4"), corpus, (50, 60))[0]
    rollbacks = [e for e in rolled["events"] if isinstance(e, RollbackRecord)]
    assert [(r.step, r.to_step, r.skipped_steps) for r in rollbacks] == [(8, 6, [7, 8])]
    assert [(r["start"], r["stop"]) for r in rollbacks[0].left_out] == [(48, 64)]
    reference = run_on_ranks(_poisoned_rank, 2, config(tmp_path, "reference", 2, *common,
                                                       "data.skip_samples=[{start: 48, stop: 64}]"), corpus, (50, 60))[0]
    assert losses(rolled) == {**losses(rolled), **losses(reference)}  # steps 7-10 again, as the reference trains them
    assert_bitwise_equal(consolidated(ckpt_dir(tmp_path, "rolled", 10), tmp_path)["model"],
                         consolidated(ckpt_dir(tmp_path, "reference", 10), tmp_path)["model"])
