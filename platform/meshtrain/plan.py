"""What a run will look like before any worker starts: parameters, mesh and per-rank memory."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import MeshtrainConfig, ModelArgs
from meshtrain.mesh import MeshPlan, resolve_mesh_shape
from meshtrain.model import build_model, count_parameters

GIB = 1024**3
# GPUs per node assumed for parallel.shard=auto when scaling.workers_per_node is unset.
_ASSUMED_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes; activations are an estimate for one micro-batch."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.logits


def planned_mesh(cfg: MeshtrainConfig) -> tuple[MeshPlan, str]:
    """The mesh the run will use, and a note when workers per node had to be assumed."""
    note = ""
    per_node = cfg.scaling.workers_per_node
    if per_node is None:
        if cfg.scaling.use_gpu:
            per_node = min(cfg.scaling.num_workers, _ASSUMED_GPUS_PER_NODE)
            note = f"assuming {per_node} workers per node; set scaling.workers_per_node to be sure"
        else:
            per_node = cfg.scaling.num_workers
            note = "assuming all workers on one node; set scaling.workers_per_node to be sure"
    plan = resolve_mesh_shape(cfg.scaling.num_workers, per_node, cfg.parallel.strategy, cfg.parallel.shard)
    if cfg.parallel.shard != "auto" or cfg.parallel.strategy not in ("hybrid_shard", "hybrid_shard_zero2"):
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


def memory_plan(cfg: MeshtrainConfig, args: ModelArgs, plan: MeshPlan, use_gpu: bool) -> MemoryPlan:
    model = build_model(args, "meta")
    total = count_parameters(model)
    block = count_parameters(model.layers[0])
    compute_bytes = 2 if cfg.parallel.mixed_precision == "bf16" or (cfg.parallel.mixed_precision == "auto" and use_gpu) else 4
    shard = plan.shard
    micro, _ = cfg.batch_layout(plan.data_parallel_size)
    tokens = micro * cfg.data.seq_len

    sharded = -(-total // shard)
    # Unsharded copies alive at once: the running block plus prefetched ones (parameters and their
    # gradients before reduce-scatter); ZeRO-2 strategies keep every block gathered after forward.
    if plan.shard == 1:
        gathered = 0 if compute_bytes == 4 else total * compute_bytes
    elif plan.reshard_after_forward:
        gathered = 2 * (1 + cfg.parallel.prefetch) * block * compute_bytes
    else:
        gathered = (args.n_layers + 1) * block * compute_bytes
    per_layer = _activation_elements_per_token_per_layer(args, cfg.parallel.activation_checkpointing)
    activations = tokens * per_layer * args.n_layers * compute_bytes
    if cfg.parallel.activation_checkpointing == "full":
        activations += tokens * _activation_elements_per_token_per_layer(args, "none") * compute_bytes
    # Logits in compute dtype, their fp32 copy for the loss, and its gradient.
    logits = tokens * args.vocab_size * (compute_bytes + 8)
    on_device = 0 if cfg.parallel.cpu_offload else 1
    return MemoryPlan(
        parameters=4 * sharded * on_device,
        gradients=4 * sharded * on_device,
        optimizer=8 * sharded * on_device,
        gathered=gathered,
        activations=activations,
        logits=logits,
    )


def describe_plan(cfg: MeshtrainConfig, args: ModelArgs) -> str:
    """The human-readable dry-run report (config excluded)."""
    plan, note = planned_mesh(cfg)
    total = count_parameters(build_model(args, "meta"))
    micro, accumulation = cfg.batch_layout(plan.data_parallel_size)
    memory = memory_plan(cfg, args, plan, cfg.scaling.use_gpu)
    lines = [
        f"parameters: {total:,} ({total / 1e6:.1f}M)",
        f"model: dim={args.dim} layers={args.n_layers} heads={args.n_heads} kv_heads={args.n_kv_heads} "
        f"ffn={args.ffn_dim} vocab={args.vocab_size} tied={args.tie_embeddings}",
        f"mesh: (replicate={plan.replicate}, shard={plan.shard}) on {plan.world_size} workers, "
        f"strategy={cfg.parallel.strategy}, reshard_after_forward={plan.reshard_after_forward}"
        + (f" ({note})" if note else ""),
        f"batch: {cfg.train.global_batch_size} sequences x {cfg.data.seq_len} tokens per step = "
        f"micro-batch {micro} x {plan.data_parallel_size} workers x {accumulation} accumulation steps",
        "memory per rank (GiB):"
        + (" [sharded state offloaded to host memory]" if cfg.parallel.cpu_offload else ""),
    ]
    for label, value in (
        ("parameters (fp32, sharded)", memory.parameters),
        ("gradients (fp32, sharded)", memory.gradients),
        ("optimizer state (AdamW, sharded)", memory.optimizer),
        ("gathered units + their grads", memory.gathered),
        (f"activations (estimate, recompute={cfg.parallel.activation_checkpointing})", memory.activations),
        ("logits + loss (estimate)", memory.logits),
        ("total", memory.total),
    ):
        lines.append(f"  {label:<48} {value / GIB:10.3f}")
    return "\n".join(lines)
