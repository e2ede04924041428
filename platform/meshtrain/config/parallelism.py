"""How a run spreads over devices: FSDP2/HSDP, tensor, context and pipeline parallel, float8, compile and
recompute (``parallel``), and the Ray worker group (``scaling``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshtrain.config.errors import ConfigError
from meshtrain.config.model import ModelArgs
from meshtrain.config.section import MAX_DURATION_S, Section


StrategyName = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]
# torch.distributed.pipelining's schedules, as torch spells them (its get_schedule_class takes any case).
PipelineScheduleName = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]


@dataclass(frozen=True)
class Strategy:
    """What a ``parallel.strategy`` name means; every place that acts on the strategy reads it here."""

    shards: Literal["all", "group", "none"]  # parameters over every data-parallel rank, a shard group (HSDP), none
    keeps_params_after_forward: bool  # ZeRO-2 style: gathered from forward until backward

    @property
    def replicates(self) -> bool:
        """It has a replicate dimension (whole model copies): fault_tolerance.mode=replica needs one."""
        return self.shards != "all"


STRATEGIES: dict[str, Strategy] = {
    "full_shard": Strategy("all", keeps_params_after_forward=False),
    "shard_grad_op": Strategy("all", keeps_params_after_forward=True),
    "no_shard": Strategy("none", keeps_params_after_forward=False),
    "hybrid_shard": Strategy("group", keeps_params_after_forward=False),
    "hybrid_shard_zero2": Strategy("group", keeps_params_after_forward=True),
}


@dataclass(frozen=True)
class PipelineSchedule:
    """What a ``parallel.pipeline_schedule`` name asks of the layout; torch builds the schedule itself
    (``meshtrain.distributed.pipeline``)."""

    stages_per_rank: Literal["one", "any", "two"]  # 1F1B/GPipe: one; looped: any (default 2); V-shaped: exactly 2
    v_shape: bool = False  # rank r holds stages r and 2 x pipeline - 1 - r (else the looped r, r + pipeline, ...)

    @property
    def default_virtual_stages(self) -> int:
        return 1 if self.stages_per_rank == "one" else 2


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {
    "GPipe": PipelineSchedule("one"),
    "1F1B": PipelineSchedule("one"),
    "Interleaved1F1B": PipelineSchedule("any"),
    "LoopedBFS": PipelineSchedule("any"),
    "InterleavedZeroBubble": PipelineSchedule("any"),
    "ZBVZeroBubble": PipelineSchedule("two", v_shape=True),
    "DualPipeV": PipelineSchedule("two", v_shape=True),
}
_PIPELINE_SETTINGS = ("pipeline_schedule", "pipeline_microbatches", "pipeline_virtual_stages", "pipeline_split")


class ParallelConfig(Section):
    strategy: StrategyName = Field(
        "hybrid_shard",
        description=(
            "full_shard/shard_grad_op shard over all workers; no_shard replicates; hybrid_shard(_zero2) "
            "shards within parallel.shard workers and replicates across groups. *_zero2/shard_grad_op "
            "keep parameters gathered between forward and backward."
        ),
    )
    shard: int | Literal["auto"] = Field(
        "auto", description="Shard group size for hybrid strategies; auto = workers per node."
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Parameter dtype in compute; gradients reduce in fp32. auto = bf16 on GPU, fp32 on CPU."
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters, gradients and optimizer state in host memory.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Recompute activations in backward: every block (full) or all but matmul/attention outputs (selective)."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    float8: bool = Field(
        False,
        description=(
            "float8 matrix multiplies in the transformer blocks' linears (torchao, dynamic scales as "
            "parallel.float8_recipe says; pip install -e '.[float8]'); the output head and embedding stay in "
            "high precision. Needs compute capability 8.9+ (H100, L4, L40S); on CPU emulated (numerics, no speed)."
        ),
    )
    float8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description=(
            "parallel.float8's scales (torchao recipes): tensorwise = one per tensor, with float8 FSDP all-gathers "
            "(fastest); rowwise = one per row, power-of-two, e4m3 gradients, weights all-gathered in high precision "
            "(torchtitan's choice for convergence). Needs parallel.float8=true."
        ),
    )
    prefetch: int = Field(
        1, ge=1, le=8, description="Blocks whose all-gather is issued ahead in forward and backward (1 = FSDP2's default)."
    )
    tensor: int = Field(
        1,
        ge=1,
        description=(
            "Tensor-parallel degree: attention heads, FFN columns and the vocabulary split over this many workers "
            "of one node (Megatron-style, with sequence parallel norms and a vocabulary-parallel loss). It must "
            "divide model.n_heads, model.n_kv_heads, model.ffn_dim and the vocabulary."
        ),
    )
    context: int = Field(
        1,
        ge=1,
        description=(
            "Context-parallel degree: each window's tokens split (load-balanced) over this many workers of one "
            "node, which gather keys and values to attend over the whole window, document mask included. "
            "data.seq_len must be a multiple of 2 x parallel.context."
        ),
    )
    async_tensor: bool = Field(
        False,
        description="Async tensor parallel on CUDA with parallel.compile: inductor overlaps the TP collectives with "
        "the matmuls (symmetric memory). Needs parallel.tensor > 1.",
    )
    pipeline: int = Field(
        1,
        ge=1,
        description=(
            "Pipeline-parallel degree: the layers split into stages over this many groups of workers (the outermost "
            "mesh dimension: a stage's workers are consecutive, so stages may span nodes while tensor and context "
            "groups stay inside one). Data-parallel ranks = workers / (pipeline x tensor x context). torch's "
            "schedule runs the stages (parallel.pipeline_schedule); --dry-run shows each pipeline rank's memory and "
            "the bubble."
        ),
    )
    pipeline_schedule: PipelineScheduleName = Field(
        "1F1B",
        description=(
            "torch.distributed.pipelining schedule (any case): GPipe and 1F1B run one stage per rank; Interleaved1F1B, "
            "LoopedBFS and InterleavedZeroBubble loop over parallel.pipeline_virtual_stages; ZBVZeroBubble and "
            "DualPipeV hold two stages per rank in a V. --dry-run and jobs/bench_pipeline.py print its bubble."
        ),
    )
    pipeline_microbatches: int | None = Field(
        None,
        ge=1,
        description=(
            "Micro-batches (of train.micro_batch_size sequences each) a data-parallel rank's share of the step runs "
            "through the pipeline at once: at least the stages (parallel.pipeline x virtual stages), and "
            "train.global_batch_size a multiple of micro-batch x these x data-parallel ranks. unset = 2 x the stages."
        ),
    )
    pipeline_virtual_stages: int | None = Field(
        None,
        ge=1,
        description=(
            "Stages each pipeline rank holds: 1 for GPipe/1F1B, any for the looped schedules, exactly 2 for "
            "ZBVZeroBubble/DualPipeV. unset = 1 for GPipe/1F1B, else 2."
        ),
    )
    pipeline_split: list[int] | None = Field(
        None,
        description=(
            "Layers of each stage in order (parallel.pipeline x virtual stages counts, each at least 1, summing to "
            "model.n_layers). unset = balanced by the memory plan: each pipeline rank's planned peak with one "
            "micro-batch in flight, the embedding counted on the first stage, the output head and loss on the last."
        ),
    )

    @field_validator("shard", mode="before")
    @classmethod
    def _shard_int_or_auto(cls, value: Any) -> Any:
        # Decide here, so a bad value is reported as parallel.shard rather than per union member.
        if value == "auto":
            return value
        number = value
        if isinstance(value, str):
            try:
                number = int(value)
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise ValueError(f"expected a positive integer or 'auto', got {value!r}")
        return number

    @field_validator("pipeline_schedule", mode="before")
    @classmethod
    def _schedule_any_case(cls, value: Any) -> Any:
        # torch's get_schedule_class takes a name in any case: so does the setting.
        if isinstance(value, str):
            return next((name for name in PIPELINE_SCHEDULES if name.lower() == value.lower()), value)
        return value

    @model_validator(mode="after")
    def _pipeline_settings(self) -> "ParallelConfig":
        if self.pipeline == 1:
            # One given at its default passes: a config printed by --dry-run or saved with a run names every setting.
            fields = type(self).model_fields
            changed = [name for name in _PIPELINE_SETTINGS if getattr(self, name) != fields[name].default]
            if changed:
                name = changed[0]
                raise ValueError(f"parallel.{name}={getattr(self, name)}: a pipeline-parallel setting, and "
                                 f"parallel.pipeline=1; set parallel.pipeline > 1, or drop parallel.{name}")
            return self
        schedule, virtual = self.pipeline_schedule, self.virtual_stages
        kind = PIPELINE_SCHEDULES[schedule]
        if kind.stages_per_rank == "one" and virtual != 1:
            raise ValueError(f"parallel.pipeline_schedule={schedule} runs one stage per rank, and "
                             f"parallel.pipeline_virtual_stages={virtual}; set it to 1, or use a looped schedule "
                             "(Interleaved1F1B, InterleavedZeroBubble)")
        if kind.stages_per_rank == "two" and virtual != 2:
            raise ValueError(f"parallel.pipeline_schedule={schedule} holds exactly 2 stages per rank (a V), and "
                             f"parallel.pipeline_virtual_stages={virtual}; set it to 2, or drop it")
        stages, microbatches = self.pipeline_stages, self.microbatches
        if microbatches < stages:
            raise ValueError(
                f"parallel.pipeline_microbatches={microbatches} is fewer than the {stages} stages (parallel.pipeline="
                f"{self.pipeline} x {virtual} per rank): {schedule} needs every stage busy with one; use at least "
                f"{stages}")
        split = self.pipeline_split
        if split is not None:
            if len(split) != stages:
                raise ValueError(f"parallel.pipeline_split={split}: {len(split)} entries for {stages} stages (parallel."
                                 f"pipeline={self.pipeline} x {virtual} per rank); give one layer count per stage")
            empty = [index for index, layers in enumerate(split) if layers < 1]
            if empty:
                raise ValueError(f"parallel.pipeline_split={split}: stage {empty[0]} gets {split[empty[0]]} layers; "
                                 "every stage needs at least one")
        return self

    @model_validator(mode="after")
    def _float8_recipe_needs_float8(self) -> "ParallelConfig":
        if self.float8_recipe != "tensorwise" and not self.float8:
            raise ValueError(
                f"parallel.float8_recipe={self.float8_recipe} needs parallel.float8=true; set it, or drop "
                "parallel.float8_recipe"
            )
        return self

    @property
    def sharding(self) -> Strategy:
        return STRATEGIES[self.strategy]

    @property
    def group_size(self) -> int:
        """Workers of one tensor- and context-parallel group (within one node, within one pipeline stage)."""
        return self.tensor * self.context

    @property
    def data_rank_workers(self) -> int:
        """Workers that share one data-parallel rank's samples: a tensor x context group in each pipeline stage."""
        return self.pipeline * self.group_size

    @property
    def pipeline_kind(self) -> PipelineSchedule:
        return PIPELINE_SCHEDULES[self.pipeline_schedule]

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank (parallel.pipeline_virtual_stages, or the schedule's default)."""
        if self.pipeline_virtual_stages is not None:
            return self.pipeline_virtual_stages
        return self.pipeline_kind.default_virtual_stages if self.pipeline > 1 else 1

    @property
    def pipeline_stages(self) -> int:
        """Stages the layers split into: parallel.pipeline x virtual stages (1 without pipeline parallel)."""
        return self.pipeline * self.virtual_stages

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline run (parallel.pipeline_microbatches, else 2 x the stages; 1 without PP)."""
        if self.pipeline == 1:
            return 1
        return self.pipeline_microbatches if self.pipeline_microbatches is not None else 2 * self.pipeline_stages

    def check_model(self, model: ModelArgs) -> None:
        """ConfigError when ``parallel.tensor`` does not divide what it splits of ``model``, or the pipeline
        stages cannot split it."""
        self._check_pipeline_model(model)
        tensor = self.tensor
        if tensor == 1:
            return
        for name, value in (("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
                            ("model.ffn_dim", model.ffn_dim), ("the vocabulary (model.vocab_size)", model.vocab_size)):
            if value % tensor:
                raise ConfigError(f"parallel.tensor={tensor} does not divide {name}={value}; choose a degree that "
                                  f"divides {model.n_heads} heads, {model.n_kv_heads} KV heads, FFN {model.ffn_dim} "
                                  f"and vocabulary {model.vocab_size}")


    def _check_pipeline_model(self, model: ModelArgs) -> None:
        if self.pipeline == 1:
            return
        if model.tie_embeddings:
            raise ConfigError(f"parallel.pipeline={self.pipeline} with a tied embedding (model.tie_embeddings, this "
                              "preset's default): the first stage holds the embedding and the last the output head; "
                              "set model.tie_embeddings=false, or parallel.pipeline=1")
        n_layers = model.n_layers
        stages, split = self.pipeline_stages, self.pipeline_split
        if n_layers < stages:
            per_rank = f" ({self.virtual_stages} per rank, {self.pipeline_schedule})" if self.virtual_stages > 1 else ""
            raise ConfigError(f"model.n_layers={n_layers} is fewer than the {stages} pipeline stages{per_rank}: each "
                              f"stage needs a layer; lower parallel.pipeline or parallel.pipeline_virtual_stages")
        if split is not None and sum(split) != n_layers:
            raise ConfigError(f"parallel.pipeline_split={split} holds {sum(split)} layers, and the model has "
                              f"model.n_layers={n_layers}; make the counts sum to {n_layers}, or unset it (balanced)")


class ScalingConfig(Section):
    num_workers: int = Field(2, gt=0, description="Training workers (one per GPU, or per CPU slot).")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL; otherwise CPU workers with gloo.")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves for each worker.")
    workers_per_node: int | None = Field(
        None,
        gt=0,
        description="Expected workers on each node; unset = learn it from Ray. Lets --dry-run show the auto mesh.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy for the worker group (PACK keeps shard groups on one node)."
    )
    accelerator_type: str | None = Field(None, description="Ray accelerator type to require, e.g. H100.")
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        description=(
            "Memory of one GPU in GiB, for the --dry-run fit verdict; unset = known from "
            "scaling.accelerator_type (H100, H200, A100-40G, A100-80G, L4, A10G, ...)."
        ),
    )
    timeout_s: int = Field(1800, gt=0, le=MAX_DURATION_S, description="Collective timeout for the process group, seconds.")
    min_workers: int | None = Field(
        None,
        gt=0,
        description=(
            "Elastic training: the fewest workers to go on with when capacity is lost (unset = scaling.num_workers, "
            "not elastic); the group regrows up to scaling.num_workers when capacity returns."
        ),
    )
    resize_check_interval_s: float = Field(
        60.0,
        gt=0, le=MAX_DURATION_S,
        description="Elastic training: how often Ray checks a running group for capacity to grow it (seconds).",
    )
    grow_save_timeout_s: float = Field(
        600.0,
        ge=0, le=MAX_DURATION_S,
        description="Elastic training: before a resize, the group saves the step it is at and waits; Ray resizes once "
        "every worker has saved, or after this long (seconds).",
    )
    evict_stragglers: bool = Field(
        False,
        description="Replace what the straggler report (metrics.straggler_*) names. fault_tolerance.mode=restart "
        "(elastic): drain the node of a slow rank, so the group saves, restarts without that node and goes on; never "
        "below scaling.min_workers. fault_tolerance.mode=replica: end a replica group slower than the others, which "
        "Ray replaces and which heals from a peer (once per group in a launch; never below "
        "fault_tolerance.min_replicas).",
    )

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def required_workers(self) -> int:
        """The fewest workers a run can start with."""
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def required_setting(self) -> str:
        return "scaling.min_workers" if self.elastic else "scaling.num_workers"


# Folders under run.storage_path beside the runs, shared by all of them (data.cache_dir's and
# metrics.targets_dir's defaults): no run may take one's name.


def check_parallel_groups(
    context: int, tensor: int, workers: int, workers_named: str, per_node: int | None, per_node_named: str,
    pipeline: int = 1,
) -> None:
    """ConfigError unless whole pipeline x tensor x context groups fill the workers and the tensor x context
    groups lie within nodes (the configured counts before launch, the group Ray started at run time)."""
    inner = context * tensor
    if pipeline > 1 and workers % (pipeline * inner):
        whole = pipeline * inner
        raise ConfigError(f"parallel.pipeline x parallel.tensor x parallel.context = {pipeline} x {tensor} x {context} = "
                          f"{whole} does not divide {workers_named}; use a multiple of {whole} workers")
    degrees = f"parallel.tensor x parallel.context = {tensor} x {context} = {inner}"
    if workers % inner:
        raise ConfigError(f"{degrees} does not divide {workers_named}; use a multiple of {inner} workers")
    if per_node is not None and per_node % inner:
        raise ConfigError(f"{degrees} does not divide {per_node_named}: tensor- and context-parallel groups must "
                          "lie within one node; lower the degrees")
