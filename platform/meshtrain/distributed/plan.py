"""What a run will look like before any worker starts: parameters, mesh, pipeline stages and per-rank memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshtrain.config import ConfigError, ModelArgs, ParallelConfig, ScalingConfig, TrainConfig
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.distributed.pipeline import (
    ScheduleOrder,
    balanced_split,
    peak_in_flight,
    schedule_order,
    simulate,
    stage_split,
)
from meshtrain.model.flops import ModelFlops
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


def planned_workers_per_node(scaling: ScalingConfig) -> int:
    """scaling.workers_per_node, else what the plan assumes: 8 GPUs, or every CPU worker on one node."""
    if scaling.workers_per_node is not None:
        return scaling.workers_per_node
    return min(scaling.num_workers, _ASSUMED_GPUS_PER_NODE) if scaling.use_gpu else scaling.num_workers


def planned_mesh(scaling: ScalingConfig, parallel: ParallelConfig) -> tuple[MeshPlan, str]:
    """The mesh the run will use, and a note when workers per node had to be assumed."""
    note = ""
    per_node = planned_workers_per_node(scaling)
    if scaling.workers_per_node is None:
        note = (f"assuming {per_node} workers per node" if scaling.use_gpu else "assuming all workers on one node")
        note += "; set scaling.workers_per_node to be sure"
    plan = resolve_mesh_shape(scaling.num_workers, per_node, parallel.strategy, parallel.shard,
                              parallel.context, parallel.tensor, parallel.pipeline)
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
    assert model.norm is not None and model.output is not None, "the memory plan reads the whole model"
    return count_parameters(model.norm) + count_parameters(model.output)


def block_parameters(model: Transformer) -> int:
    """Parameters of one block (they are all alike)."""
    return count_parameters(next(iter(model.layers.values())))


def embedding_parameters(model: Transformer) -> int:
    assert model.tok_embeddings is not None, "the memory plan reads the whole model"
    return count_parameters(model.tok_embeddings)


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of the model and keeps for backward at its peak: the whole model and one
    micro-batch without pipeline parallel; under it, its stages' layers (the embedding on the first
    stage, the head on the last) and the micro-batches its schedule keeps in flight."""

    layers: int  # blocks held
    embedding: bool
    head: bool  # the final norm and the output head, with the loss
    in_flight_layers: int  # blocks x micro-batches whose activations are kept at once
    in_flight_microbatches: int = 1  # (stage, micro-batch) pairs kept at once
    in_flight_logits: int = 1  # micro-batches whose logits are kept at once (on the last stage)

    @classmethod
    def whole(cls, n_layers: int) -> RankShare:
        return cls(n_layers, True, True, n_layers)


def gathered_blocks_bytes(model: Transformer, plan: MeshPlan, prefetch: int, element_bytes: int,
                          share: RankShare | None = None) -> int:
    """Unsharded block copies alive at once, parameters and their gradients before reduce-scatter.

    Resharding after forward: the running block plus ``prefetch`` gathered ahead (FSDP2 gathers
    even on a shard group of 1, into a separate unsharded buffer). ZeRO-2: every block held stays
    gathered from forward to backward, plus one block's gradient, plus an untied embedding unit.
    """
    block = block_parameters(model)
    if plan.reshard_after_forward:
        return 2 * (1 + prefetch) * block * element_bytes
    return (gathered_block_weights_bytes(model, plan, prefetch, element_bytes, share) + block * element_bytes)


def gathered_block_weights_bytes(model: Transformer, plan: MeshPlan, prefetch: int, element_bytes: int,
                                 share: RankShare | None = None) -> int:
    """Block weights gathered from the end of forward until the first block's backward: the last block
    and the ones prefetched for backward, or (ZeRO-2) every block held and an untied embedding."""
    block = block_parameters(model)
    if plan.reshard_after_forward:
        return (1 + prefetch) * block * element_bytes
    share = share or RankShare.whole(model.args.n_layers)
    embedding = 0 if model.args.tie_embeddings or not share.embedding else embedding_parameters(model)
    return (share.layers * block + embedding) * element_bytes


def held_parameters(model: Transformer, share: RankShare) -> int:
    """Parameters of the blocks, embedding and head ``share`` holds; a tied weight once when one rank
    holds both ends (under pipeline parallel the first and the last stage each hold it)."""
    embedding, head = embedding_parameters(model), head_elements(model)
    held = share.layers * block_parameters(model)
    held += (embedding if share.embedding else 0) + (head if share.head else 0)
    if model.args.tie_embeddings and share.embedding and share.head:
        held -= embedding
    return held


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


def activation_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int, tensor: int = 1,
                     layers: int | None = None) -> int:
    """Activations every block keeps for backward, for ``tokens`` on this rank, over ``layers`` blocks
    (default: every block of the model). Computing in bf16 without recompute, each of the two RMSNorms
    also keeps its input upcast to fp32 (seen in the traced step). Under tensor parallel with
    sequence-parallel norms each rank keeps 1/TP of them, but for the two gathered norm outputs the
    column-parallel matmuls keep whole."""
    per_layer = _activation_elements_per_token_per_layer(args, recompute) * element_bytes
    if recompute == "none" and element_bytes < 4:
        per_layer += 2 * args.dim * 4
    gathered = 2 * args.dim * element_bytes if recompute != "full" else 0
    per_layer = per_layer // tensor + gathered - gathered // tensor
    return tokens * per_layer * (args.n_layers if layers is None else layers)


def recompute_block_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int) -> int:
    """Under full recompute, the activations of the one block being recomputed in backward."""
    if recompute != "full":
        return 0
    return tokens * _activation_elements_per_token_per_layer(args, "none") * element_bytes


def gathered_kv_bytes(args: ModelArgs, recompute: str, tokens: int, element_bytes: int, context: int,
                      layers: int | None = None) -> int:
    """Under context parallel, the keys and values every block gathers from its peers (the rest of the
    window) and keeps for attention's backward: in every block (``layers``, default all of the model's),
    or (full recompute) the one recomputed."""
    if context == 1:
        return 0
    per_block = tokens * (context - 1) * 2 * args.n_kv_heads * args.head_dim * element_bytes
    return per_block * (1 if recompute == "full" else args.n_layers if layers is None else layers)


def document_mask_bytes(document_mask: bool, seq_len: int, micro_batch: int, use_gpu: bool, element_bytes: int) -> int:
    """The CPU kernel's additive (seq, seq) mask per sample, shared by every block; flex attention's
    block mask on GPU is negligible (a few bytes per 128x128 block)."""
    if not document_mask or use_gpu:
        return 0
    return micro_batch * seq_len**2 * element_bytes


def memory_plan(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, seq_len: int,
                use_gpu: bool, document_mask: bool = False, share: RankShare | None = None,
                model: Transformer | None = None) -> MemoryPlan:
    """One rank's peak memory for ``args`` on ``plan``'s mesh, by part (arithmetic; ``train.trace``
    checks it against a traced step). ``document_mask``: model.document_mask. ``share``: what the rank
    holds under pipeline parallel (default: the whole model, one micro-batch); ``model``: ``args``'
    model on meta, when the caller has built it."""
    model = model or build_model(args, "meta")
    share = share or RankShare.whole(args.n_layers)
    element_bytes = compute_bytes(parallel.mixed_precision, use_gpu)
    micro, _ = train.batch_layout(plan.data_parallel_size)
    tokens = micro * seq_len // plan.context  # this rank's share of its windows
    tensor = plan.tensor
    recompute = parallel.activation_checkpointing
    # FSDP shards over shard x context, tensor parallel splits each block, head and embedding further.
    sharded = -(-held_parameters(model, share) // (plan.shard * plan.context * tensor))
    on_device = 0 if parallel.cpu_offload else 1
    head = 1 if share.head else 0
    return MemoryPlan(
        parameters=4 * sharded * on_device,
        gradients=4 * sharded * on_device,
        optimizer=8 * sharded * on_device,
        gathered_blocks=gathered_blocks_bytes(model, plan, parallel.prefetch, element_bytes, share) // tensor,
        head_unit=head * head_unit_bytes(model, element_bytes) // tensor,
        activations=activation_bytes(args, recompute, tokens, element_bytes, tensor, share.in_flight_layers)
        + share.in_flight_microbatches * document_mask_bytes(document_mask, seq_len, micro, use_gpu, element_bytes)
        // plan.context
        + gathered_kv_bytes(args, recompute, tokens, element_bytes, plan.context, share.in_flight_layers),
        logits=head * share.in_flight_logits * logits_bytes(args, tokens, element_bytes) // tensor,
        recompute_block=recompute_block_bytes(args, recompute, tokens, element_bytes) // tensor,
        head_reduce=head * 4 * head_elements(model) // tensor,
        gathered_block_weights=gathered_block_weights_bytes(model, plan, parallel.prefetch, element_bytes, share)
        // tensor,
    )


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline rank (a stage group of the mesh): its stages, their layers, and its memory plan."""

    rank: int
    stages: tuple[int, ...]
    layers: tuple[range, ...]  # the model's layer indices of each stage held
    share: RankShare
    memory: MemoryPlan
    bubble: float  # idle share of the simulated step

    def describe(self, last_stage: int) -> str:
        held = []
        for stage, layers in zip(self.stages, self.layers):
            ends = " + embedding" if stage == 0 else ""
            ends += " + head and loss" if stage == last_stage else ""
            held.append(f"stage {stage} = layers {layers.start}-{layers.stop - 1} ({len(layers)}){ends}")
        kept = self.share.in_flight_microbatches
        what = f"micro-batch{'es' if kept > 1 else ''}" + (" of its stages" if len(self.stages) > 1 else "")
        return (f"  pipeline rank {self.rank}: {'; '.join(held)}; keeps up to {kept} {what} for backward "
                f"({self.share.in_flight_layers} layer activations); idle {self.bubble:.1%}; peak "
                f"{self.memory.total / GIB:.2f} GiB")


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline of a run: torch's schedule order, the layer split, and each pipeline rank's share."""

    order: ScheduleOrder
    split: tuple[int, ...]
    balanced: bool  # the split was chosen here (parallel.pipeline_split unset)
    ranks: tuple[PipelineRank, ...]
    bubble: float  # simulated with each stage's own work (its layers, the head on the last)
    even_bubble: float  # the same schedule with every stage alike

    @property
    def worst(self) -> PipelineRank:
        """The rank with the largest planned peak: it decides whether the run fits."""
        return max(self.ranks, key=lambda rank: (rank.memory.total, -rank.rank))


def pipeline_order(parallel: ParallelConfig) -> ScheduleOrder:
    """torch's order for the configured schedule, or ConfigError with torch's reason in one line."""
    try:
        return schedule_order(parallel.pipeline_schedule, parallel.pipeline, parallel.virtual_stages,
                              parallel.microbatches)
    except ValueError as exc:
        raise ConfigError(
            f"parallel.pipeline_schedule={parallel.pipeline_schedule} with parallel.pipeline={parallel.pipeline} x "
            f"{parallel.virtual_stages} stages per rank and parallel.pipeline_microbatches={parallel.microbatches}: "
            f"torch refuses it ({str(exc).rstrip('.')}); choose a multiple of {parallel.pipeline} micro-batches or another schedule"
        ) from None


def split_cost(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, seq_len: int,
               use_gpu: bool, order: ScheduleOrder, model: Transformer) -> Callable[[int, int], int]:
    """``cost(rank, layers)``: the planned peak of pipeline rank ``rank`` holding ``layers`` blocks with one
    micro-batch in flight, the embedding counted where the first stage is and the output head with the
    loss where the last is: the memory plan's own terms, for :func:`balanced_split`. The micro-batches a
    schedule keeps in flight are left out of the balance (they would move layers, and with them compute,
    off the first stages) and counted in each rank's plan."""
    known: dict[tuple[bool, bool, int], int] = {}

    def cost(rank: int, layers: int) -> int:
        held = order.stages_of(rank)
        key = (0 in held, order.stages - 1 in held, layers)
        if key not in known:
            share = RankShare(layers, key[0], key[1], layers)
            known[key] = memory_plan(args, plan, parallel, train, seq_len, use_gpu, share=share, model=model).total
        return known[key]

    return cost


def stage_work(args: ModelArgs, split: Sequence[int], seq_len: int) -> list[float]:
    """Each stage's forward time relative to the mean stage's: its blocks' matrix multiplies and causal
    attention (half the window's keys per query), and the output head's on the last stage (the embedding
    is a lookup). The backward's share is the cost model's (``meshtrain.distributed.pipeline``)."""
    flops = ModelFlops.of(args)
    head = 6.0 * args.vocab_size * args.dim
    block = (flops.matmul - head + flops.per_key * seq_len / 2) / args.n_layers
    work = [layers * block for layers in split]
    work[-1] += head
    mean = sum(work) / len(work)
    return [each / mean for each in work]


def pipeline_plan(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, seq_len: int,
                  use_gpu: bool, document_mask: bool = False, model: Transformer | None = None) -> PipelinePlan:
    """The pipeline of ``parallel`` for ``args`` on ``plan``'s mesh (``parallel.pipeline`` > 1): torch's
    order, the split (given, or balanced by :func:`split_costs`), each rank's memory with the micro-batches
    its order keeps in flight, and the simulated bubble."""
    model = model or build_model(args, "meta")
    order = pipeline_order(parallel)
    stages, last = order.stages, order.stages - 1
    if parallel.pipeline_split is not None:
        split = list(parallel.pipeline_split)
    else:
        cost = split_cost(args, plan, parallel, train, seq_len, use_gpu, order, model)
        least = [len(order.stages_of(rank)) for rank in range(order.pipeline)]
        split = stage_split(order, balanced_split(args.n_layers, least, cost))
    first_layer = [sum(split[:stage]) for stage in range(stages)]
    timeline = simulate(order, stage_work(args, split, seq_len).__getitem__)
    ranks = []
    for rank in range(order.pipeline):
        held = order.stages_of(rank)
        share = RankShare(
            layers=sum(split[stage] for stage in held), embedding=0 in held, head=last in held,
            in_flight_layers=round(peak_in_flight(order, rank, split.__getitem__)),
            in_flight_microbatches=round(peak_in_flight(order, rank, lambda stage: 1.0)),
            in_flight_logits=round(peak_in_flight(order, rank, lambda stage: float(stage == last))),
        )
        memory = memory_plan(args, plan, parallel, train, seq_len, use_gpu, document_mask, share, model)
        layers = tuple(range(first_layer[stage], first_layer[stage] + split[stage]) for stage in held)
        ranks.append(PipelineRank(rank, tuple(held), layers, share, memory, timeline.rank_bubble(rank)))
    return PipelinePlan(order, tuple(split), parallel.pipeline_split is None, tuple(ranks), timeline.bubble,
                        simulate(order).bubble)


def rank_memory_plan(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, seq_len: int,
                     use_gpu: bool, document_mask: bool, world_rank: int) -> MemoryPlan:
    """The memory plan of rank ``world_rank``: its pipeline rank's under pipeline parallel, else the model's."""
    if plan.pipeline == 1:
        return memory_plan(args, plan, parallel, train, seq_len, use_gpu, document_mask)
    return pipeline_plan(args, plan, parallel, train, seq_len, use_gpu, document_mask).ranks[
        plan.pipeline_rank(world_rank)].memory


def planned_split(args: ModelArgs, parallel: ParallelConfig, scaling: ScalingConfig, train: TrainConfig, seq_len: int,
                  document_mask: bool) -> tuple[int, ...]:
    """Each pipeline stage's layers as the run will train them (parallel.pipeline_split, or the balance on the
    planned mesh: what --dry-run shows); () without pipeline parallel."""
    if parallel.pipeline == 1:
        return ()
    if parallel.pipeline_split is not None:
        return tuple(parallel.pipeline_split)
    return pipeline_plan(args, planned_mesh(scaling, parallel)[0], parallel, train, seq_len, scaling.use_gpu,
                         document_mask).split


def _pipeline_lines(pipe: PipelinePlan, plan: MeshPlan, per_node: int | None) -> list[str]:
    order = pipe.order
    stage_workers = plan.stage_size
    nodes = f", {stage_workers // per_node} nodes" if per_node and stage_workers % per_node == 0 and \
        stage_workers > per_node else ""
    how = "balanced by the memory plan" if pipe.balanced else "parallel.pipeline_split"
    return [
        f"pipeline: {order.schedule}, {order.pipeline} ranks x {order.virtual_stages} stage"
        f"{'s' if order.virtual_stages > 1 else ''} each = {order.stages} stages, {order.microbatches} micro-batches "
        f"per run; layout pipeline {order.pipeline} x replicate {plan.replicate} x shard {plan.shard} x context "
        f"{plan.context} x tensor {plan.tensor} (a stage: {stage_workers} worker{'s' if stage_workers > 1 else ''}{nodes})",
        f"pipeline split ({how}): {', '.join(map(str, pipe.split))} layers",
        *(rank.describe(order.stages - 1) for rank in pipe.ranks),
        f"bubble: {pipe.bubble:.1%} of each rank's step idle, simulated on torch's {order.schedule} order with each "
        f"stage's own work ({pipe.even_bubble:.1%} with every stage alike; F=1, B=2, I=W=1 per stage forward)",
    ]


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
    model = build_model(args, "meta")
    total = count_parameters(model)
    micro, accumulation = train.batch_layout(plan.data_parallel_size)
    pipe = None
    if parallel.pipeline > 1:
        pipe = pipeline_plan(args, plan, parallel, train, seq_len, scaling.use_gpu, document_mask, model)
        memory = pipe.worst.memory
        ranks = f"{parallel.microbatches} pipeline micro-batches x {plan.data_parallel_size} data-parallel ranks"
        steps = f"{accumulation // parallel.microbatches} pipeline runs"
    else:
        memory = memory_plan(args, plan, parallel, train, seq_len, scaling.use_gpu, document_mask, model=model)
        ranks = f"{plan.data_parallel_size} {'workers' if plan.model_parallel_size == 1 else 'data-parallel ranks'}"
        steps = f"{accumulation} accumulation steps"
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
        f"batch: {train.global_batch_size} sequences x {seq_len} tokens per step = micro-batch {micro} x {ranks} x "
        f"{steps}",
        *_elastic_lines(scaling, train, parallel.data_rank_workers, group_sizes),
        *(_pipeline_lines(pipe, plan, planned_workers_per_node(scaling)) if pipe is not None else []),
        # Above the table, which readers (and tests) parse as "label value" lines to the end.
        *([fit_verdict(memory, planned_device(scaling))] if scaling.use_gpu else []),
        "memory per rank (GiB):"
        + (f" [pipeline rank {pipe.worst.rank}, the largest peak]" if pipe is not None else "")
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
