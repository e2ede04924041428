"""Stragglers: a rank made 3x slower is named (rank, node, slowdown) in metrics.jsonl and on its own
gauges; the streak logic, and that the timer leaves collective waits out."""

from __future__ import annotations

import time

import pytest
import torch

from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import EvictionRecord, Placement, Record, StragglerRecord
from meshtrain.train.records import LoopOutputs
from meshtrain.train.stragglers import ComputeTimer, StragglerWatch, slowdowns
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks
from record_samples import make


def config(*overrides: str) -> MeshtrainConfig:
    return load_config(None, [
        "train.steps=12", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=4",
        "data.seq_len=64", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2",
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=256",
        "scaling.num_workers=2", "checkpoint.enabled=false", "eval.interval=null", *overrides,
    ])


def _rank_events(rank: int, world: int, cfg: MeshtrainConfig, corpus: DataPlan) -> list[Record]:
    events: list[Record] = []
    train(worker_plan(cfg, corpus), WorkerLayout(rank, world, rank, world, 0, node=f"node-{rank}"), torch.device("cpu"), events.append)
    return events


def test_a_rank_made_five_times_slower_is_named(corpus: DataPlan) -> None:
    cfg = config("fault.kind=slow", "fault.kill_rank=1", "fault.at_step=2", "fault.slow_factor=5",
                 "metrics.straggler_factor=2", "metrics.straggler_patience=3")
    ranks = run_on_ranks(_rank_events, 2, cfg, corpus)
    reports = [[e for e in events if isinstance(e, StragglerRecord)] for events in ranks]
    # 5x against a factor of 2: a step the loaded 2-core machine slows on rank 0 cannot clear the streak
    assert reports[0] == reports[1] and len(reports[0]) == 1, reports  # every rank agrees, once
    report = reports[0][0]
    assert (report.rank, report.node, report.logged_steps) == (1, "node-1", 3)
    assert report.slowdown >= 2.0 and report.step <= 2 + 3 + 2  # slow from step 2, named after 3 logged steps
    assert report.compute_s > 2 * report.median_others_s


def test_slowdown_is_against_the_median_of_the_others() -> None:
    assert slowdowns([1.0, 1.0, 3.0]) == [0.5, 0.5, 3.0]
    assert slowdowns([1.0, 1.0, 1.0, 3.0]) == [1.0, 1.0, 1.0, 3.0]
    assert slowdowns([1.0, 3.0]) == [1 / 3, 3.0]  # two ranks: against the other one, not the mean
    assert slowdowns([2.0]) == [1.0]
    assert slowdowns([0.0, 0.0]) == [1.0, 1.0]


def test_a_straggler_is_reported_once_per_episode_and_its_gauges_follow() -> None:
    events: list[Record] = []
    gauges: list[tuple[float, float, bool]] = []
    timer = ComputeTimer([], torch.device("cpu"))
    watch = StragglerWatch(timer, 1.5, 2, 2, "node-2", LoopOutputs(events.append, None, None), None,
                           lambda *values: gauges.append(values))
    script = [[1, 1, 2], [1, 1, 2], [1, 1, 2], [1, 1, 1], [1, 1, 2], [1, 1, 2], [1, 1, 1.2]]
    for step, times in enumerate(script, start=1):
        watch.observe(step, [(seconds, f"node-{rank}") for rank, seconds in enumerate(times)])
    # Slow at steps 1-3 (reported at 2, after 2 logged steps), recovered at 4, slow again at 5-6.
    assert [(e.step, e.rank, e.node, e.slowdown) for e in events] == [(2, 2, "node-2", 2.0), (6, 2, "node-2", 2.0)]
    assert [flag for _, _, flag in gauges] == [False, True, True, False, False, True, False]
    assert [ratio for _, ratio, _ in gauges] == [2.0, 2.0, 2.0, 1.0, 2.0, 2.0, 1.2]


def test_the_timer_counts_block_compute_not_what_comes_before_a_block() -> None:
    """A pre-hook registered before the timer's (FSDP's all-gather wait) is outside the measured span."""
    block = torch.nn.Linear(4, 4)
    block.register_forward_pre_hook(lambda *_: time.sleep(0.2), prepend=True)  # stands in for FSDP's wait
    timer = ComputeTimer([block], torch.device("cpu"))
    block(torch.ones(2, 4))
    assert timer.take() < 0.2  # the forward alone, without the wait
    timer.close()


def test_a_pipeline_rank_is_timed_as_the_whole_model_would_take_at_its_pace() -> None:
    """Pipeline ranks hold different numbers of blocks: a rank of 1 block of a 4-block model that computes as
    fast per block as a rank of 3 reports the same time, so neither is a straggler."""
    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x

    def timed(blocks: int) -> float:
        layers = [Block() for _ in range(blocks)]
        timer = ComputeTimer(layers, torch.device("cpu"), model_blocks=4)
        for layer in layers:
            layer(torch.ones(1))
        seconds = timer.take()
        timer.close()
        return seconds

    one, three = timed(1), timed(3)
    assert 0.19 <= one and 0.19 <= three and slowdowns([one, three]) == pytest.approx([one / three, three / one])
    assert max(slowdowns([one, three])) < 1.3


def test_straggler_settings_are_checked() -> None:
    from meshtrain.config import ConfigError

    for bad, field in (("metrics.straggler_factor=1", "straggler_factor"), ("metrics.straggler_patience=0", "straggler_patience")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, [bad])


def test_eviction_drains_the_stragglers_node_unless_too_few_workers_would_remain() -> None:
    from meshtrain.cluster.eviction import StragglerEviction

    workers = [Placement(rank=r, node_rank=r // 2, local_rank=r % 2, node_ip=ip, pid=r)
               for r, ip in enumerate(["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"])]
    records: list[Record] = []
    drained: list[tuple[str, str]] = []
    eviction = StragglerEviction(workers, 2, records.append, drain=lambda node, why: (drained.append((node, why)), (True, ""))[1],
                                 find_node=lambda ip: f"id-{ip}")
    straggler = make(StragglerRecord, step=9, rank=2, node="10.0.0.2", slowdown=3.1)
    eviction(straggler)
    eviction(straggler)  # once per node
    assert drained == [("id-10.0.0.2", "meshtrain: rank 2 computes 3.10x slower than the others")]
    assert records == [EvictionRecord(step=9, rank=2, node="10.0.0.2", node_id="id-10.0.0.2", evicted=True,
                                      reason="drained; the group saves and restarts without it")]
    tight = StragglerEviction(workers, 3, records.append, drain=lambda *_: (True, ""), find_node=lambda ip: ip)
    tight(straggler)
    assert records[-1].evicted is False and records[-1].reason == "2 workers would remain, under scaling.min_workers=3"
    refused = StragglerEviction(workers, 2, records.append, drain=lambda *_: (False, "head node"), find_node=lambda ip: ip)
    refused(straggler)
    assert records[-1].evicted is False and records[-1].reason == "drain refused: head node"
    from meshtrain.cluster.eviction import HEAD

    head = StragglerEviction(workers, 2, records.append, drain=lambda *_: (True, ""), find_node=lambda ip: HEAD)
    head(straggler)
    assert records[-1].evicted is False and records[-1].reason == "it is the head node, which holds Ray's GCS"


def test_eviction_needs_an_elastic_run() -> None:
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"^scaling.evict_stragglers=true needs an elastic run"):
        load_config(None, ["scaling.evict_stragglers=true"])
    assert load_config(None, ["scaling.evict_stragglers=true", "scaling.num_workers=4", "scaling.min_workers=2",
                            "train.micro_batch_size=4"])
    # Replica mode replaces a slow group: no elastic setting, but the others must stay at least min_replicas.
    replica = ["scaling.evict_stragglers=true", "fault_tolerance.mode=replica", "parallel.strategy=hybrid_shard",
               "parallel.shard=1", "scaling.num_workers=2", "train.micro_batch_size=4"]
    assert load_config(None, replica).scaling.evict_stragglers
    with pytest.raises(ConfigError, match=r"^scaling.evict_stragglers=true cannot act: ending one of the 2 replica "
                                          r"groups leaves 1, below fault_tolerance.min_replicas=2"):
        load_config(None, [*replica, "fault_tolerance.min_replicas=2"])
