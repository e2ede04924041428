"""Where a process sits: in the worker group (:class:`WorkerLayout`, what Ray reports), on the mesh
(:class:`MeshPlan`, the degrees) and, for training, which ranks each part works with
(:class:`RankLayout`: the samples a rank reads, the ranks that average gradients and add up the loss,
the group that votes on stops and compares speeds, the rank that writes records)."""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshtrain.config import ConfigError

# Outermost first, as torchtitan's (pp, dp_replicate, dp_shard, cp, tp): world ranks are laid out row-major,
# tensor fastest, so a tensor group is consecutive ranks (inside a node: Ray Train numbers workers node by node)
# and a pipeline stage is a block of consecutive ranks, which may span nodes.
MESH_DIM_NAMES = ("pipeline", "replicate", "shard", "context", "tensor")


@dataclass(frozen=True)
class WorkerLayout:
    """Where this process sits in the worker group (from Ray's train context or from a test)."""

    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    node: str = ""  # the node's address as the cluster names it (Ray: its IP); "" = this host's name


@dataclass(frozen=True)
class MeshPlan:
    """The mesh and what each part of training needs of it (which samples a rank reads, which ranks
    average gradients, which ranks split a window or a layer): meshtrain's one answer to "where does
    this rank sit", as torchtitan's ParallelDims is. ``pipeline`` stages each hold the others' degrees."""

    replicate: int
    shard: int
    reshard_after_forward: bool
    context: int = 1
    tensor: int = 1
    pipeline: int = 1

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The mesh's dimensions: replicate and shard always; pipeline, context and tensor when used."""
        return tuple(name for name, size in zip(MESH_DIM_NAMES, self.all_sizes)
                     if name in ("replicate", "shard") or size > 1)

    @property
    def all_sizes(self) -> tuple[int, int, int, int, int]:
        """(pipeline, replicate, shard, context, tensor)."""
        return (self.pipeline, *self.sizes)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(replicate, shard, context, tensor): the degrees within one pipeline stage."""
        return (self.replicate, self.shard, self.context, self.tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for name, size in zip(MESH_DIM_NAMES, self.all_sizes) if name in self.dim_names)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.stage_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (every rank without pipeline parallel)."""
        return self.replicate * self.shard * self.context * self.tensor

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading distinct samples (replicate x shard)."""
        return self.replicate * self.shard

    @property
    def gradient_ranks(self) -> int:
        """Ranks FSDP averages gradients over (replicate x shard x context): each holds a distinct part
        of the global batch's tokens."""
        return self.replicate * self.shard * self.context

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one stage that work on the same samples: one context x tensor group."""
        return self.context * self.tensor

    def pipeline_rank(self, world_rank: int) -> int:
        """The pipeline stage group ``world_rank`` belongs to (0 without pipeline parallel)."""
        return world_rank // self.stage_size

    def coordinates(self, world_rank: int) -> tuple[int, int, int, int]:
        """(replicate, shard, context, tensor) index of ``world_rank`` within its pipeline stage."""
        rest, tensor = divmod(world_rank % self.stage_size, self.tensor)
        rest, context = divmod(rest, self.context)
        replicate, shard = divmod(rest, self.shard)
        return replicate, shard, context, tensor

    def data_parallel_rank(self, world_rank: int) -> int:
        """Which samples ``world_rank`` reads: its index over replicate x shard (the same in every stage)."""
        return world_rank % self.stage_size // self.model_parallel_size


@dataclass(frozen=True)
class RankLayout:
    """This rank's answers for training, in one place (torchtitan's ParallelDims with its groups):
    the trainer builds one and every part of the loop asks it rather than carrying ranks of its own."""

    worker: WorkerLayout
    plan: MeshPlan
    # The ranks whose loss sums add up to the global batch's: one of each tensor-parallel group (its
    # members compute the same sum). None = every rank.
    loss_group: dist.ProcessGroup | None = None
    # The loop's own small collectives (stop votes, straggler times): a gloo group of every rank, apart
    # from the step's and the background checkpoint writes'. None = single process, or not opened.
    control_group: dist.ProcessGroup | None = None
    # The ranks of this rank's other pipeline stages (one of each stage group, at this rank's place in it).
    # None = no pipeline parallel.
    pipeline_group: dist.ProcessGroup | None = None

    @classmethod
    def single_process(cls) -> RankLayout:
        return cls(WorkerLayout(), MeshPlan(1, 1, True))

    @property
    def rank(self) -> int:
        return self.worker.world_rank

    @property
    def world_size(self) -> int:
        return self.worker.world_size

    @property
    def node(self) -> str:
        """This rank's node, as the cluster names it (this host's name outside Ray)."""
        return self.worker.node or socket.gethostname()

    @property
    def data_rank(self) -> int:
        """Which samples this rank reads: tensor- and context-parallel peers read the same ones."""
        return self.plan.data_parallel_rank(self.rank)

    @property
    def data_ranks(self) -> int:
        """Ranks reading distinct samples (replicate x shard)."""
        return self.plan.data_parallel_size

    @property
    def gradient_ranks(self) -> int:
        """Ranks FSDP averages gradients over (replicate x shard x context)."""
        return self.plan.gradient_ranks

    @property
    def writes_records(self) -> bool:
        """Whether this rank writes the run's records (metrics.jsonl, checkpoint commits, warnings)."""
        return self.rank == 0

    def with_control_group(self) -> RankLayout:
        """This layout with its control group opened (a collective: every rank calls it, in order)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or self.control_group is not None:
            return self
        return dataclasses.replace(self, control_group=dist.new_group(backend="gloo"))

    def close(self) -> None:
        if self.control_group is not None:
            dist.destroy_process_group(self.control_group)


def node_placement(layout: WorkerLayout, expected: int | None) -> tuple[int, list[int]]:
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
