"""Where a process sits in the worker group, and how many workers share its node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshtrain.config import ConfigError


@dataclass(frozen=True)
class WorkerLayout:
    """Where this process sits in the worker group (from Ray's train context or from a test)."""

    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    node: str = ""  # the node's address as the cluster names it (Ray: its IP); "" = this host's name


def workers_per_node(layout: WorkerLayout, expected: int | None) -> tuple[int, list[int]]:
    """Workers per node, checked to be the same on every node (HSDP shard groups need that), and
    the node of every rank, in rank order (to check where the shard groups landed)."""
    placements = [(layout.local_world_size, layout.node_rank)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, placements[0])
        placements = gathered
    counts = [count for count, _ in placements]
    if len(set(counts)) != 1:
        raise ConfigError(
            f"parallel.shard=auto: nodes hold different numbers of workers ({sorted(set(counts))}); "
            "set parallel.shard explicitly or size scaling.num_workers to fill whole nodes"
        )
    if expected is not None and expected != counts[0]:
        raise ConfigError(
            f"scaling.workers_per_node={expected}, but Ray placed {counts[0]} workers per node; "
            "fix scaling.workers_per_node or leave it unset"
        )
    return counts[0], [node for _, node in placements]
