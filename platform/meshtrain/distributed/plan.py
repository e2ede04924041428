"""What a run will look like before any worker starts: parameters, mesh and per-rank memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshtrain.config import ModelArgs, ParallelConfig, ScalingConfig, TrainConfig
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.model.llama import Transformer, build_model, count_parameters
from meshtrain.model.loss import loss_chunk_tokens

GIB = 1024**3
# GPUs per node assumed for parallel.shard=auto when scaling.workers_per_node is unset.
_ASSUMED_GPUS_PER_NODE = 8

# GiB the driver reports for one device (nvidia-smi's total), by Ray accelerator type
# (ray.util.accelerators). A type name that covers two sizes gets the smaller one.
DEVICE_MEMORY_GIB: dict[str, float] = {
    "B200": 179.0,
    "H200": 140.4,
    "H100": 79.6,
    "A100-80G": 80.0,
    "A100-40G": 40.0,
    "A100": 40.0,
    "L40S": 44.9,
    "L4": 22.4,
    "A10G": 22.4,
    "V100": 15.7,
    "T4": 15.0,
}
_AMBIGUOUS_TYPES = {"A100": "A100-80G", "V100": "V100 32 GB"}
# Kept out of the plan's reach: a fixed amount for the CUDA context, cuBLAS workspaces and NCCL
# buffers, plus a share of the device for the caching allocator's fragmentation.
CONTEXT_RESERVE_GIB = 2.0
FRAGMENTATION_SHARE = 0.10


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes on the device; activations are an estimate for one micro-batch.

    Not every term is alive at once. The peak is the largest of three moments of the step (checked
    against a traced step, ``meshtrain.train.trace``): the loss's backward (every stored activation,
    the logits and their gradient, no parameter gradient yet); just after the head's backward (the
    logits gone, the head's gradient and its fp32 reduce-scatter input alive); and the end of backward
    (every sharded gradient, the activations gone but one block being recomputed).
    """

    parameters: int
    gradients: int
    optimizer: int
    gathered_blocks: int  # blocks gathered around the running one (and, under ZeRO-2, all of them)
    head_unit: int  # norm + output head (the root unit with tied embeddings), weight and gradient
    activations: int  # stored for backward
    logits: int
    recompute_block: int = 0  # one block's activations, recomputed in backward (full recompute)
    head_reduce: int = 0  # the head's gradient in fp32, the input of its reduce-scatter
    gathered_block_weights: int = 0  # of gathered_blocks, the weights alone: what is gathered before any block's backward

    @property
    def gathered(self) -> int:
        return self.gathered_blocks + self.head_unit

    @property
    def at_loss(self) -> int:
        return (self.parameters + self.optimizer + self.gathered_block_weights + self.head_unit // 2 + self.activations
                + self.logits)

    @property
    def after_head(self) -> int:
        return self.parameters + self.optimizer + self.gathered_block_weights + self.head_unit + self.head_reduce + self.activations

    @property
    def end_of_backward(self) -> int:
        return self.parameters + self.optimizer + self.gradients + self.gathered + self.recompute_block

    @property
    def total(self) -> int:
        """The planned peak: the largest of the three moments."""
        return max(self.at_loss, self.after_head, self.end_of_backward)


@dataclass(frozen=True)
class Device:
    """One accelerator as the plan sees it: a name and its memory."""

    name: str
    memory_gib: float
    note: str = ""

    @property
    def usable_gib(self) -> float:
        return self.memory_gib * (1 - FRAGMENTATION_SHARE) - CONTEXT_RESERVE_GIB


def planned_mesh(scaling: ScalingConfig, parallel: ParallelConfig) -> tuple[MeshPlan, str]:
    """The mesh the run will use, and a note when workers per node had to be assumed."""
    note = ""
    per_node = scaling.workers_per_node
    if per_node is None:
        if scaling.use_gpu:
            per_node = min(scaling.num_workers, _ASSUMED_GPUS_PER_NODE)
            note = f"assuming {per_node} workers per node; set scaling.workers_per_node to be sure"
        else:
            per_node = scaling.num_workers
            note = "assuming all workers on one node; set scaling.workers_per_node to be sure"
    plan = resolve_mesh_shape(scaling.num_workers, per_node, parallel.strategy, parallel.shard,
                              parallel.context, parallel.tensor)
    if parallel.shard != "auto" or parallel.sharding.shards != "group":
        note = ""
    return plan, note


def _activation_elements_per_token_per_layer(args: ModelArgs, recompute: str) -> int:
    h, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    # Tensors autograd keeps for one block: norm inputs/outputs, q/k/v before and after RoPE,
    # repeated k/v, attention output, and the four SwiGLU intermediates.
    everything = 9 * h + 3 * kv + 4 * f
    if recompute == "full":
        return h  # only the block input; one block is recomputed at a time (added below)
    if recompute == "selective":
        return 5 * h + 2 * kv + 2 * f  # matmul and attention outputs plus the block input
    return everything


def compute_bytes(mixed_precision: str, use_gpu: bool) -> int:
    """Bytes per element of gathered parameters, activations and logits (see parallel.param_dtype)."""
    return 2 if mixed_precision == "bf16" or (mixed_precision == "auto" and use_gpu) else 4


def head_elements(model: Transformer) -> int:
    """Parameters of the final norm + output head; with tied embeddings the root unit holds the
    same weight (embedding = head) and the norm, so the count is the same."""
    return count_parameters(model.norm) + count_parameters(model.output)


def gathered_blocks_bytes(model: Transformer, plan: MeshPlan, prefetch: int, element_bytes: int) -> int:
    """Unsharded block copies alive at once, parameters and their gradients before reduce-scatter.

    Resharding after forward: the running block plus ``prefetch`` gathered ahead (FSDP2 gathers
    even on a shard group of 1, into a separate unsharded buffer). ZeRO-2: every block stays
    gathered from forward to backward, plus one block's gradient, plus an untied embedding unit.
    """
    block = count_parameters(model.layers[0])
    if plan.reshard_after_forward:
        return 2 * (1 + prefetch) * block * element_bytes
    embedding = 0 if model.args.tie_embeddings else count_parameters(model.tok_embeddings)
    return (model.args.n_layers * block + block + embedding) * element_bytes


def gathered_block_weights_bytes(model: Transformer, plan: MeshPlan, prefetch: int, element_bytes: int) -> int:
    """Block weights gathered from the end of forward until the first block's backward: the last block
    and the ones prefetched for backward, or (ZeRO-2) every block and an untied embedding."""
    block = count_parameters(model.layers[0])
    if plan.reshard_after_forward:
        return (1 + prefetch) * block * element_bytes
    embedding = 0 if model.args.tie_embeddings else count_parameters(model.tok_embeddings)
    return (model.args.n_layers * block + embedding) * element_bytes


def head_unit_bytes(model: Transformer, element_bytes: int) -> int:
    """The head unit (reshard_after_forward=False): its full weight from forward to backward plus
    its unsharded gradient before reduce-scatter, both in the compute dtype."""
    return 2 * head_elements(model) * element_bytes


def logits_bytes(args: ModelArgs, tokens: int, element_bytes: int) -> int:
    """The chunked loss (model.token_cross_entropy_sum) at its backward peak: the logits in the
    compute dtype (their gradient is written into the same buffer), one fp32 chunk of at most
    ``loss_chunk_tokens`` tokens, and an fp32 log-sum-exp per token."""
    chunk = min(tokens, loss_chunk_tokens(args.vocab_size))
    return tokens * args.vocab_size * element_bytes + chunk * args.vocab_size * 4 + tokens * 4


def activation_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int, tensor: int = 1) -> int:
    """Activations every block keeps for backward, for ``tokens`` on this rank. Computing in bf16
    without recompute, each of the two RMSNorms also keeps its input upcast to fp32 (seen in the
    traced step). Under tensor parallel with sequence-parallel norms each rank keeps 1/TP of them,
    but for the two gathered norm outputs the column-parallel matmuls keep whole."""
    per_layer = _activation_elements_per_token_per_layer(args, recompute) * element_bytes
    if recompute == "none" and element_bytes < 4:
        per_layer += 2 * args.dim * 4
    gathered = 2 * args.dim * element_bytes if recompute != "full" else 0
    per_layer = per_layer // tensor + gathered - gathered // tensor
    return tokens * per_layer * args.n_layers


def recompute_block_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int) -> int:
    """Under full recompute, the activations of the one block being recomputed in backward."""
    if recompute != "full":
        return 0
    return tokens * _activation_elements_per_token_per_layer(args, "none") * element_bytes


def gathered_kv_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int, context: int) -> int:
    """Under context parallel, the keys and values every block gathers from its peers (the rest of the
    window) and keeps for attention's backward: in every block, or (full recompute) the one recomputed."""
    if context == 1:
        return 0
    per_block = tokens * (context - 1) * 2 * args.n_kv_heads * args.head_dim * element_bytes
    return per_block * (1 if recompute == "full" else args.n_layers)


def document_mask_bytes(document_mask: bool, seq_len: int, micro_batch: int, use_gpu: bool, element_bytes: int) -> int:
    """The CPU kernel's additive (seq, seq) mask per sample, shared by every block; flex attention's
    block mask on GPU is negligible (a few bytes per 128x128 block)."""
    if not document_mask or use_gpu:
        return 0
    return micro_batch * seq_len**2 * element_bytes


def memory_plan(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, seq_len: int,
                use_gpu: bool, document_mask: bool = False) -> MemoryPlan:
    """One rank's peak memory for ``args`` on ``plan``'s mesh, by part (arithmetic; ``train.trace``
    checks it against a traced step). ``document_mask``: model.document_mask."""
    model = build_model(args, "meta")
    element_bytes = compute_bytes(parallel.mixed_precision, use_gpu)
    micro, _ = train.batch_layout(plan.data_parallel_size)
    tokens = micro * seq_len // plan.context  # this rank's share of its windows
    tensor = plan.tensor
    recompute = parallel.activation_checkpointing
    # FSDP shards over shard x context, tensor parallel splits each block, head and embedding further.
    sharded = -(-count_parameters(model) // (plan.shard * plan.context * tensor))
    on_device = 0 if parallel.cpu_offload else 1
    return MemoryPlan(
        parameters=4 * sharded * on_device,
        gradients=4 * sharded * on_device,
        optimizer=8 * sharded * on_device,
        gathered_blocks=gathered_blocks_bytes(model, plan, parallel.prefetch, element_bytes) // tensor,
        head_unit=head_unit_bytes(model, element_bytes) // tensor,
        activations=activation_bytes(args, recompute, tokens, element_bytes, tensor)
        + document_mask_bytes(document_mask, seq_len, micro, use_gpu, element_bytes) // plan.context
        + gathered_kv_bytes(args, recompute, tokens, element_bytes, plan.context),
        logits=logits_bytes(args, tokens, element_bytes) // tensor,
        recompute_block=recompute_block_bytes(args, recompute, tokens, element_bytes) // tensor,
        head_reduce=4 * head_elements(model) // tensor,
        gathered_block_weights=gathered_block_weights_bytes(model, plan, parallel.prefetch, element_bytes) // tensor,
    )


def planned_device(scaling: ScalingConfig) -> Device | None:
    """The GPU the verdict is for: scaling.device_memory_gib, else a known scaling.accelerator_type."""
    if not scaling.use_gpu:
        return None
    kind = scaling.accelerator_type
    if scaling.device_memory_gib is not None:
        return Device(kind or "the GPU", scaling.device_memory_gib)
    known = {name.lower(): name for name in DEVICE_MEMORY_GIB}
    if kind is None or kind.lower() not in known:
        return None
    name = known[kind.lower()]
    note = ""
    if name in _AMBIGUOUS_TYPES:
        note = f"; the smaller {name} assumed: for the {_AMBIGUOUS_TYPES[name]} set scaling.device_memory_gib"
    return Device(name, DEVICE_MEMORY_GIB[name], note)


def fit_verdict(memory: MemoryPlan, device: Device | None) -> str:
    """One line: whether the per-rank plan fits ``device``, with the margin it keeps."""
    if device is None:
        return (
            "verdict: device memory unknown; set scaling.device_memory_gib or scaling.accelerator_type to "
            f"one of {', '.join(DEVICE_MEMORY_GIB)}"
        )
    planned = memory.total / GIB
    margin = f"{FRAGMENTATION_SHARE:.0%} + {CONTEXT_RESERVE_GIB:g} GiB kept for the CUDA context, NCCL and fragmentation"
    head = f"{device.name} ({device.memory_gib:g} GiB): {planned:.1f} GiB planned of {device.usable_gib:.1f} usable"
    if planned <= device.usable_gib:
        return f"verdict: fits {head} ({margin}{device.note})"
    return (
        f"verdict: does not fit {head} ({margin}{device.note}); lower train.micro_batch_size, set "
        "parallel.activation_checkpointing=full or parallel.cpu_offload=true, or shard over more workers"
    )


def _elastic_lines(scaling: ScalingConfig, train: TrainConfig, group_size: int, sizes: Sequence[int]) -> list[str]:
    if not scaling.elastic:
        return []
    each = ", ".join(f"{size} (accumulation {train.batch_layout(size // group_size)[1]})" for size in sizes)
    return [
        f"elastic: scaling.min_workers={scaling.min_workers} to scaling.num_workers={scaling.num_workers}; "
        f"trains on {each} workers, same global batch; Ray offering another size fails that start"
    ]


def describe_plan(args: ModelArgs, parallel: ParallelConfig, scaling: ScalingConfig, train: TrainConfig, seq_len: int,
                  document_mask: bool, group_sizes: Sequence[int]) -> str:
    """The human-readable dry-run report (config excluded); ``group_sizes``: the worker-group sizes the
    run trains on (``MeshtrainConfig.elastic_sizes``)."""
    plan, note = planned_mesh(scaling, parallel)
    total = count_parameters(build_model(args, "meta"))
    micro, accumulation = train.batch_layout(plan.data_parallel_size)
    memory = memory_plan(args, plan, parallel, train, seq_len, scaling.use_gpu, document_mask)
    lines = [
        f"parameters: {total:,} ({total / 1e6:.1f}M)",
        f"model: dim={args.dim} layers={args.n_layers} heads={args.n_heads} kv_heads={args.n_kv_heads} "
        f"ffn={args.ffn_dim} vocab={args.vocab_size} tied={args.tie_embeddings} rope_theta={args.rope_theta:g}"
        + ("" if args.rope_scaling is None else
           f" rope_scaling=llama3(factor={args.rope_scaling.factor:g}, low={args.rope_scaling.low_freq_factor:g}, "
           f"high={args.rope_scaling.high_freq_factor:g}, original={args.rope_scaling.original_max_position_embeddings})"),
        f"mesh: ({', '.join(f'{name}={size}' for name, size in zip(plan.dim_names, plan.shape))}) on "
        f"{plan.world_size} workers, "
        f"strategy={parallel.strategy}, reshard_after_forward={plan.reshard_after_forward}"
        + (f" ({note})" if note else ""),
        f"batch: {train.global_batch_size} sequences x {seq_len} tokens per step = "
        f"micro-batch {micro} x {plan.data_parallel_size} "
        f"{'workers' if plan.model_parallel_size == 1 else 'data-parallel ranks'} x {accumulation} accumulation steps",
        *_elastic_lines(scaling, train, parallel.group_size, group_sizes),
        # Above the table, which readers (and tests) parse as "label value" lines to the end.
        *([fit_verdict(memory, planned_device(scaling))] if scaling.use_gpu else []),
        "memory per rank (GiB):"
        + (" [sharded state offloaded to host memory]" if parallel.cpu_offload else ""),
    ]
    for label, value in (
        ("parameters (fp32, sharded)", memory.parameters),
        ("gradients (fp32, sharded)", memory.gradients),
        ("optimizer state (AdamW, sharded)", memory.optimizer),
        ("gathered units + their grads", memory.gathered),
        (f"activations (estimate, recompute={parallel.activation_checkpointing})", memory.activations),
        ("logits + loss (estimate)", memory.logits),
        *([("block recomputed in backward (estimate)", memory.recompute_block)] if memory.recompute_block else []),
        ("head gradient, fp32 for its reduce-scatter", memory.head_reduce),
        ("at the loss's backward", memory.at_loss),
        ("just after the head's backward", memory.after_head),
        ("at the end of backward", memory.end_of_backward),
        ("total (peak: the largest of the three)", memory.total),
    ):
        lines.append(f"  {label:<48} {value / GIB:10.3f}")
    return "\n".join(lines)
