"""Building one rank's model: on meta, sharded on the mesh, materialized and initialized (or loaded)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshtrain.checkpoint.hf_weights import load_hf_weights
from meshtrain.config import ModelArgs, ParallelConfig
from meshtrain.distributed.float8 import check_float8_device, convert_to_float8
from meshtrain.distributed.layout import MeshPlan, RankLayout, WorkerLayout, node_placement
from meshtrain.distributed.mesh import check_shard_placement, resolve_mesh_shape
from meshtrain.distributed.parallelize import build_mesh, loss_group, parallelize
from meshtrain.distributed.pipeline import local_stage_indices
from meshtrain.model.context_parallel import ContextParallel
from meshtrain.model.init import init_weights
from meshtrain.model.llama import Transformer, build_model, materialize
from meshtrain.model.stages import ModelStage, keep_stages


def build_sharded_model(
    args: ModelArgs,
    parallel: ParallelConfig,
    worker: WorkerLayout,
    device: torch.device,
    seed: int,
    workers_per_node: int | None = None,
    init_from: str | None = None,
    document_eos: int | None = None,
    pipeline_split: Sequence[int] = (),
) -> tuple[Transformer, RankLayout]:
    """Model built on meta, sharded (when distributed), materialized on ``device`` and initialized
    from ``seed``, or filled from ``init_from`` (model.init_from; each rank reading only its own shards),
    with this rank's layout on the mesh. A run that resumes passes no ``init_from``: its checkpoint
    replaces every weight, so reading them is waste. ``workers_per_node``: scaling.workers_per_node
    (learned from the group when unset). ``document_eos``: the end-of-document token the model masks
    attention at (model.document_mask), None = attention across the window. ``pipeline_split``: the layers of
    each pipeline stage (the plan's, under parallel.pipeline > 1); the model is then this rank's part
    (:mod:`meshtrain.model.stages`)."""
    plan = MeshPlan(1, 1, True)
    if dist.is_initialized():
        per_node, node_of_rank = node_placement(worker, workers_per_node)
        plan = resolve_mesh_shape(worker.world_size, per_node, parallel.strategy, parallel.shard,
                                  parallel.context, parallel.tensor, parallel.pipeline)
        placement = check_shard_placement(plan, node_of_rank, parallel.shard)
        if placement is not None and worker.world_rank == 0:
            print(placement, flush=True)
    built, layout = sharded_meta_model(args, parallel, plan, device, worker, document_eos, pipeline_split)
    fill_model(built, device, seed, init_from, offload=parallel.cpu_offload)
    return built, layout


def sharded_meta_model(
    args: ModelArgs,
    parallel: ParallelConfig,
    plan: MeshPlan,
    device: torch.device,
    worker: WorkerLayout | None = None,
    document_eos: int | None = None,
    pipeline_split: Sequence[int] = (),
) -> tuple[Transformer, RankLayout]:
    """The model on meta, sharded on ``plan``'s mesh of ``device`` when distributed (no storage yet),
    and the layout of ``worker`` (rank 0 when not given) on that mesh. The mesh comes first: the model
    is built knowing its context-parallel group, its recompute mode and its document mask."""
    parallel.check_model(args)
    mesh = build_mesh(plan, device.type) if dist.is_initialized() else None
    built = build_model(
        args, "meta", document_eos=document_eos,
        context_parallel=ContextParallel.of(mesh["context"].get_group()) if mesh is not None and plan.context > 1 else None,
        recompute=parallel.activation_checkpointing if mesh is not None else "none",
    )
    if parallel.float8:
        check_float8_device(device, recipe=parallel.float8_recipe)
        emulate = device.type != "cuda"
        converted = convert_to_float8(built, emulate=emulate, fsdp_all_gather=dist.is_initialized(),
                                      tensor=parallel.tensor, recipe=parallel.float8_recipe)
        if worker is not None and worker.world_rank == 0:
            print(f"[meshtrain] float8: {converted} linears, {parallel.float8_recipe} scales"
                  f"{' (emulated)' if emulate else ''}", flush=True)
    layout = RankLayout(worker or WorkerLayout(0, plan.world_size), plan)
    stages: list[ModelStage] = []
    if plan.pipeline > 1:
        stages = pipeline_part(built, parallel, plan.pipeline_rank(layout.rank), pipeline_split)
    if mesh is not None:
        parallelize(built, mesh, plan, parallel, stages)
        layout = RankLayout(layout.worker, plan, loss_group=loss_group(mesh, plan),
                            pipeline_group=mesh["pipeline"].get_group() if plan.pipeline > 1 else None)
    return built, layout


def pipeline_part(model: Transformer, parallel: ParallelConfig, pipeline_rank: int, split: Sequence[int]
                  ) -> list[ModelStage]:
    """Prune ``model`` to the stages pipeline rank ``pipeline_rank`` holds (``split``: each stage's layers)."""
    if len(split) != parallel.pipeline_stages or sum(split) != model.args.n_layers:
        raise ValueError(f"a pipeline split of {list(split)} for {parallel.pipeline_stages} stages of "
                         f"{model.args.n_layers} layers")
    held = local_stage_indices(parallel.pipeline_schedule, parallel.pipeline, parallel.virtual_stages, pipeline_rank)
    first = [sum(split[:stage]) for stage in range(len(split))]
    return keep_stages(model, [range(first[stage], first[stage] + split[stage]) for stage in held], held,
                       len(split))


def fill_model(model: Transformer, device: torch.device, seed: int, init_from: str | None = None,
               offload: bool = False) -> None:
    """Storage for a meta model's shards on ``device``, initialized from ``seed`` or read from
    ``init_from`` (a Hugging Face checkpoint); ``offload``: parallel.cpu_offload."""
    # Offloaded shards live on the host (FSDP copies them over per unit); the RoPE buffers are read
    # inside the blocks, which FSDP does not move, so they stay on the compute device.
    offload = offload and dist.is_initialized()
    materialize(model, "cpu" if offload else device, buffer_device=device)
    if init_from is None:
        init_weights(model, seed)
    else:
        load_hf_weights(model, init_from)
