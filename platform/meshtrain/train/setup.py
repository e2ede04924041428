"""Building one rank's model: on meta, sharded on the mesh, materialized and initialized (or loaded)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.checkpoint.hf_weights import load_hf_weights
from meshtrain.config import MeshtrainConfig, ModelArgs
from meshtrain.distributed.float8 import check_float8_device, convert_to_float8
from meshtrain.distributed.layout import MeshPlan, RankLayout, WorkerLayout, workers_per_node
from meshtrain.distributed.mesh import check_shard_placement, resolve_mesh_shape
from meshtrain.distributed.parallelize import build_mesh, loss_group, parallelize
from meshtrain.model.args import model_args
from meshtrain.model.context_parallel import ContextParallel
from meshtrain.model.init import init_weights
from meshtrain.model.llama import Transformer, build_model, materialize


def build_sharded_model(
    cfg: MeshtrainConfig,
    model: ModelArgs | int,
    worker: WorkerLayout,
    device: torch.device,
    read_init_from: bool = True,
    document_eos: int | None = None,
) -> tuple[Transformer, RankLayout]:
    """Model built on meta, sharded (when distributed), materialized on ``device`` and initialized,
    or filled from ``model.init_from`` (each rank reading only its own shards), with this rank's
    layout on the mesh. A run that resumes passes ``read_init_from=False``: its checkpoint replaces
    every weight, so reading them is waste. ``model``: the model's shape (``RunSpec.model``), or the
    tokenizer's vocabulary size to resolve it from ``cfg``. ``document_eos``: the end-of-document token the
    model masks attention at (model.document_mask), None = attention across the window."""
    plan = MeshPlan(1, 1, True)
    if dist.is_initialized():
        per_node, node_of_rank = workers_per_node(worker, cfg.scaling.workers_per_node)
        plan = resolve_mesh_shape(worker.world_size, per_node, cfg.parallel.strategy, cfg.parallel.shard,
                                  cfg.parallel.context, cfg.parallel.tensor)
        placement = check_shard_placement(plan, node_of_rank, cfg.parallel.shard)
        if placement is not None and worker.world_rank == 0:
            print(placement, flush=True)
    built, layout = sharded_meta_model(cfg, model, plan, device, worker, document_eos)
    fill_model(built, cfg, device, read_init_from)
    return built, layout


def sharded_meta_model(
    cfg: MeshtrainConfig,
    model: ModelArgs | int,
    plan: MeshPlan,
    device: torch.device,
    worker: WorkerLayout | None = None,
    document_eos: int | None = None,
) -> tuple[Transformer, RankLayout]:
    """The model on meta, sharded on ``plan``'s mesh of ``device`` when distributed (no storage yet),
    and the layout of ``worker`` (rank 0 when not given) on that mesh. The mesh comes first: the model
    is built knowing its context-parallel group, its recompute mode and its document mask."""
    args = model if isinstance(model, ModelArgs) else model_args(cfg.model, model)
    cfg.check_model_parallel(args)
    mesh = build_mesh(plan, device.type) if dist.is_initialized() else None
    built = build_model(
        args, "meta", document_eos=document_eos,
        context_parallel=ContextParallel.of(mesh["context"].get_group()) if mesh is not None and plan.context > 1 else None,
        recompute=cfg.parallel.activation_checkpointing if mesh is not None else "none",
    )
    if cfg.parallel.float8:
        check_float8_device(device, recipe=cfg.parallel.float8_recipe)
        emulate = device.type != "cuda"
        converted = convert_to_float8(built, emulate=emulate, fsdp_all_gather=dist.is_initialized(),
                                      tensor=cfg.parallel.tensor, recipe=cfg.parallel.float8_recipe)
        if worker is not None and worker.world_rank == 0:
            print(f"[meshtrain] float8: {converted} linears, {cfg.parallel.float8_recipe} scales"
                  f"{' (emulated)' if emulate else ''}", flush=True)
    layout = RankLayout(worker or WorkerLayout(0, plan.world_size), plan)
    if mesh is not None:
        parallelize(built, mesh, plan, cfg.parallel)
        layout = RankLayout(layout.worker, plan, loss_group=loss_group(mesh, plan))
    return built, layout


def fill_model(model: Transformer, cfg: MeshtrainConfig, device: torch.device, read_init_from: bool = True) -> None:
    """Storage for a meta model's shards on ``device``, initialized or read from ``model.init_from``."""
    # Offloaded shards live on the host (FSDP copies them over per unit); the RoPE buffers are read
    # inside the blocks, which FSDP does not move, so they stay on the compute device.
    offload = cfg.parallel.cpu_offload and dist.is_initialized()
    materialize(model, "cpu" if offload else device, buffer_device=device)
    if cfg.model.init_from is None or not read_init_from:
        init_weights(model, cfg.train.seed)
    else:
        load_hf_weights(model, cfg.model.init_from)
