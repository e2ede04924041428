"""Resolve the 2D ("replicate", "shard") device-mesh shape from a strategy name and the cluster layout.

Pure functions, no torch.distributed: the driver uses them for --dry-run and config validation, the
workers with the layout Ray reports. Every rank is a data-parallel rank; the mesh only decides which
ranks hold which shard of the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshtrain.config import ConfigError, StrategyName

MESH_DIM_NAMES = ("replicate", "shard")

# Strategies whose parameters stay gathered between forward and backward (ZeRO-2 style).
_KEEPS_PARAMS_AFTER_FORWARD = {"shard_grad_op", "hybrid_shard_zero2"}


@dataclass(frozen=True)
class MeshPlan:
    replicate: int
    shard: int
    reshard_after_forward: bool

    @property
    def shape(self) -> tuple[int, int]:
        return (self.replicate, self.shard)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def data_parallel_size(self) -> int:
        return self.world_size


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_mesh_shape(
    world_size: int,
    workers_per_node: int,
    strategy: StrategyName,
    shard: int | Literal["auto"],
) -> MeshPlan:
    """Mesh shape for ``strategy`` on ``world_size`` workers, ``workers_per_node`` to a node."""
    reshard = strategy not in _KEEPS_PARAMS_AFTER_FORWARD
    if strategy in ("full_shard", "shard_grad_op"):
        if shard not in ("auto", world_size):
            raise ConfigError(
                f"parallel.shard={shard} conflicts with parallel.strategy={strategy}, which shards over all "
                f"{world_size} workers; use strategy hybrid_shard for a smaller shard group or drop parallel.shard"
            )
        return MeshPlan(1, world_size, reshard)
    if strategy == "no_shard":
        if shard not in ("auto", 1):
            raise ConfigError(
                f"parallel.shard={shard} conflicts with parallel.strategy=no_shard, which replicates "
                "parameters on every worker; use strategy hybrid_shard or drop parallel.shard"
            )
        return MeshPlan(world_size, 1, reshard)
    if shard == "auto":
        if world_size % workers_per_node:
            raise ConfigError(
                f"parallel.shard=auto: {workers_per_node} workers per node do not divide "
                f"scaling.num_workers={world_size}; set parallel.shard to one of {_divisors(world_size)}"
            )
        shard = workers_per_node
    if world_size % shard:
        raise ConfigError(
            f"parallel.shard={shard} does not divide scaling.num_workers={world_size}; "
            f"choose one of {_divisors(world_size)}"
        )
    return MeshPlan(world_size // shard, shard, reshard)


def shard_groups_off_node(plan: MeshPlan, node_of_rank: Sequence[int]) -> dict[int, list[int]]:
    """Shard groups whose ranks sit on more than one node: group index -> its nodes, sorted.

    ``node_of_rank[i]`` is the node of world rank ``i``. Shard group ``r`` is world ranks
    ``r*shard .. r*shard+shard-1`` (the consecutive ranks of one mesh row, see ``build_mesh``).
    """
    if len(node_of_rank) != plan.world_size:
        raise ValueError(f"{len(node_of_rank)} placements for a {plan.replicate}x{plan.shard} mesh")
    split: dict[int, list[int]] = {}
    for group in range(plan.replicate):
        nodes = sorted(set(node_of_rank[group * plan.shard : (group + 1) * plan.shard]))
        if len(nodes) > 1:
            split[group] = nodes
    return split


def _describe(plan: MeshPlan, split: dict[int, list[int]], limit: int = 4) -> str:
    parts = [
        f"group {group} (ranks {group * plan.shard}-{(group + 1) * plan.shard - 1}) on nodes {','.join(map(str, nodes))}"
        for group, nodes in list(split.items())[:limit]
    ]
    more = f" and {len(split) - limit} more" if len(split) > limit else ""
    return "; ".join(parts) + more


def check_shard_placement(plan: MeshPlan, node_of_rank: Sequence[int], shard: int | Literal["auto"]) -> str | None:
    """Check that every HSDP shard group is on one node, so its all-gathers never cross the network.

    Returns one line for rank 0 to print: the check passed, or (explicit ``parallel.shard``) a
    warning. Raises ConfigError when ``parallel.shard=auto`` chose the shard size and Ray placed a
    shard group across nodes. None when there is nothing to check: a single shard group over every
    worker (plain FSDP) spans nodes by design, and groups of one rank cannot.
    """
    if plan.replicate == 1 or plan.shard == 1:
        return None
    split = shard_groups_off_node(plan, node_of_rank)
    if not split:
        return f"[meshtrain] placement: each of the {plan.replicate} shard groups of {plan.shard} ranks is on one node"
    where = _describe(plan, split)
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
