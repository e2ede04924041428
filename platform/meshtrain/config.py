"""The one typed configuration tree for a meshtrain run.

Every user-facing setting lives here as a pydantic field with a description. A run is configured
from (lowest to highest precedence) the defaults below, a YAML file, and dotted ``key=value``
overrides from the command line. Anything wrong raises :class:`ConfigError` with one line that
names the field and what to change.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshtrain.presets import MODEL_PRESETS


# A message that already starts with a dotted field name ("train.steps=..." / "data.source: ...").
_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+\.[a-z_0-9.]+[=:]")


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line naming the field and the fix."""


class _Section(BaseModel):
    # No float setting may be inf or nan: pydantic rejects them on the field's own path ("finite_number").
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    preset: str = Field("debug", description="Model shape preset: " + ", ".join(MODEL_PRESETS) + ".")
    dim: int | None = Field(None, gt=0, description="Hidden size; overrides the preset.")
    n_layers: int | None = Field(None, gt=0, description="Number of transformer blocks; overrides the preset.")
    n_heads: int | None = Field(None, gt=0, description="Attention (query) heads; overrides the preset.")
    n_kv_heads: int | None = Field(
        None, gt=0, description="Key/value heads for grouped-query attention; must divide n_heads."
    )
    ffn_dim: int | None = Field(None, gt=0, description="Hidden size of the SwiGLU feed-forward block.")
    vocab_size: int | None = Field(
        None,
        gt=0,
        description="Embedding rows; unset = the tokenizer's vocabulary rounded up to a multiple of 64.",
    )
    max_seq_len: int | None = Field(None, gt=0, description="Longest sequence the RoPE table covers.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool | None = Field(None, description="Share the input embedding with the output head.")
    init_std: float | None = Field(None, gt=0, description="Std of the normal weight initialization.")
    init_from: str | None = Field(
        None,
        description="Continued pretraining: a local Hugging Face Llama directory (config.json + safetensors, "
        "on storage every worker reads); its weights replace the initialization and its config.json gives "
        "the shape, so leave the shape fields unset.",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {value!r}; choose one of {', '.join(MODEL_PRESETS)}")
        return value

    @field_validator("init_from")
    @classmethod
    def _absolute_init_from(cls, value: str | None) -> str | None:
        # Absolute, because Ray workers may not run in the driver's working directory.
        return None if value is None else str(Path(value).expanduser().absolute())

    @model_validator(mode="after")
    def _shape_of_init_from(self) -> "ModelConfig":
        if self.init_from is None:
            return self
        from meshtrain.hf_weights import CONFIG_KEYS, llama_shape

        for name, value in llama_shape(self.init_from).items():
            explicit = getattr(self, name)
            if explicit is not None and explicit != value:
                raise ValueError(
                    f"model.{name}: {explicit!r} conflicts with {CONFIG_KEYS[name]}={value!r} in "
                    f"model.init_from's config.json; drop model.{name} (the weights fix the shape)"
                )
        return self

    def resolved(self, tokenizer_vocab_size: int | None = None) -> "ModelArgs":
        """Preset values (or model.init_from's config.json shape) with the explicitly set fields over them."""
        values = dict(MODEL_PRESETS[self.preset])
        if self.init_from is not None:
            from meshtrain.hf_weights import llama_shape

            values.update(llama_shape(self.init_from))
        explicit = self.model_dump(exclude={"preset", "init_from"})
        values.update({k: v for k, v in explicit.items() if v is not None})
        if values.get("vocab_size") is None:
            if tokenizer_vocab_size is None:
                raise ConfigError("model.vocab_size: unknown; set it or let the tokenizer define it")
            values["vocab_size"] = _round_up(tokenizer_vocab_size, 64)
        elif tokenizer_vocab_size is not None and tokenizer_vocab_size > values["vocab_size"]:
            if self.init_from is not None:
                raise ConfigError(
                    f"data.tokenizer: its {tokenizer_vocab_size} tokens do not fit the {values['vocab_size']}"
                    f" embedding rows (vocab_size) of model.init_from={self.init_from!r}; "
                    "use the tokenizer the weights were trained with"
                )
            raise ConfigError(
                f"model.vocab_size: {values['vocab_size']} is smaller than the tokenizer's "
                f"{tokenizer_vocab_size} tokens; raise it or leave it unset"
            )
        try:
            return ModelArgs(**values)
        except ValidationError as exc:
            raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


class ModelArgs(BaseModel):
    """A fully resolved model shape (what the model code consumes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    init_std: float

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelArgs":
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"model.dim={self.dim}: the head size model.dim / model.n_heads={self.n_heads} is "
                f"{self.dim // self.n_heads}, which must be even for rotary embeddings; "
                "change model.dim or model.n_heads"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_SOURCE_HELP = (
    "'stdlib' (the Python standard library's source files, always offline), a local file, directory or "
    "glob of .txt/.jsonl/.json/.parquet files, 'hf:<dataset>' streamed from the Hub, or a prepared token "
    "store (a folder or s3:// URL with a manifest.json)."
)


class SourceConfig(_Section):
    """One source of documents (or a prepared token store) and its share of a mixture."""

    source: str = Field("stdlib", description=_SOURCE_HELP)
    weight: float = Field(1.0, description="Share of training samples drawn from this source (mixtures).")
    text_field: str = Field("text", description="Column holding the document text (jsonl/parquet/hub).")
    hf_config: str | None = Field(None, description="Hub dataset configuration name (hf: sources).")
    split: str = Field("train", description="Dataset split to read (hf: sources).")
    max_documents: int | None = Field(None, gt=0, description="Read at most this many documents.")

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"a mixture weight must be a positive finite number, got {value!r}; give e.g. 0.3")
        return value

    def is_hub(self) -> bool:
        return self.source.startswith("hf:")


class ValidationConfig(_Section):
    fraction: float = Field(
        0.01,
        ge=0,
        lt=0.5,
        description="Share of each source's windows held out of training for validation (0 = none; "
        "0 when validation.source is set).",
    )
    source: str | None = Field(
        None, description="A separate validation source (same forms as data.source); all of it is held out."
    )
    text_field: str = Field("text", description="Text column of validation.source.")

    @model_validator(mode="before")
    @classmethod
    def _no_default_fraction_beside_a_source(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("source") is not None and "fraction" not in values:
            return {**values, "fraction": 0.0}
        return values

    @model_validator(mode="after")
    def _one_kind(self) -> "ValidationConfig":
        if self.source is not None and self.fraction > 0:
            raise ValueError(
                "data.validation: set either validation.fraction or validation.source, not both"
            )
        return self


class DataConfig(_Section):
    source: str = Field("stdlib", description=_SOURCE_HELP)
    text_field: str = Field("text", description="Column holding the document text (jsonl/parquet/hub).")
    hf_config: str | None = Field(None, description="Hub dataset configuration name (hf: sources).")
    split: str = Field("train", description="Dataset split to read.")
    max_documents: int | None = Field(None, gt=0, description="Read at most this many documents.")
    sources: list[SourceConfig] | None = Field(
        None,
        description="A mixture: a list of {source, weight, text_field, ...}; samples are drawn in proportion "
        "to the weights. Replaces data.source.",
    )
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Held-out validation data.")
    tokenizer: str = Field(
        "train",
        description="'train' = fit a byte-level BPE on a sample of the data (saved with the run), or a tokenizer.json path.",
    )
    vocab_size: int = Field(2048, ge=260, description="Vocabulary size when the tokenizer is trained.")
    tokenizer_sample_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="Text the tokenizer is trained on: at most this many bytes, taken evenly across the data.",
    )
    seq_len: int = Field(128, gt=1, description="Tokens per training sequence (packed, no padding).")
    cache_dir: str | None = Field(
        None,
        description="Where prepared token stores are cached by source+tokenizer fingerprint (local or s3://); "
        "unset = <run.storage_path>/token_stores.",
    )
    prepare_unit_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="Most source bytes per prepare task and token shard; a small corpus is cut finer (into about 64 "
        "units, none under 1 MiB) and .jsonl files larger than a unit are split at line boundaries (ranges of 1 MiB or more).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for s3:// stores and cache, e.g. {client_kwargs: {endpoint_url: ...}}."
    )
    allow_fingerprint_change: bool = Field(
        False,
        description="Resume checkpoints trained on other token data (deliberately changing the corpus).",
    )

    @model_validator(mode="after")
    def _sources_and_paths(self) -> "DataConfig":
        if self.sources is not None:
            if not self.sources:
                raise ValueError("data.sources: an empty list; give at least one {source, weight} or use data.source")
            if "source" in self.model_fields_set:
                raise ValueError("data.sources: set either data.source or data.sources (a mixture), not both")
        for index, item in enumerate(self.source_list()):
            where = "data.source" if self.sources is None else f"data.sources.{index}.source"
            _check_source_exists(item.source, where, self.storage_options)
        if self.validation.source is not None:
            _check_source_exists(self.validation.source, "data.validation.source", self.storage_options)
        if self.tokenizer != "train" and not Path(self.tokenizer).expanduser().is_file():
            raise ValueError(
                f"data.tokenizer: {self.tokenizer!r} is not a file; give a tokenizer.json path or 'train'"
            )
        if self.cache_dir is not None:
            _check_tested_scheme(self.cache_dir, "data.cache_dir")
        return self

    def source_list(self) -> list[SourceConfig]:
        """The mixture's sources, or the single data.source as a one-source list."""
        if self.sources is not None:
            return list(self.sources)
        return [
            SourceConfig(
                source=self.source, text_field=self.text_field, hf_config=self.hf_config,
                split=self.split, max_documents=self.max_documents,
            )
        ]

    def validation_source(self) -> SourceConfig | None:
        if self.validation.source is None:
            return None
        return SourceConfig(source=self.validation.source, text_field=self.validation.text_field)


def _check_source_exists(source: str, where: str, storage_options: dict[str, Any]) -> None:
    if source == "stdlib" or source.startswith("hf:") or "://" in source:
        return
    from meshtrain.data.sources import expand_local_source
    from meshtrain.data.store import is_token_store

    if not is_token_store(source, storage_options) and not expand_local_source(source):
        raise ValueError(
            f"{where}: no files at {source!r}; give an existing file, directory or glob, a token store, "
            "'stdlib', or 'hf:<dataset>'"
        )


def _check_tested_scheme(url: str, where: str, opt_in: str | None = None) -> None:
    """Refuse a URL whose scheme meshtrain is not tested with (local paths, file:// and s3:// are)."""
    from fsspec.core import split_protocol

    scheme = split_protocol(url)[0]
    if scheme not in (None, "file", "s3"):
        fix = "use one of those" + (f" or set {opt_in}=true" if opt_in else "")
        raise ValueError(
            f"{where}: scheme {scheme!r} is not tested with meshtrain (local paths and s3:// are); {fix}"
        )


class OptimConfig(_Section):
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (after warmup).")
    schedule: Literal["cosine", "linear", "wsd", "constant"] = Field(
        "cosine",
        description="LR after warmup: cosine or linear decay to min_lr_ratio x lr by the end of the "
        "schedule; wsd = stable at lr, then linear decay to min_lr_ratio x lr over the last "
        "optim.decay_fraction of the schedule; constant = lr throughout.",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final LR of the cosine, linear and wsd decays, as a fraction of lr."
    )
    warmup_steps: int = Field(20, ge=0, description="Steps of linear warmup from 0 to lr.")
    decay_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="wsd only (and required there): share of the schedule's steps spent decaying, e.g. 0.2 "
        "(rounded to whole steps, at least one).",
    )
    schedule_steps: int | None = Field(
        None,
        gt=0,
        description="Steps the LR schedule spans; unset = train.steps of the run's first launch. "
        "Later steps keep the final LR.",
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (matrices only).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient L2 norm to this (0 = off).")
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="AdamW kernel; auto = fused on CUDA and CPU, foreach elsewhere."
    )

    @model_validator(mode="after")
    def _decay_fraction_only_for_wsd(self) -> "OptimConfig":
        if self.schedule == "wsd" and self.decay_fraction is None:
            raise ValueError(
                "optim.decay_fraction: the wsd schedule needs it; "
                "set the share of steps to decay over, e.g. 0.2"
            )
        if self.schedule != "wsd" and self.decay_fraction is not None:
            raise ValueError(
                f"optim.decay_fraction: only the wsd schedule uses it, not {self.schedule}; "
                "set optim.schedule=wsd or leave optim.decay_fraction unset"
            )
        return self

    def wsd_decay_steps(self, horizon: int) -> int:
        """Steps at the end of a ``horizon``-step wsd schedule that decay the LR (at least one)."""
        assert self.decay_fraction is not None, "only the wsd schedule decays over a fraction"
        return max(1, round(self.decay_fraction * horizon))

    def check_horizon(self, horizon: int) -> None:
        """ConfigError unless the warmup (and a wsd decay) fit in a schedule of ``horizon`` steps."""
        span = f"the LR schedule's {horizon} steps (optim.schedule_steps, unset = train.steps)"
        if self.schedule == "wsd":
            decay = self.wsd_decay_steps(horizon)
            if self.warmup_steps + decay > horizon:
                raise ConfigError(
                    f"optim.warmup_steps={self.warmup_steps} plus the wsd decay of {decay} steps "
                    f"(optim.decay_fraction={self.decay_fraction}) exceed {span}; "
                    "lower optim.warmup_steps or optim.decay_fraction, or lengthen the schedule"
                )
        elif self.warmup_steps >= horizon:
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps} does not fit in {span}; "
                "lower optim.warmup_steps or lengthen the schedule"
            )


class TrainConfig(_Section):
    steps: int = Field(200, gt=0, description="Optimizer steps to run.")
    global_batch_size: int = Field(16, gt=0, description="Sequences per optimizer step, over all workers.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward on one worker; the rest is accumulation."
    )
    seed: int = Field(0, description="Seeds weight init and the data order.")
    log_every: int = Field(5, gt=0, description="Write metrics and the progress line every N steps.")
    max_bad_steps: int = Field(
        5,
        gt=0,
        description="Stop the run after this many skipped steps in a row (a step is skipped when its loss or "
        "gradient norm is not finite, or it spikes); checked at logged and checkpoint steps.",
    )
    loss_spike_factor: float | None = Field(
        None,
        gt=1,
        description="Also skip a step whose loss exceeds this many times the median of the last "
        "train.loss_spike_window accepted losses; unset = no spike rule.",
    )
    loss_spike_window: int = Field(50, ge=3, description="Accepted steps the loss-spike median is taken over.")
    gc_every: int = Field(
        50,
        ge=0,
        description="Python's automatic garbage collection is off during training; every rank collects at the same "
        "steps, every N (0 = leave automatic collection on).",
    )


class EvalConfig(_Section):
    interval: int | None = Field(
        50,
        gt=0,
        description="Compute the validation loss every N steps and after the last step; null = never.",
    )
    batches: int = Field(
        4,
        gt=0,
        description="Size of the validation set in global batches (train.global_batch_size sequences each); "
        "the same sequences every time, capped at what data.validation holds.",
    )


StrategyName = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


class ParallelConfig(_Section):
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
    prefetch: int = Field(
        1, ge=1, le=8, description="Blocks whose all-gather is issued ahead in forward and backward (1 = FSDP2's default)."
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


class ScalingConfig(_Section):
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
    timeout_s: int = Field(1800, gt=0, description="Collective timeout for the process group, seconds.")
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
        gt=0,
        description="Elastic training: how often Ray checks a running group for capacity to grow it (seconds).",
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


class RunConfig(_Section):
    name: str | None = Field(
        None, description="Run name (a folder under storage_path); unset = '<preset>-<timestamp>'."
    )
    storage_path: str = Field(
        "runs", description="Directory (shared by all nodes on a cluster) where runs are written."
    )
    max_failures: int = Field(
        3, ge=-1, description="Worker-group restarts Ray Train may do; each resumes from the newest checkpoint (-1 = unlimited)."
    )
    hang_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="After the first step, a worker with no progress for this long (a hung collective, a stuck "
        "rank) exits so Ray restarts the group from the last checkpoint; must exceed the slowest checkpoint save "
        "and evaluation; null = off.",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or "/" in value or value in {".", ".."}):
            raise ValueError(f"must be a plain folder name (no '/', not '.' or '..'), got {value!r}")
        return value


class CheckpointConfig(_Section):
    enabled: bool = Field(True, description="Save checkpoints and resume from the newest committed one.")
    interval: int = Field(50, gt=0, description="Save every N steps (and always after the last step).")
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are deleted.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the loop waits only while state is staged to host memory; sync: until written."
    )
    path: str | None = Field(
        None,
        description="Root for checkpoints: a local/NFS path or s3://bucket/prefix (run.name is appended); "
        "unset = checkpoints/ in the run directory.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for a remote path, e.g. {client_kwargs: {endpoint_url: ...}} for S3-compatible stores.",
    )
    resume: bool = Field(True, description="Continue from the newest committed checkpoint when one exists.")
    allow_untested_scheme: bool = Field(
        False,
        description="Accept a checkpoint.path scheme other than a local path or s3:// (untested with meshtrain).",
    )

    @model_validator(mode="after")
    def _tested_path_scheme(self) -> "CheckpointConfig":
        if self.path is not None and not self.allow_untested_scheme:
            _check_tested_scheme(self.path, "checkpoint.path", opt_in="checkpoint.allow_untested_scheme")
        return self


class FaultConfig(_Section):
    kill_rank: int | None = Field(
        None, ge=0, description="Chaos testing: this worker fails once, at fault.at_step (how: fault.kind)."
    )
    at_step: int | None = Field(None, gt=0, description="Step at which fault.kill_rank fails.")
    kind: Literal["kill", "hang", "nan"] = Field(
        "kill",
        description=(
            "kill: the worker sends itself SIGKILL; hang: it stops making progress (sleeps forever); nan: its "
            "logits are NaN from fault.at_step on, so the global loss and gradients are (the step guard's case)."
        ),
    )
    during_checkpoint: bool = Field(
        False, description="Die right after the checkpoint of fault.at_step starts writing (it must be a save step)."
    )


class MetricsConfig(_Section):
    port: int = Field(
        9800,
        ge=0,
        le=65535,
        description="Base port of each worker's Prometheus /metrics endpoint (port + local rank); 0 disables it.",
    )
    bind_address: str = Field(
        "0.0.0.0", description="Address the /metrics endpoints listen on (127.0.0.1 keeps them on the machine)."
    )
    targets_dir: str | None = Field(
        None,
        description="Folder of Prometheus file_sd target files (<run.name>.json); unset = <run.storage_path>/prometheus.",
    )
    peak_flops_per_s: float | None = Field(
        None,
        gt=0,
        description="Peak FLOP/s of one device for MFU; unset = looked up from the GPU model (CPU: cpu_peak_flops_per_s).",
    )
    cpu_peak_flops_per_s: float = Field(
        1e11, gt=0, description="Peak FLOP/s of one CPU worker, used for MFU when training on CPU."
    )
    final_scrape_timeout_s: float = Field(
        10.0,
        ge=0,
        description="After the last step, wait up to this long for a scrape of the final values (only if scraped lately).",
    )
    progress_interval_s: float = Field(
        30.0,
        ge=0,
        description="Driver progress line at most this often when output is not a terminal (0 = every logged step).",
    )
    ray_report_interval_s: float = Field(
        10.0,
        ge=0,
        description="Hand the logged metrics to ray.train.report (Ray's dashboard, Result.metrics, Ray's "
        "MLflow/W&B callbacks) at most this often, and after the last step (0 = every logged step; each report "
        "may wait up to 2 s for Ray's controller).",
    )
    ray_callbacks: list[str] = Field(
        default_factory=list,
        description="Ray Train callbacks (ray.train.UserCallback subclasses) as 'module:Class', built with no "
        "arguments on Ray's controller, where each receives every report, e.g. an MLflow or W&B logger.",
    )
    tensorboard: bool = Field(False, description="Also write TensorBoard event files to <run dir>/tensorboard.")

    @field_validator("ray_callbacks")
    @classmethod
    def _import_paths(cls, value: list[str]) -> list[str]:
        for spec in value:
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
                raise ValueError(f"expected 'module:Class' entries, e.g. 'mypackage.logging:WandbCallback', got {spec!r}")
        return value

    @field_validator("bind_address")
    @classmethod
    def _address(cls, value: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {value!r}") from None
        return value


class MeshtrainConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer and packing.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and LR schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Steps, batch sizes, seed, logging, step guard.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation loss on held-out data.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="FSDP2 / HSDP layout.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="Ray worker group.")
    run: RunConfig = Field(default_factory=RunConfig, description="Where and under which name outputs go.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Sharded checkpoints and resume.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics and progress output.")
    fault: FaultConfig = Field(default_factory=FaultConfig, description="Fault injection for tests and demos.")

    @model_validator(mode="after")
    def _cross_checks(self) -> "MeshtrainConfig":
        # Shape checks only: a tokenizer file's vocabulary is known once it is loaded; a trained
        # tokenizer has at most data.vocab_size tokens, so model.vocab_size must hold that many.
        if self.model.init_from is not None:
            if self.data.tokenizer == "train":
                # Continued pretraining keeps the tokenizer the weights were trained with.
                from meshtrain.hf_weights import init_from_tokenizer

                self.data.tokenizer = init_from_tokenizer(self.model.init_from)
            tokenizer_vocab = None
        elif self.data.tokenizer == "train":
            tokenizer_vocab = self.data.vocab_size
        else:
            tokenizer_vocab = self.model.vocab_size or self.data.vocab_size
        model = self.model.resolved(tokenizer_vocab)
        if self.data.seq_len > model.max_seq_len:
            fix = "" if self.model.init_from is not None else " or raise model.max_seq_len"
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                f"lower data.seq_len{fix}"
            )
        from meshtrain.mesh import resolve_mesh_shape

        if self.parallel.shard != "auto" or self.scaling.workers_per_node is not None:
            resolve_mesh_shape(
                self.scaling.num_workers,
                self.scaling.workers_per_node or self.scaling.num_workers,
                self.parallel.strategy,
                self.parallel.shard,
            )
        # Every worker is a data-parallel rank whatever the mesh, so this holds before Ray is asked.
        self.batch_layout(self.scaling.num_workers)
        self.elastic_sizes()
        # A re-run may resolve another horizon (the launcher keeps the first launch's); it checks again.
        self.optim.check_horizon(self.optim.schedule_steps or self.train.steps)
        if self.eval.interval is not None and self.data.validation.fraction == 0 and self.data.validation.source is None:
            raise ValueError(
                f"eval.interval={self.eval.interval} needs validation data; set data.validation.fraction (e.g. 0.01) "
                "or data.validation.source, or eval.interval=null to turn validation off"
            )
        fault = self.fault
        if (fault.kill_rank is None) != (fault.at_step is None):
            raise ValueError("fault.kill_rank and fault.at_step go together; set both or neither")
        if fault.kill_rank is not None and fault.kill_rank >= self.scaling.num_workers:
            raise ValueError(
                f"fault.kill_rank={fault.kill_rank} is not a worker rank; use 0..{self.scaling.num_workers - 1}"
            )
        if fault.during_checkpoint and fault.at_step is not None:
            if not self.checkpoint.enabled or (
                fault.at_step % self.checkpoint.interval and fault.at_step != self.train.steps
            ):
                raise ValueError(
                    f"fault.at_step={fault.at_step} is not a checkpoint step; with fault.during_checkpoint "
                    f"use a multiple of checkpoint.interval={self.checkpoint.interval}"
                )
        return self

    def elastic_sizes(self) -> list[int]:
        """The worker-group sizes a run may train on, smallest first: ``scaling.num_workers`` alone, or
        with ``scaling.min_workers`` every size down to it that is a whole number of shard groups (of
        ``parallel.shard``, or of ``scaling.workers_per_node`` with shard=auto) and divides the global
        batch. ValueError when an elastic setting cannot shrink."""
        scaling = self.scaling
        if scaling.min_workers is None or scaling.min_workers == scaling.num_workers:
            return [scaling.num_workers]
        if scaling.min_workers > scaling.num_workers:
            raise ValueError(
                f"scaling.min_workers={scaling.min_workers} exceeds scaling.num_workers={scaling.num_workers}; "
                "set it to at most scaling.num_workers (or unset it: not elastic)"
            )
        shard = self.parallel.shard
        if self.parallel.strategy in ("full_shard", "shard_grad_op", "no_shard"):
            unit = 1  # the shard group is every worker (or one): any size holds it
        elif shard != "auto":
            if shard > scaling.min_workers:
                raise ValueError(
                    f"parallel.shard={shard} does not fit scaling.min_workers={scaling.min_workers}: a smaller group "
                    f"could not hold one shard group; raise scaling.min_workers to {shard} or use parallel.shard=auto"
                )
            unit = shard
        else:
            unit = scaling.workers_per_node or 1  # learned from Ray when unset: checked when the group starts
        step_samples = self.train.micro_batch_size
        sizes = [
            size
            for size in range(scaling.min_workers, scaling.num_workers + 1)
            if size % unit == 0 and self.train.global_batch_size % (size * step_samples) == 0
        ]
        if sizes == [scaling.num_workers]:
            raise ValueError(
                f"scaling.min_workers={scaling.min_workers}: no smaller group than scaling.num_workers="
                f"{scaling.num_workers} is a whole number of shard groups of {unit} whose micro-batches "
                f"(train.micro_batch_size={step_samples}) divide train.global_batch_size={self.train.global_batch_size}; "
                "raise train.global_batch_size to a multiple of more sizes or lower scaling.min_workers"
            )
        return sizes

    def batch_layout(self, data_parallel_size: int) -> tuple[int, int]:
        """(micro-batch size, accumulation steps) for a data-parallel degree, or ConfigError."""
        micro, total = self.train.micro_batch_size, self.train.global_batch_size
        per_step = micro * data_parallel_size
        if total % per_step:
            raise ConfigError(
                f"train.global_batch_size={total} is not a multiple of train.micro_batch_size "
                f"({micro}) x data-parallel workers ({data_parallel_size}); make it a multiple of {per_step}"
            )
        return micro, total // per_step

    def model_args(self, tokenizer_vocab_size: int) -> ModelArgs:
        return self.model.resolved(tokenizer_vocab_size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {item!r}: empty key segment; expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (bool, int, float)) and _is_text_setting(path):
        value = raw.strip()  # run.name=2024 or data.hf_config=20220301 stay the text typed
    return path, value


def _is_text_setting(path: list[str]) -> bool:
    """Whether ``path`` names a free-text (``str`` or ``str | None``) setting."""
    model: type[BaseModel] = MeshtrainConfig
    for part in path[:-1]:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    field = model.model_fields.get(path[-1])
    if field is None:
        return False
    annotation = field.annotation
    return annotation is str or (
        get_origin(annotation) in (Union, UnionType) and set(get_args(annotation)) == {str, type(None)}
    )


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def _format_validation_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section = ".".join(str(part) for part in first["loc"][:-1])
        known = _field_names(section)
        return f"{location}: unknown setting; {section or 'top level'} accepts {', '.join(known)}"
    if _NAMES_ITS_FIELD.match(message):
        return message
    value = first.get("input")
    # Our own validators (value_error) already quote the value they reject.
    quoted = first["type"] == "value_error"
    if quoted:
        shown = ""
    elif isinstance(value, dict):
        shown = " (got a mapping of sub-keys, not a single value)"
    elif value is None:
        shown = " (got an empty value)"
    else:
        shown = f" (got {value!r})"
    return f"{location}: {message}{shown}" if location else message


def _field_names(section: str) -> list[str]:
    model: type[BaseModel] = MeshtrainConfig
    for part in filter(None, section.split(".")):
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> MeshtrainConfig:
    """Defaults, then the YAML file, then ``dotted.key=value`` overrides; one-line errors."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config: {str(path)!r} is not a file; give a YAML config path")
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"--config: {path} is not valid YAML{where}; fix the syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections (model:, train:, ...)")
        tree = loaded or {}
    for item in overrides or []:
        key_path, value = _parse_override(item)
        _set_dotted(tree, key_path, value)
    try:
        return MeshtrainConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def describe_fields(model: type[BaseModel] = MeshtrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every setting, for --help output."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_fields(annotation, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", repr(field.default), field.description or ""))
    return rows
