"""How a run spreads over devices: FSDP2/HSDP, tensor and context parallel, float8, compile and recompute
(``parallel``), and the Ray worker group (``scaling``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshtrain.config.errors import ConfigError
from meshtrain.config.model import ModelArgs
from meshtrain.config.section import MAX_DURATION_S, Section


StrategyName = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


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
        """Workers that share one data-parallel rank: a tensor- and context-parallel group."""
        return self.tensor * self.context

    def check_model(self, model: ModelArgs) -> None:
        """ConfigError when ``parallel.tensor`` does not divide what it splits of ``model``."""
        tensor = self.tensor
        if tensor == 1:
            return
        for name, value in (("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
                            ("model.ffn_dim", model.ffn_dim), ("the vocabulary (model.vocab_size)", model.vocab_size)):
            if value % tensor:
                raise ConfigError(f"parallel.tensor={tensor} does not divide {name}={value}; choose a degree that "
                                  f"divides {model.n_heads} heads, {model.n_kv_heads} KV heads, FFN {model.ffn_dim} "
                                  f"and vocabulary {model.vocab_size}")


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
        description="Elastic training (fault_tolerance.mode=restart): drain the node of a rank reported as a straggler "
        "(metrics.straggler_*), so the group saves, restarts without that node and goes on; never below "
        "scaling.min_workers.",
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
    context: int, tensor: int, workers: int, workers_named: str, per_node: int | None, per_node_named: str
) -> None:
    """ConfigError unless whole tensor x context groups fill the workers and lie within nodes (the
    configured counts before launch, the group Ray started at run time)."""
    inner = context * tensor
    degrees = f"parallel.tensor x parallel.context = {tensor} x {context} = {inner}"
    if workers % inner:
        raise ConfigError(f"{degrees} does not divide {workers_named}; use a multiple of {inner} workers")
    if per_node is not None and per_node % inner:
        raise ConfigError(f"{degrees} does not divide {per_node_named}: tensor- and context-parallel groups must "
                          "lie within one node; lower the degrees")
