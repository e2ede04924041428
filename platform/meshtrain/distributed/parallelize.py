"""Device mesh and FSDP2 sharding of the Llama model."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    ParallelStyle,
    SequenceParallel,
    parallelize_module,
)

from meshtrain.config import ParallelConfig
from meshtrain.distributed.float8 import gather_float8_as_bytes
from meshtrain.distributed.layout import MeshPlan
from meshtrain.model.llama import Transformer


def build_mesh(plan: MeshPlan, device_type: str) -> DeviceMesh:
    """The ("replicate", "shard"[, "context"][, "tensor"]) mesh; consecutive ranks form a tensor group,
    then a context group, then a shard group (each on one node under Ray)."""
    return init_device_mesh(device_type, plan.shape, mesh_dim_names=plan.dim_names)


def fsdp_mesh(mesh: DeviceMesh, plan: MeshPlan) -> DeviceMesh:
    """The mesh FSDP shards over: (replicate, shard) for HSDP, the shard dimension alone when there is
    one replica (FSDP2 takes any 2D mesh as HSDP and all-reduces every unit's gradient over its
    replicate dimension, even one of a single rank). With context parallel, shard x context is
    flattened into one dimension (context peers hold different tokens, so they shard and average
    gradients like data-parallel ranks do). Checkpoints do not depend on it: DCP stores each
    parameter's global offsets, so the 1D (Shard(0),) and 2D (Replicate(), Shard(0)) layouts read
    each other's."""
    shard = mesh["shard", "context"]._flatten("shard_context") if plan.context > 1 else mesh["shard"]
    if plan.replicate == 1:
        return shard
    if plan.context > 1:
        return DeviceMesh._concatenate([mesh["replicate"], shard])
    return mesh["replicate", "shard"] if plan.tensor > 1 or plan.pipeline > 1 else mesh


def loss_group(mesh: DeviceMesh, plan: MeshPlan) -> dist.ProcessGroup | None:
    """The ranks whose loss sums add up to the global batch's (one of each tensor-parallel group, whose
    members compute the same sum); None = every rank."""
    if plan.tensor == 1:
        return None
    return mesh[tuple(name for name in plan.dim_names if name != "tensor")]._flatten("loss").get_group()


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """Megatron-style TP on the 1D ``mesh``: q/k/v, gate and up projections split by columns (heads,
    FFN units), the output projections by rows; the residual stream and the norms between them stay
    split along the sequence (sequence parallel), so each norm's activations are 1/TP in size; the
    embedding splits the vocabulary and the output head returns vocabulary-sharded logits for the
    vocabulary-parallel loss (full logits never exist on one rank). A pipeline stage's part splits the ends
    it holds."""
    ends: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        ends["norm"] = SequenceParallel()
        ends["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, ends)
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # The attention gets the gathered sequence; RoPE tables and the mask pass through as they are.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    if model.args.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        # Both plans split the shared weight by vocabulary rows (Shard(0)), so the head's plan kept the
        # embedding's DTensor but wrapped it in a Parameter of its own: one Parameter again, one gradient.
        model.output.weight = model.tok_embeddings.weight


def param_dtype(setting: str, device_type: str) -> torch.dtype:
    if setting == "bf16" or (setting == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return torch.float32


def use_tf32(setting: bool | None, mixed_precision: str, device_type: str) -> bool:
    """Whether fp32 matrix multiplies run in TF32: ``train.tf32``, else on for CUDA computing in fp32."""
    if device_type != "cuda":
        return False
    return setting if setting is not None else param_dtype(mixed_precision, device_type) == torch.float32


def set_matmul_precision(tf32: bool) -> None:
    """TF32 (or full fp32) for fp32 matrix multiplies and convolutions in this process."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32


def enable_async_tensor_parallel(mesh: DeviceMesh) -> None:
    """Async TP (``parallel.async_tensor``; CUDA with compile, checked before Ray): inductor splits
    each TP all-gather/reduce-scatter and its matmul into pipelined pieces over symmetric memory."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.get_group().group_name)


def parallelize(model: Transformer, mesh: DeviceMesh, plan: MeshPlan, cfg: ParallelConfig,
                stages: Sequence[nn.Module] = ()) -> Transformer:
    """Apply, in this order: tensor parallel, per-block compile, FSDP2, prefetch (each block recomputes
    in backward as it was built to, ``parallel.activation_checkpointing``).

    Under pipeline parallel ``model`` is this rank's part and ``stages`` its stages' views
    (:mod:`meshtrain.model.stages`): each stage is an FSDP root of its own, as torch's pipeline stage runs
    it.

    Compile goes first so FSDP's all-gather/reduce-scatter hooks wrap the compiled, checkpointed block
    from the outside (the order torch.compile and FSDP2 expect).
    TP goes before all of them: FSDP then shards the TP-sharded weights further along dim 0.
    """
    if plan.tensor > 1:
        apply_tensor_parallel(model, mesh["tensor"])
        # FSDP warns that the TP embedding's sequence-sharded output is a view, which an in-place op could
        # detach from its pre-backward hook; Transformer._embed copies it before anything else touches it
        # (TP losses and gradients equal one process's: tests/test_equivalence.py), so the warning says nothing.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
        if cfg.async_tensor:
            enable_async_tensor_parallel(mesh["tensor"])
    data_mesh = fsdp_mesh(mesh, plan)
    # 1. Activation checkpointing: each block was built with its recompute mode (parallel.activation_checkpointing).

    # 2. torch.compile per block: repeated identical blocks reuse one compiled graph.
    if cfg.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)

    # 3. FSDP2, bottom-up: each block, then the embedding, then norm+head, then the root.
    #    Units used first in backward (last block, norm+head) keep their parameters gathered
    #    after forward: resharding them would only be undone immediately.
    # No input casting: it would turn the fp32 RoPE tables each block receives into bf16. Hidden
    # states still run in param_dtype, since they start as the output of the cast embedding.
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype(cfg.mixed_precision, data_mesh.device_type),
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    # Pinned host memory makes the host<->GPU copies asynchronous; it needs an accelerator.
    offload_policy = (
        CPUOffloadPolicy(pin_memory=data_mesh.device_type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    )

    def shard(module: nn.Module | list[nn.Module], reshard_after_forward: bool) -> None:
        fully_shard(module, mesh=data_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy)

    reshard = plan.reshard_after_forward  # off under pipeline parallel (resolve_mesh_shape)
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshard and index < len(blocks) - 1)
    if not model.args.tie_embeddings:
        # A tied weight must live in exactly one unit, so with tying both stay in the root.
        if model.tok_embeddings is not None:
            shard(model.tok_embeddings, reshard_after_forward=reshard)
        if model.norm is not None and model.output is not None:
            shard([model.norm, model.output], reshard_after_forward=False)
    roots: Sequence[nn.Module] = stages or (model,)
    for root in roots:
        shard(root, reshard_after_forward=False)
    if cfg.float8 and mesh.device_type == "cpu":
        gather_float8_as_bytes(model)

    # 4. Prefetch: FSDP2 already gathers one block ahead; deeper prefetch trades memory for overlap.
    if cfg.prefetch > 1:
        for root in roots:
            units = [cast(FSDPModule, block) for block in cast(nn.ModuleDict, root.layers).values()]
            for index, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + cfg.prefetch])
                unit.set_modules_to_backward_prefetch(units[max(0, index - cfg.prefetch) : index][::-1])
    return model


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float,
                    pipeline: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (sharded or not), clipped to ``max_norm`` when > 0.

    On DTensor gradients the per-shard norms are combined over the dims that split them only
    (replicas hold the same gradient), then the clip factor applies to every local shard. ``pipeline``:
    the ranks of the other pipeline stages (each holds other parameters), whose squares are added too.
    """
    # Gradients grouped by how they are sharded (with TP the norms' weights are replicated over the
    # tensor dim where the linears' are split): each group's squared norm is summed over the mesh dims
    # that split it, in one all-reduce. DTensor's own norm would redistribute per mesh dim, and warn.
    kinds: dict[object, list[torch.Tensor]] = {}
    for grad in (p.grad for p in parameters if p.grad is not None):
        kinds.setdefault((grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None, []).append(grad)
    squares = [_squared_norm(grads) for grads in kinds.values()] or [torch.zeros(())]
    if pipeline is not None:
        squared = torch.stack(squares).sum()
        dist.all_reduce(squared, group=pipeline)
        squares = [squared]
    total = squares[0].sqrt() if len(squares) == 1 else torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared global L2 norm of gradients that share one sharding (plain tensors, or DTensors on
    one mesh with the same placements)."""
    if not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).pow(2)
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(placement.is_partial() for placement in placements) or mesh.mesh_dim_names is None:
        return cast(DTensor, torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)).full_tensor().pow(2)
    local = torch.nn.utils.get_total_norm([cast(DTensor, grad).to_local() for grad in grads], norm_type=2.0,
                                          foreach=True).pow(2)
    split = [name for name, placement in zip(mesh.mesh_dim_names, placements) if not placement.is_replicate()]
    if split:
        # Mesh bookkeeping (the flattened group is made once, then looked up) runs on real tensors,
        # also when the traced dry run steps under fake mode.
        with unset_fake_temporarily():
            group = mesh.get_group(split[0]) if len(split) == 1 else mesh[tuple(split)]._flatten().get_group()
        dist.all_reduce(local, group=group)
    return local
