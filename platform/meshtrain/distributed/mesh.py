"""Resolve the device-mesh shape ([ "pipeline",] "replicate", "shard"[, "context"][, "tensor"]) from a strategy
name, the pipeline-, tensor- and context-parallel degrees and the cluster layout.

Pure functions, no process groups: the driver uses them for --dry-run and config validation, the
workers with the layout Ray reports. Ranks are laid out row-major over the mesh, tensor fastest:
a tensor-parallel group is consecutive ranks, then a context-parallel group, then a shard group, so
each lies within one node when the node holds a whole number of them; a pipeline stage, outermost, is
a block of consecutive ranks that may span nodes (its peers exchange one activation per micro-batch,
where TP and FSDP exchange every layer's). The data-parallel ranks are replicate x shard, the same in
every stage; TP, CP and PP peers read the same samples. FSDP shards over shard x context within a stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from meshtrain.config import STRATEGIES, ConfigError, StrategyName, check_parallel_groups
from meshtrain.distributed.layout import MeshPlan


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_mesh_shape(
    world_size: int,
    workers_per_node: int,
    strategy: StrategyName,
    shard: int | Literal["auto"],
    context: int = 1,
    tensor: int = 1,
    pipeline: int = 1,
) -> MeshPlan:
    """Mesh shape for ``strategy`` on ``world_size`` workers, ``workers_per_node`` to a node, in
    ``pipeline`` stages with ``tensor`` x ``context`` workers to each data-parallel rank of a stage."""
    inner = context * tensor
    check_parallel_groups(context, tensor, world_size, f"the {world_size} workers", workers_per_node,
                          f"the {workers_per_node} workers per node", pipeline)
    sharding = STRATEGIES[strategy]
    # Under pipeline parallel the gathered weights stay through a step's micro-batches (torchtitan's default): a
    # reshard after each micro-batch's forward would gather every weight once per micro-batch.
    reshard = not sharding.keeps_params_after_forward and pipeline == 1
    ranks, per_node = world_size // (pipeline * inner), max(1, workers_per_node // inner)  # data-parallel ranks
    if pipeline > 1 and per_node > ranks and per_node % ranks == 0:
        per_node = ranks  # a node holds whole stages: an auto shard group is a stage's data-parallel ranks

    def plan(replicate: int, shard_size: int) -> MeshPlan:
        return MeshPlan(replicate, shard_size, reshard, context, tensor, pipeline)

    if sharding.shards == "all":
        if shard not in ("auto", ranks):
            raise ConfigError(
                f"parallel.shard={shard} conflicts with parallel.strategy={strategy}, which shards over all "
                f"{ranks} {'workers' if inner == 1 and pipeline == 1 else 'data-parallel ranks'}; use strategy hybrid_shard for a smaller shard group or drop parallel.shard"
            )
        return plan(1, ranks)
    if sharding.shards == "none":
        if shard not in ("auto", 1):
            raise ConfigError(
                f"parallel.shard={shard} conflicts with parallel.strategy=no_shard, which replicates "
                "parameters on every worker; use strategy hybrid_shard or drop parallel.shard"
            )
        return plan(ranks, 1)
    if shard == "auto":
        if ranks % per_node:
            where = f"scaling.num_workers={world_size}" if pipeline == 1 else f"a stage's {ranks * inner} workers"
            raise ConfigError(
                f"parallel.shard=auto: {workers_per_node} workers per node do not divide "
                f"{where}; set parallel.shard to one of {_divisors(ranks)}"
            )
        shard = per_node
    if ranks % shard:
        where = f"scaling.num_workers={world_size}" if inner == 1 and pipeline == 1 else f"the {ranks} data-parallel ranks"
        raise ConfigError(f"parallel.shard={shard} does not divide {where}; choose one of {_divisors(ranks)}")
    return plan(ranks // shard, shard)


def groups_off_node(node_of_rank: Sequence[int], group_size: int) -> dict[int, list[int]]:
    """Groups of ``group_size`` consecutive ranks that sit on more than one node: group index -> its
    nodes, sorted. ``node_of_rank[i]`` is the node of world rank ``i``."""
    split: dict[int, list[int]] = {}
    for group in range(len(node_of_rank) // group_size):
        nodes = sorted(set(node_of_rank[group * group_size : (group + 1) * group_size]))
        if len(nodes) > 1:
            split[group] = nodes
    return split


def shard_groups_off_node(plan: MeshPlan, node_of_rank: Sequence[int]) -> dict[int, list[int]]:
    """Shard groups whose ranks sit on more than one node: group index -> its nodes, sorted.

    ``node_of_rank[i]`` is the node of world rank ``i``. Shard group ``r`` is the consecutive world
    ranks of one (pipeline, replicate) index (its shard x context x tensor ranks, see ``build_mesh``).
    """
    if len(node_of_rank) != plan.world_size:
        raise ValueError(f"{len(node_of_rank)} placements for a {'x'.join(map(str, plan.shape))} mesh")
    return groups_off_node(node_of_rank, plan.shard * plan.model_parallel_size)


def _describe(split: dict[int, list[int]], group_size: int, limit: int = 4) -> str:
    parts = [
        f"group {group} (ranks {group * group_size}-{(group + 1) * group_size - 1}) on nodes {','.join(map(str, nodes))}"
        for group, nodes in list(split.items())[:limit]
    ]
    more = f" and {len(split) - limit} more" if len(split) > limit else ""
    return "; ".join(parts) + more


def check_shard_placement(plan: MeshPlan, node_of_rank: Sequence[int], shard: int | Literal["auto"]) -> str | None:
    """Check that every tensor- and context-parallel group and every HSDP shard group is on one node,
    so their collectives never cross the network.

    Returns one line for rank 0 to print: the check passed, or (explicit ``parallel.shard``) a
    warning. Raises ConfigError when a TP/CP group spans nodes (always wrong: they exchange
    activations every layer), or when ``parallel.shard=auto`` chose the shard size and Ray placed a
    shard group across nodes. None when there is nothing to check: a single shard group over every
    worker (plain FSDP) spans nodes by design, and groups of one rank cannot.
    """
    inner = plan.model_parallel_size
    if inner > 1:
        if len(node_of_rank) != plan.world_size:
            raise ValueError(f"{len(node_of_rank)} placements for a {'x'.join(map(str, plan.shape))} mesh")
        split = groups_off_node(node_of_rank, inner)
        if split:
            raise ConfigError(
                f"parallel.tensor x parallel.context: Ray placed groups of {inner} ranks across nodes "
                f"({_describe(split, inner)}); keep scaling.placement_strategy=PACK (or STRICT_PACK) with whole "
                "nodes of workers"
            )
        if plan.replicate == 1 or plan.shard == 1:
            return (f"[meshtrain] placement: each of the {plan.world_size // inner} tensor/context groups of {inner} "
                    "ranks is on one node")
    if plan.replicate == 1 or plan.shard == 1:
        return None
    group_size = plan.shard * inner
    per_node = node_of_rank.count(node_of_rank[0])
    if inner > 1 and group_size > per_node:
        # TP x CP fill most of a node, so a shard group of this size cannot fit in one: by design.
        return (f"[meshtrain] placement: tensor/context groups of {inner} ranks each on one node; the shard groups "
                f"of {group_size} ranks span {group_size // per_node} nodes (FSDP gathers 1/{plan.tensor} of each "
                "weight across them)")
    split = shard_groups_off_node(plan, node_of_rank)
    if not split:
        return (f"[meshtrain] placement: each of the {plan.replicate * plan.pipeline} shard groups of {group_size} ranks "
                "is on one node")
    where = _describe(split, group_size)
    if shard == "auto":
        raise ConfigError(
            f"parallel.shard=auto: Ray placed shard groups across nodes ({where}), so their all-gathers would go "
            "over the network; keep scaling.placement_strategy=PACK (or STRICT_PACK) with whole nodes of workers, "
            "or set parallel.shard explicitly to accept it"
        )
    return (
        f"[meshtrain] WARNING: parallel.shard={shard}: shard groups span nodes ({where}); their all-gathers go over "
        "the network; set parallel.shard to the workers per node (or auto) to keep them on one node"
    )
