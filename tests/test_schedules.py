"""LR schedules (cosine, linear, wsd, constant) and the horizon a run keeps across re-runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from meshtrain.cluster.launcher import resolve_run
from meshtrain.cluster.resume import resolve_schedule_horizon, write_run_config
from meshtrain.config import ConfigError, OptimConfig
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.train.optim import build_lr_scheduler, lr_multiplier

# Every schedule below: 10 warmup steps, a 110-step horizon and a floor of 0.1 x lr.
WARMUP, HORIZON, FLOOR = 10, 110, 0.1


def optim(schedule: str, **fields: Any) -> OptimConfig:
    return OptimConfig(schedule=schedule, warmup_steps=WARMUP, min_lr_ratio=FLOOR, **fields)


def factors(cfg: OptimConfig, steps: range, horizon: int = HORIZON) -> list[float]:
    return [lr_multiplier(step, cfg, horizon) for step in steps]


# --- the schedules at their key steps ------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "fields", "expected"),
    [
        # step:      0 (first update), 9 (end of warmup), 10 (after it), 35, 60 (mid), 110 (end), 500 (beyond)
        ("cosine", {}, {0: 0.1, 9: 1.0, 10: 1.0, 35: 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 60: 0.55,
                        110: 0.1, 500: 0.1}),
        ("linear", {}, {0: 0.1, 9: 1.0, 10: 1.0, 35: 0.775, 60: 0.55, 110: 0.1, 500: 0.1}),
        ("constant", {}, {0: 0.1, 9: 1.0, 10: 1.0, 35: 1.0, 60: 1.0, 110: 1.0, 500: 1.0}),
        # wsd, decay over the last 0.2 x 110 = 22 steps: stable until step 88, halfway down at step 99.
        ("wsd", {"decay_fraction": 0.2}, {0: 0.1, 9: 1.0, 10: 1.0, 60: 1.0, 88: 1.0, 99: 0.55, 110: 0.1,
                                          500: 0.1}),
    ],
)
def test_schedule_values(schedule: str, fields: dict[str, Any], expected: dict[int, float]) -> None:
    cfg = optim(schedule, **fields)
    actual = {step: lr_multiplier(step, cfg, HORIZON) for step in expected}
    assert actual == pytest.approx(expected, abs=1e-12)


def test_warmup_is_linear_from_the_first_step() -> None:
    for cfg in (optim("cosine"), optim("linear"), optim("constant"), optim("wsd", decay_fraction=0.2)):
        assert factors(cfg, range(WARMUP)) == pytest.approx(
            [(step + 1) / WARMUP for step in range(WARMUP)]
        )


def test_no_warmup_starts_at_the_peak() -> None:
    cfg = OptimConfig(schedule="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert factors(cfg, range(0, 101, 25), horizon=100) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def _old_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The schedule meshtrain had before schedules were selectable (copied verbatim)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    ("warmup", "horizon", "floor"), [(20, 200, 0.1), (0, 7, 0.0), (3, 4, 1.0), (5, 1000, 0.3)]
)
def test_cosine_is_unchanged(warmup: int, horizon: int, floor: float) -> None:
    cfg = OptimConfig(warmup_steps=warmup, min_lr_ratio=floor)
    assert cfg.schedule == "cosine"  # still the default
    steps = range(horizon + 10)
    assert factors(cfg, steps, horizon) == [_old_cosine(step, warmup, horizon, floor) for step in steps]


def test_wsd_is_stable_then_decays_over_exactly_the_last_fraction() -> None:
    cfg = optim("wsd", decay_fraction=0.2)
    values = factors(cfg, range(WARMUP, HORIZON + 1))
    stable = [value for value in values if value == 1.0]
    decaying = values[len(stable):]
    assert len(stable) == HORIZON - 22 - WARMUP + 1  # steps 10..88 run at exactly lr
    assert len(decaying) == 22 == round(0.2 * HORIZON)
    assert all(later < earlier for earlier, later in zip(decaying, decaying[1:]))
    assert decaying[-1] == pytest.approx(FLOOR)
    # Linear: equal steps down.
    assert [a - b for a, b in zip(decaying, decaying[1:])] == pytest.approx([(1 - FLOOR) / 22] * 21)


STAGED = ["data.sources=[{source: stdlib, name: code}, {source: stdlib, name: few, max_documents: 9}]",
          "data.stages=[{name: main, until_step: 80, weights: {code: 1}}, {name: anneal, weights: {code: 1, few: 1}}]"]


def test_wsd_from_a_stage_decays_from_its_first_step_to_the_end_of_the_schedule() -> None:
    """Stage 'anneal' starts after step 80 of 100: the decay of decay_fraction=0.2, exactly."""
    cfg = load_config(None, ["optim.schedule=wsd", "optim.decay_from_stage=anneal", "train.steps=100", *STAGED])
    assert cfg.lr_decay_start() == 80
    by_fraction = cfg.optim.model_copy(update={"decay_fraction": 0.2, "decay_from_stage": None})
    assert [lr_multiplier(step, cfg.optim, 100, 80) for step in range(110)] == [
        lr_multiplier(step, by_fraction, 100) for step in range(110)]


@pytest.mark.parametrize(("fraction", "horizon", "steps"), [(0.2, 110, 22), (0.5, 7, 4), (0.01, 20, 1)])
def test_wsd_decay_is_whole_steps_and_at_least_one(fraction: float, horizon: int, steps: int) -> None:
    cfg = OptimConfig(schedule="wsd", decay_fraction=fraction, warmup_steps=0)
    assert cfg.wsd_decay_steps(horizon) == steps
    assert lr_multiplier(horizon - steps, cfg, horizon) == 1.0
    assert lr_multiplier(horizon - steps + 1, cfg, horizon) < 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_scheduler_follows_the_multiplier(schedule: str) -> None:
    cfg = optim(schedule, lr=0.5, decay_fraction=0.2 if schedule == "wsd" else None)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_lr_scheduler(optimizer, cfg, HORIZON)
    seen = []
    for _ in range(HORIZON + 20):  # past the horizon the last LR holds
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * lr_multiplier(step, cfg, HORIZON) for step in range(HORIZON + 20)])
    assert seen[-1] == pytest.approx(0.5 * (1.0 if schedule == "constant" else FLOOR))


def test_scheduler_refuses_a_horizon_the_warmup_does_not_fit() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match=r"^optim\.warmup_steps=10 does not fit in the LR schedule's 10 "):
        build_lr_scheduler(optimizer, optim("cosine"), 10)


# --- bad settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim.schedule=wsd"],
            "optim.decay_fraction: the wsd schedule needs it (the share of steps to decay over, e.g. 0.2) or "
            "optim.decay_from_stage (the data stage the decay starts with), not both",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_fraction=0"],
            "optim.decay_fraction: Input should be greater than 0 (got 0)",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_fraction=1"],
            "optim.decay_fraction: Input should be less than 1 (got 1)",
        ),
        (
            ["optim.decay_fraction=0.2"],
            "optim.decay_fraction: only the wsd schedule uses it, not cosine; set optim.schedule=wsd or "
            "leave optim.decay_fraction unset",
        ),
        (
            ["optim.schedule=step"],
            "optim.schedule: Input should be 'cosine', 'linear', 'wsd', 'constant' or 'staged' (got 'step')",
        ),
        (["optim.schedule_steps=0"], "optim.schedule_steps: Input should be greater than 0 (got 0)"),
        (
            ["train.steps=20"],
            "optim.warmup_steps=20 does not fit in the LR schedule's 20 steps (optim.schedule_steps, unset = "
            "train.steps); lower optim.warmup_steps or lengthen the schedule",
        ),
        (
            ["optim.schedule_steps=15", "train.steps=1000"],
            "optim.warmup_steps=20 does not fit in the LR schedule's 15 steps (optim.schedule_steps, unset = "
            "train.steps); lower optim.warmup_steps or lengthen the schedule",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_fraction=0.85", "train.steps=100"],
            "optim.warmup_steps=20 plus the wsd decay of 85 steps (optim.decay_fraction=0.85) exceed the LR "
            "schedule's 100 steps (optim.schedule_steps, unset = train.steps); lower optim.warmup_steps or "
            "optim.decay_fraction, or lengthen the schedule",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_fraction=0.2", "optim.decay_from_stage=anneal"],
            "optim.decay_fraction: the wsd schedule needs it (the share of steps to decay over, e.g. 0.2) or "
            "optim.decay_from_stage (the data stage the decay starts with), not both",
        ),
        (
            ["optim.decay_from_stage=anneal"],
            "optim.decay_from_stage: only the wsd schedule uses it, not cosine; set optim.schedule=wsd or "
            "leave optim.decay_from_stage unset",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_from_stage=nope", *STAGED],
            "optim.decay_from_stage: no data.stages stage is named 'nope' (stages: 'main', 'anneal')",
        ),
        (
            ["optim.schedule=wsd", "optim.decay_from_stage=anneal", *STAGED, "train.steps=80"],
            "optim.decay_from_stage='anneal' starts the wsd decay at step 80, outside optim.warmup_steps=20 to the "
            "end of the LR schedule's 80 steps (optim.schedule_steps, unset = train.steps); decay from another "
            "stage, or lengthen the schedule",
        ),
    ],
)
def test_bad_schedule_settings(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.steps=21"],  # the warmup ends one step before the horizon
        ["optim.schedule=constant", "train.steps=21"],
        ["optim.schedule=wsd", "optim.decay_fraction=0.8", "train.steps=100"],  # 20 + 80: no stable phase
        ["optim.warmup_steps=0", "train.steps=1"],
        ["train.steps=5", "optim.schedule_steps=50"],
    ],
)
def test_schedules_that_fit(overrides: list[str]) -> None:
    load_config(None, overrides)


# --- the horizon of a run -------------------------------------------------------------------------


def launch_config(storage: Path, *overrides: str) -> MeshtrainConfig:
    """What `launch` does before Ray: resolve the run and its schedule horizon, write config.yaml."""
    cfg, paths = resolve_run(load_config(None, [f"run.storage_path={storage}", "run.name=r", *overrides]))
    cfg = resolve_schedule_horizon(cfg, paths)
    write_run_config(cfg, paths)
    return cfg


def written(storage: Path) -> dict[str, Any]:
    return yaml.safe_load((storage / "r" / "config.yaml").read_text())


def commit_a_checkpoint(storage: Path) -> None:
    """Give run r a committed checkpoint: a re-run then resumes it."""
    committed = storage / "r" / "checkpoints" / "step-00000010"
    committed.mkdir(parents=True)
    (committed / "COMMITTED").write_text("{}")


def test_first_launch_spans_train_steps(tmp_path: Path) -> None:
    assert launch_config(tmp_path, "train.steps=100").optim.schedule_steps == 100
    assert written(tmp_path)["optim"]["schedule_steps"] == 100


def test_rerun_with_more_steps_keeps_the_first_horizon(tmp_path: Path) -> None:
    launch_config(tmp_path, "train.steps=100")
    commit_a_checkpoint(tmp_path)
    cfg = launch_config(tmp_path, "train.steps=300")
    assert (cfg.train.steps, cfg.optim.schedule_steps) == (300, 100)
    assert written(tmp_path)["train"]["steps"] == 300 and written(tmp_path)["optim"]["schedule_steps"] == 100
    assert len(list((tmp_path / "r").glob("config.*.yaml"))) == 1  # the first config, kept
    # And again: the horizon comes from config.yaml, not from the latest train.steps.
    assert launch_config(tmp_path, "train.steps=50").optim.schedule_steps == 100


def test_a_rerun_with_nothing_to_resume_spans_its_own_steps(tmp_path: Path) -> None:
    """A launch that failed before its first checkpoint trained nothing that lasts: the next one starts at
    step 0 with its own horizon, and the failed launch's step records are set aside, not continued."""
    launch_config(tmp_path, "train.steps=100")
    metrics = tmp_path / "r" / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 9.0}\n')
    assert launch_config(tmp_path, "train.steps=300").optim.schedule_steps == 300
    assert not metrics.exists()
    [kept] = (tmp_path / "r").glob("metrics.*.jsonl")
    assert kept.read_text() == '{"step": 1, "loss": 9.0}\n'
    commit_a_checkpoint(tmp_path)
    metrics.write_text('{"step": 10, "loss": 5.0}\n')
    assert launch_config(tmp_path, "train.steps=500").optim.schedule_steps == 300  # resumed: kept
    assert metrics.read_text() == '{"step": 10, "loss": 5.0}\n'


def test_explicit_horizon_wins(tmp_path: Path) -> None:
    assert launch_config(tmp_path, "train.steps=100", "optim.schedule_steps=400").optim.schedule_steps == 400
    commit_a_checkpoint(tmp_path)
    assert launch_config(tmp_path, "train.steps=300").optim.schedule_steps == 400  # kept when unset again
    cfg = launch_config(tmp_path, "train.steps=300", "optim.schedule_steps=300")  # a deliberate change
    assert cfg.optim.schedule_steps == 300 and written(tmp_path)["optim"]["schedule_steps"] == 300


def test_config_written_before_schedules_existed(tmp_path: Path) -> None:
    """An older config.yaml has no schedule settings: its horizon was its train.steps, and it was cosine."""
    launch_config(tmp_path, "train.steps=100")
    commit_a_checkpoint(tmp_path)
    old = written(tmp_path)
    for key in ("schedule", "decay_fraction", "schedule_steps"):
        del old["optim"][key]
    del old["checkpoint"]["allow_untested_scheme"]
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    cfg = launch_config(tmp_path, "train.steps=300")
    assert (cfg.train.steps, cfg.optim.schedule_steps, cfg.optim.schedule) == (300, 100, "cosine")


def test_rerun_may_not_change_the_schedule(tmp_path: Path) -> None:
    launch_config(tmp_path, "train.steps=100")
    commit_a_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"^optim\.schedule: run r was started with 'cosine', not 'linear'"):
        launch_config(tmp_path, "train.steps=100", "optim.schedule=linear")


def test_inherited_horizon_must_fit_the_warmup(tmp_path: Path) -> None:
    """A config.yaml from before the warmup check could hold a horizon shorter than the warmup."""
    launch_config(tmp_path, "train.steps=100")
    commit_a_checkpoint(tmp_path)
    old = written(tmp_path)
    old["train"]["steps"] = 10
    del old["optim"]["schedule_steps"]
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.raises(ConfigError, match=r"^optim\.warmup_steps=20 does not fit in the LR schedule's 10 "):
        launch_config(tmp_path, "train.steps=100")


def test_a_rerun_may_change_data_stages_for_the_checkpoints_to_judge(tmp_path: Path) -> None:
    """config.yaml lets data.stages change on a re-run; which changes stand is data_for_resume's call,
    against the newest checkpoint's stages (a stage that has begun stays, tested in test_checkpoint)."""
    sources = "data.sources=[{source: stdlib, name: a}, {source: stdlib, name: b, max_documents: 9}]"
    launch_config(tmp_path, "train.steps=100", sources, "data.stages=[{name: s, until_step: 50, weights: {a: 1}}, "
                  "{name: t, weights: {b: 1}}]")
    commit_a_checkpoint(tmp_path)
    launch_config(tmp_path, "train.steps=100", sources, "data.stages=[{name: s, until_step: 50, weights: {a: 1}}, "
                  "{name: t, weights: {a: 1, b: 1}}]")
    assert written(tmp_path)["data"]["stages"][1]["weights"] == {"a": 1, "b": 1}


def test_staged_schedule_holds_or_decays_per_stage() -> None:
    """Stages ending at steps 40 and 80 and the horizon (120), warmup 10: the first decays from 1 at the
    warmup's end to 0.5 at step 40, the second holds 0.5, the third decays to zero at 120 and stays there."""
    stages = ((40, 0.5), (80, None), (None, 0.0))
    cfg = OptimConfig(schedule="staged", warmup_steps=10)
    values = {step: lr_multiplier(step, cfg, 120, stages=stages) for step in (0, 9, 10, 25, 40, 60, 79, 80, 100, 120, 500)}
    assert values == pytest.approx({0: 0.1, 9: 1.0, 10: 1.0, 25: 0.75, 40: 0.5, 60: 0.5, 79: 0.5, 80: 0.5,
                                    100: 0.25, 120: 0.0, 500: 0.0}, abs=1e-12)
    resolved = load_config(None, ["train.steps=120", "train.global_batch_size=16", "optim.schedule=staged",
                                  "data.sources=[{source: stdlib, name: a}, {source: stdlib, name: b, max_documents: 9}]",
                                  "data.stages=[{name: s, until_step: 40, lr_decay_to: 0.5, weights: {a: 1}}, "
                                  "{name: t, until_tokens: 163840, weights: {b: 1}}, {name: u, lr_decay_to: 0, weights: {a: 1}}]"])
    assert resolved.lr_stages() == stages  # 163,840 tokens = 80 steps of 16 x 128
    with pytest.raises(ConfigError, match=r"stage 's' sets lr_decay_to, which optim.schedule=staged reads"):
        load_config(None, ["data.sources=[{source: stdlib, name: a}]",
                           "data.stages=[{name: s, lr_decay_to: 0.5, weights: {a: 1}}]"])
