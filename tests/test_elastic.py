"""Elastic settings without Ray: which group sizes a run may train on, the one-line refusals, and
the resize record a restarted group writes."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from meshtrain.cli.pretrain import main
from meshtrain.cluster.worker import UntrainableGroupSize, check_group_size, resize_record
from meshtrain.cluster.worker_plan import worker_plan
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.observe.run_folder import WorkerStart

BATCH = ["scaling.num_workers=8", "train.global_batch_size=32", "train.micro_batch_size=2"]


@pytest.mark.parametrize(
    ("settings", "sizes"),
    [
        ([], [8]),
        (["scaling.min_workers=8"], [8]),
        (["scaling.min_workers=2"], [2, 4, 8]),  # 3, 5, 6, 7: 32 is not a multiple of 2 x size
        (["scaling.min_workers=2", "parallel.shard=2"], [2, 4, 8]),
        (["scaling.min_workers=4", "scaling.workers_per_node=4"], [4, 8]),
        (["scaling.min_workers=1", "parallel.strategy=full_shard"], [1, 2, 4, 8]),
        # Whole tensor-parallel groups, whose data-parallel ranks' micro-batches divide the batch.
        (["scaling.min_workers=1", "parallel.tensor=2"], [2, 4, 8]),  # 6: 3 ranks x 2 do not divide 32
        (["scaling.min_workers=4", "parallel.tensor=2", "parallel.shard=2"], [4, 8]),
    ],
)
def test_allowed_sizes(settings: list[str], sizes: list[int]) -> None:
    assert load_config(None, [*BATCH, *settings]).elastic_sizes() == sizes


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["scaling.min_workers=9"], "scaling.min_workers=9 exceeds scaling.num_workers=8; set it to at most"),
        (["scaling.min_workers=5"], "scaling.min_workers=5: no smaller group than scaling.num_workers=8 is"),
        (["scaling.min_workers=2", "parallel.shard=4"], "parallel.shard=4 does not fit scaling.min_workers=2"),
        (["scaling.min_workers=0"], "scaling.min_workers"),
        (["scaling.resize_check_interval_s=0"], "scaling.resize_check_interval_s"),
    ],
)
def test_bad_elastic_settings_exit_2_with_one_line(
    settings: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BATCH, *settings])
    assert main(["--dry-run", *BATCH, *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_dry_run_lists_the_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", *BATCH, "scaling.min_workers=2"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("elastic:"))
    assert "trains on 2 (accumulation 8), 4 (accumulation 4), 8 (accumulation 2) workers" in line


def test_a_size_ray_offers_but_the_run_cannot_use_fails_its_start() -> None:
    cfg = load_config(None, [*BATCH, "scaling.min_workers=2"])
    plan = worker_plan(cfg, SimpleNamespace(vocab_size=512))  # the tokenizer's size alone: no data read
    check_group_size(plan, 4)
    with pytest.raises(UntrainableGroupSize, match="Ray started 6 workers, but .* trains only on 2, 4, 8"):
        check_group_size(plan, 6)


def test_resize_records_say_why() -> None:
    cfg = load_config(None, [*BATCH, "scaling.min_workers=2"])
    start = WorkerStart(launch="a", time=1.0, world_size=8, workers=[])
    assert resize_record(None, "a", 8, cfg.scaling) is None
    assert resize_record(start, "a", 8, cfg.scaling) is None
    lost = resize_record(start, "a", 4, cfg.scaling)
    assert lost is not None and (lost.from_workers, lost.to_workers) == (8, 4)
    assert lost.reason.startswith("capacity lost")
    grown = resize_record(replace(start, world_size=4), "a", 8, cfg.scaling)
    assert grown is not None and grown.reason.startswith("capacity returned")
    relaunched = resize_record(start, "b", 4, cfg.scaling)
    assert relaunched is not None and relaunched.reason.startswith("a new launch")


class _Actor:
    """A worker's actor: ``execute`` runs the function here at once, against this worker's own request
    state (a worker is a process of its own), and returns its value (``ready_values`` reads plain values)."""

    def __init__(self, calls: list) -> None:
        import meshtrain.train.preemption as preemption

        self.state = preemption._ResizeRequest()

        def remote(fn, *args):
            calls.append(fn.__name__)
            shared, preemption._RESIZE = preemption._RESIZE, self.state
            try:
                return fn(*args)
            finally:
                preemption._RESIZE = shared

        self.execute = type("Method", (), {"remote": staticmethod(remote)})()


def _policy(sizes: list[int], timeout_s: float = 30.0):
    import ray.train

    from meshtrain.cluster.elastic_policy import TrainableSizesPolicy

    policy = TrainableSizesPolicy(ray.train.ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 0.6},
                                                          elastic_resize_monitor_interval_s=0.001),
                                  sizes, timeout_s)
    policy._maybe_send_resource_request = lambda: None  # no autoscaling coordinator here
    return policy


def test_ray_is_offered_only_trainable_sizes() -> None:
    """Ray's own count of workers the free resources hold, rounded down to a trainable size: 3 slots
    train on 2, and below the smallest trainable size Ray is told none (it waits for capacity)."""
    policy = _policy([2, 4])
    assert policy._count_possible_workers({"a": {"CPU": 2.0}}) == 2  # Ray's count: 3
    assert policy._count_possible_workers({"a": {"CPU": 2.0}, "b": {"CPU": 0.7}}) == 4
    assert policy._count_possible_workers({"a": {"CPU": 1.0}}) == 0  # 1 slot: below every trainable size
    assert _policy([1, 2, 4])._count_possible_workers({"a": {"CPU": 1.0}}) == 1


def test_draining_and_dead_nodes_are_not_counted(monkeypatch) -> None:
    import meshtrain.cluster.elastic_policy as elastic_policy

    policy = _policy([2, 4])
    monkeypatch.setattr(elastic_policy, "unusable_nodes", lambda: {"b"})
    assert policy._count_possible_workers({"a": {"CPU": 1.3}, "b": {"CPU": 1.3}}) == 2  # 4 with b


def test_a_resize_waits_until_every_worker_has_saved_then_happens(monkeypatch) -> None:
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.scaling_policy.scaling_policy import NoopDecision, ResizeDecision

    import meshtrain.cluster.elastic_policy as elastic_policy

    monkeypatch.setattr(elastic_policy, "ready_values", list)
    calls: list = []
    actors = [_Actor(calls), _Actor(calls)]
    state = SimpleNamespace(start_time=0.0, num_workers=2, workers=[SimpleNamespace(actor=actor) for actor in actors])
    policy = _policy([1, 2, 4])
    policy._get_reserved_resources = lambda: {"a": {"CPU": 2.5}}  # capacity for 4 is back
    assert isinstance(policy.make_decision_for_running_worker_group(state, None), NoopDecision)
    assert calls == ["request_resize", "request_resize"]  # every worker is asked to save where it is
    assert all(actor.state.pending() for actor in actors)
    assert isinstance(policy.make_decision_for_running_worker_group(state, None), NoopDecision)  # no answer yet
    actors[0].state.answer(13, True)
    assert isinstance(policy.make_decision_for_running_worker_group(state, None), NoopDecision)  # one of two
    actors[1].state.answer(13, True)
    decision = policy.make_decision_for_running_worker_group(state, None)
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 4
    assert calls.count("request_resize") == 2
    # No answer comes (a stuck save): the resize happens after the timeout anyway.
    stuck = _policy([1, 2, 4], timeout_s=0.0)
    stuck._get_reserved_resources = lambda: {"a": {"CPU": 2.5}}
    assert isinstance(stuck.make_decision_for_running_worker_group(state, None), NoopDecision)
    assert isinstance(stuck.make_decision_for_running_worker_group(state, None), ResizeDecision)
    # An answer to an earlier request is no answer to this one.
    again = _policy([1, 2, 4])
    again._get_reserved_resources = lambda: {"a": {"CPU": 2.5}}
    assert isinstance(again.make_decision_for_running_worker_group(state, None), NoopDecision)
    assert isinstance(again.make_decision_for_running_worker_group(state, None), NoopDecision)
    # Same capacity: nothing to do. Less (a node being drained): the group saves first, as for a grow.
    calls.clear()
    same = _policy([1, 2, 4])
    same._get_reserved_resources = lambda: {"a": {"CPU": 1.3}}
    assert isinstance(same.make_decision_for_running_worker_group(state, None), NoopDecision) and calls == []
    shrink = _policy([1, 2, 4])
    shrink._get_reserved_resources = lambda: {"a": {"CPU": 0.7}}
    assert isinstance(shrink.make_decision_for_running_worker_group(state, None), NoopDecision)
    assert calls.count("request_resize") == 2
    for actor in actors:
        actor.state.answer(20, False)  # checkpoints off: answered at once, nothing to wait for
    decision = shrink.make_decision_for_running_worker_group(state, None)
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 1


def test_the_trainer_hands_ray_the_policy_for_elastic_runs(tmp_path) -> None:
    from meshtrain.cluster.elastic_policy import TrainableSizesPolicy
    from meshtrain.cluster.ray_trainer import build_trainer
    from meshtrain.train.plan import WorkerPlan

    def spec(cfg: MeshtrainConfig, name: str) -> WorkerPlan:
        assert cfg.run.name == name
        return worker_plan(cfg, SimpleNamespace(vocab_size=512), "x")  # the tokenizer's size alone: no data read

    cfg = load_config(None, [*BATCH, "scaling.min_workers=2", f"run.storage_path={tmp_path}", "run.name=elastic"])
    trainer = build_trainer(spec(cfg, "elastic"))
    policy = trainer._elastic_policy(trainer.scaling_config)
    assert isinstance(policy, TrainableSizesPolicy) and policy.sizes == [2, 4, 8]
    assert policy.grow_save_timeout_s == cfg.scaling.grow_save_timeout_s
    import pickle

    assert pickle.loads(pickle.dumps(policy)).sizes == [2, 4, 8]  # it travels to Ray's controller
    fixed = build_trainer(spec(load_config(None, [*BATCH, f"run.storage_path={tmp_path}", "run.name=f"]), "f"))
    assert fixed._elastic_policy is None
