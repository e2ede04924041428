"""Resolve the 2D ("replicate", "shard") device-mesh shape from a strategy name and the cluster layout.

Pure functions, no torch.distributed: the driver uses them for --dry-run and config validation, the
workers with the layout Ray reports. Every rank is a data-parallel rank; the mesh only decides which
ranks hold which shard of the parameters.
"""

from __future__ import annotations

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
