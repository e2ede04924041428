"""Mesh-shape resolution: strategy x cluster layout x parallel.shard -> (replicate, shard)."""

from __future__ import annotations

import socket

import pytest

from meshtrain.config import ConfigError
from meshtrain.distributed.layout import MESH_DIM_NAMES, MeshPlan, RankLayout, WorkerLayout
from meshtrain.distributed.mesh import check_shard_placement, resolve_mesh_shape

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")

# (world_size, workers_per_node, strategy, shard) -> ((replicate, shard), reshard_after_forward)
SHAPES = [
    # hybrid_shard: shard within a group, replicate across groups; auto = one group per node.
    ((4, 2, "hybrid_shard", "auto"), ((2, 2), True)),
    ((4, 4, "hybrid_shard", "auto"), ((1, 4), True)),
    ((16, 8, "hybrid_shard", "auto"), ((2, 8), True)),
    ((2, 1, "hybrid_shard", "auto"), ((2, 1), True)),
    ((1, 1, "hybrid_shard", "auto"), ((1, 1), True)),
    ((8, 8, "hybrid_shard", 2), ((4, 2), True)),
    ((8, 4, "hybrid_shard", 8), ((1, 8), True)),  # a shard group may span nodes
    ((8, 4, "hybrid_shard", 1), ((8, 1), True)),
    ((6, 4, "hybrid_shard", 3), ((2, 3), True)),  # explicit shard: workers per node is not consulted
    # hybrid_shard_zero2: same shapes, parameters stay gathered after forward.
    ((4, 2, "hybrid_shard_zero2", "auto"), ((2, 2), False)),
    ((8, 8, "hybrid_shard_zero2", "auto"), ((1, 8), False)),
    ((8, 8, "hybrid_shard_zero2", 4), ((2, 4), False)),
    # full_shard / shard_grad_op: one shard group over every worker, whatever the node layout.
    ((4, 2, "full_shard", "auto"), ((1, 4), True)),
    ((4, 2, "full_shard", 4), ((1, 4), True)),
    ((6, 4, "full_shard", "auto"), ((1, 6), True)),
    ((1, 1, "full_shard", "auto"), ((1, 1), True)),
    ((8, 8, "shard_grad_op", "auto"), ((1, 8), False)),
    ((8, 4, "shard_grad_op", 8), ((1, 8), False)),
    ((2, 2, "shard_grad_op", "auto"), ((1, 2), False)),
    # no_shard: plain data parallelism, every worker holds everything.
    ((4, 2, "no_shard", "auto"), ((4, 1), True)),
    ((4, 2, "no_shard", 1), ((4, 1), True)),
    ((6, 4, "no_shard", "auto"), ((6, 1), True)),
    ((1, 1, "no_shard", "auto"), ((1, 1), True)),
]


def test_table_covers_every_strategy_with_auto_and_explicit_shard() -> None:
    for strategy in STRATEGIES:
        shards = {case[3] for case, _ in SHAPES if case[2] == strategy}
        assert "auto" in shards, strategy
        assert any(isinstance(shard, int) for shard in shards), strategy


def _ids(table: list) -> list[str]:
    return [f"{w}w-{n}pn-{s}-{sh}" for (w, n, s, sh), _ in table]


@pytest.mark.parametrize(("case", "expected"), SHAPES, ids=_ids(SHAPES))
def test_resolve_mesh_shape(case: tuple, expected: tuple) -> None:
    world_size, workers_per_node, strategy, shard = case
    shape, reshard = expected
    plan = resolve_mesh_shape(world_size, workers_per_node, strategy, shard)
    assert isinstance(plan, MeshPlan)
    assert plan.shape == shape
    assert (plan.replicate, plan.shard) == shape
    assert plan.reshard_after_forward is reshard
    assert plan.world_size == world_size
    # Every worker is a data-parallel rank, whichever dimension it sits on.
    assert plan.data_parallel_size == world_size


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [1, 2, 4, 6, 8, 12, 16])
def test_auto_shape_always_covers_the_world(strategy: str, world_size: int) -> None:
    for workers_per_node in (d for d in range(1, world_size + 1) if world_size % d == 0):
        plan = resolve_mesh_shape(world_size, workers_per_node, strategy, "auto")
        assert plan.replicate * plan.shard == world_size
        assert plan.replicate >= 1 and plan.shard >= 1


def test_mesh_dim_names() -> None:
    assert MESH_DIM_NAMES == ("pipeline", "replicate", "shard", "context", "tensor")
    assert MeshPlan(2, 4, True).dim_names == ("replicate", "shard") and MeshPlan(2, 4, True).shape == (2, 4)
    assert MeshPlan(1, 2, True, context=2, tensor=2).shape == (1, 2, 2, 2)
    assert MeshPlan(2, 1, True, tensor=4).dim_names == ("replicate", "shard", "tensor")
    piped = MeshPlan(1, 8, True, tensor=8, pipeline=8)
    assert piped.dim_names == ("pipeline", "replicate", "shard", "tensor") and piped.shape == (8, 1, 8, 8)
    assert piped.sizes == (1, 8, 1, 8) and piped.all_sizes == (8, 1, 8, 1, 8)  # sizes: within a stage


def test_pipeline_stages_are_the_outermost_blocks_of_consecutive_ranks() -> None:
    plan = MeshPlan(2, 2, True, tensor=2, pipeline=4)  # 32 ranks, 8 to a stage
    assert (plan.world_size, plan.stage_size, plan.data_parallel_size, plan.gradient_ranks) == (32, 8, 4, 4)
    assert [plan.pipeline_rank(rank) for rank in (0, 7, 8, 31)] == [0, 0, 1, 3]
    # Every stage repeats the same layout: rank 8 + r sits where rank r does, and reads the same samples.
    assert [plan.coordinates(8 + rank) for rank in range(8)] == [plan.coordinates(rank) for rank in range(8)]
    assert [plan.data_parallel_rank(rank) for rank in range(32)] == [rank % 8 // 2 for rank in range(32)]


def test_pipeline_degree_divides_the_workers_before_the_data_parallel_ranks() -> None:
    # Llama 3 405B's layout: 64 nodes of 8, TP 8 inside a node, 8 stages of 8 nodes, FSDP over 8.
    # Under pipeline parallel the gathered weights stay through the micro-batches: reshard_after_forward is off.
    assert resolve_mesh_shape(512, 8, "full_shard", "auto", tensor=8, pipeline=8) == MeshPlan(1, 8, False, 1, 8, 8)
    assert resolve_mesh_shape(512, 8, "hybrid_shard", 4, tensor=8, pipeline=8) == MeshPlan(2, 4, False, 1, 8, 8)
    # auto: a node's data-parallel ranks; a node holding whole stages shards over a stage's ranks.
    assert resolve_mesh_shape(64, 8, "hybrid_shard", "auto", tensor=2, pipeline=4) == MeshPlan(2, 4, False, 1, 2, 4)
    assert resolve_mesh_shape(8, 8, "hybrid_shard", "auto", pipeline=4) == MeshPlan(1, 2, False, 1, 1, 4)
    with pytest.raises(ConfigError, match=r"^parallel.pipeline x parallel.tensor x parallel.context = 8 x 8 x 1 = 64 "
                                          r"does not divide the 500 workers; use a multiple of 64 workers$"):
        resolve_mesh_shape(500, 4, "full_shard", "auto", tensor=8, pipeline=8)
    with pytest.raises(ConfigError, match=r"^parallel.tensor x parallel.context = 16 x 1 = 16 does not divide the 8 "
                                          r"workers per node: tensor- and context-parallel groups must lie within one node"):
        resolve_mesh_shape(512, 8, "full_shard", "auto", tensor=16, pipeline=8)


def test_pipeline_stages_may_span_nodes_where_shard_groups_are_checked_per_stage() -> None:
    plan = MeshPlan(2, 2, True, pipeline=2)  # 8 ranks on 2 nodes of 4: each stage on one node
    assert check_shard_placement(plan, [0] * 4 + [1] * 4, "auto") == (
        "[meshtrain] placement: each of the 4 shard groups of 2 ranks is on one node")
    with pytest.raises(ConfigError, match=r"group 1 \(ranks 2-3\) on nodes 0,1"):
        check_shard_placement(plan, [0, 0, 0, 1, 1, 1, 1, 1], "auto")


def test_ranks_lie_tensor_fastest_and_tp_cp_peers_share_a_data_parallel_rank() -> None:
    plan = MeshPlan(2, 2, True, context=2, tensor=2)  # 16 ranks
    assert [plan.coordinates(rank) for rank in (0, 1, 2, 5, 15)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 1), (1, 1, 1, 1)]
    assert [plan.data_parallel_rank(rank) for rank in range(16)] == [r // 4 for r in range(16)]
    assert (plan.data_parallel_size, plan.gradient_ranks, plan.world_size) == (4, 8, 16)


def test_a_rank_layout_answers_each_part_of_the_loop_from_its_worker_and_plan() -> None:
    plan = MeshPlan(2, 2, True, context=2, tensor=2)
    layouts = [RankLayout(WorkerLayout(rank, 16, rank % 8, 8, rank // 8, f"10.0.0.{rank // 8}"), plan) for rank in range(16)]
    assert [layout.data_rank for layout in layouts] == [rank // 4 for rank in range(16)]  # the samples it reads
    assert {(layout.data_ranks, layout.gradient_ranks) for layout in layouts} == {(4, 8)}
    assert [layout.rank for layout in layouts if layout.writes_records] == [0]
    assert layouts[9].node == "10.0.0.1"
    single = RankLayout.single_process()
    assert (single.rank, single.world_size, single.data_rank, single.data_ranks, single.gradient_ranks) == (0, 1, 0, 1, 1)
    assert single.node == socket.gethostname() and single.with_control_group() is single  # no process group


def test_tensor_and_context_degrees_shape_the_mesh() -> None:
    assert resolve_mesh_shape(16, 8, "hybrid_shard", "auto", context=1, tensor=2) == MeshPlan(2, 4, True, 1, 2)
    assert resolve_mesh_shape(16, 8, "full_shard", "auto", context=2, tensor=2) == MeshPlan(1, 4, True, 2, 2)
    assert resolve_mesh_shape(128, 8, "hybrid_shard", 4, tensor=8) == MeshPlan(4, 4, True, 1, 8)
    with pytest.raises(ConfigError, match=r"^parallel.tensor x parallel.context = 4 x 1 = 4 does not divide the 6 "
                                          r"workers per node: tensor- and context-parallel groups must lie within one node"):
        resolve_mesh_shape(12, 6, "hybrid_shard", "auto", tensor=4)


def test_a_tensor_parallel_group_across_nodes_is_refused() -> None:
    plan = MeshPlan(1, 2, True, tensor=2)
    with pytest.raises(ConfigError, match=r"^parallel.tensor x parallel.context: Ray placed groups of 2 ranks across "
                                          r"nodes \(group 1 \(ranks 2-3\) on nodes 0,1\)"):
        check_shard_placement(plan, [0, 0, 0, 1], "auto")
    assert check_shard_placement(MeshPlan(2, 1, True, tensor=2), [0, 0, 1, 1], "auto") == (
        "[meshtrain] placement: each of the 2 tensor/context groups of 2 ranks is on one node")


# (world_size, workers_per_node, strategy, shard) -> the exact one-line message
ERRORS = [
    (
        (4, 2, "hybrid_shard", 3),
        "parallel.shard=3 does not divide scaling.num_workers=4; choose one of 1, 2, 4",
    ),
    (
        (2, 2, "hybrid_shard", 3),
        "parallel.shard=3 does not divide scaling.num_workers=2; choose one of 1, 2",
    ),
    (
        (4, 2, "hybrid_shard", 8),
        "parallel.shard=8 does not divide scaling.num_workers=4; choose one of 1, 2, 4",
    ),
    (
        (12, 8, "hybrid_shard_zero2", 5),
        "parallel.shard=5 does not divide scaling.num_workers=12; choose one of 1, 2, 3, 4, 6, 12",
    ),
    (
        (6, 4, "hybrid_shard", "auto"),
        "parallel.shard=auto: 4 workers per node do not divide scaling.num_workers=6; "
        "set parallel.shard to one of 1, 2, 3, 6",
    ),
    (
        (12, 8, "hybrid_shard_zero2", "auto"),
        "parallel.shard=auto: 8 workers per node do not divide scaling.num_workers=12; "
        "set parallel.shard to one of 1, 2, 3, 4, 6, 12",
    ),
    (
        (4, 2, "full_shard", 2),
        "parallel.shard=2 conflicts with parallel.strategy=full_shard, which shards over all 4 workers; "
        "use strategy hybrid_shard for a smaller shard group or drop parallel.shard",
    ),
    (
        (2, 2, "full_shard", 1),
        "parallel.shard=1 conflicts with parallel.strategy=full_shard, which shards over all 2 workers; "
        "use strategy hybrid_shard for a smaller shard group or drop parallel.shard",
    ),
    (
        (8, 8, "shard_grad_op", 4),
        "parallel.shard=4 conflicts with parallel.strategy=shard_grad_op, which shards over all 8 workers; "
        "use strategy hybrid_shard for a smaller shard group or drop parallel.shard",
    ),
    (
        (4, 2, "no_shard", 2),
        "parallel.shard=2 conflicts with parallel.strategy=no_shard, which replicates parameters on every "
        "worker; use strategy hybrid_shard or drop parallel.shard",
    ),
    (
        (4, 4, "no_shard", 4),
        "parallel.shard=4 conflicts with parallel.strategy=no_shard, which replicates parameters on every "
        "worker; use strategy hybrid_shard or drop parallel.shard",
    ),
]


@pytest.mark.parametrize(("case", "message"), ERRORS, ids=_ids(ERRORS))
def test_resolve_mesh_shape_errors(case: tuple, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(*case)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
