"""The one typed configuration tree of a meshtrain run: every section and the checks between them.

Pure: it reads no file, store or cluster (``meshtrain.cluster.preflight`` checks those), so it can
be built, printed and validated anywhere, a notebook included.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshtrain.config.data import DataConfig
from meshtrain.config.errors import ConfigError
from meshtrain.config.model import ModelArgs, ModelConfig
from meshtrain.config.redaction import OptionalLocation, StorageOptions, redact_url
from meshtrain.config.section import Section, check_tested_scheme


class OptimConfig(Section):
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


class TrainConfig(Section):
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
        "gradient norm is not finite, or it spikes); the longest streak is kept on the device and read at logged "
        "and checkpoint steps, so a streak that ended in between still stops the run.",
    )
    loss_spike_factor: float | None = Field(
        None,
        gt=1,
        description="Also skip a step whose loss exceeds this many times the median of the last "
        "train.loss_spike_window accepted losses; unset = no spike rule.",
    )
    loss_spike_window: int = Field(50, ge=3, description="Accepted steps the loss-spike median is taken over.")
    tf32: bool | None = Field(
        None,
        description="fp32 matrix multiplies on CUDA in TF32 (torch.set_float32_matmul_precision('high')); "
        "unset = on for CUDA workers computing in fp32. MFU divides by the TF32 peak when on, the fp32 peak when off.",
    )
    gc_every: int = Field(
        50,
        ge=0,
        description="Python's automatic garbage collection is off during training; every rank collects at the same "
        "steps, every N (0 = leave automatic collection on).",
    )


class DownstreamEvalConfig(Section):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks to score committed checkpoints on while training goes on (harness "
        "task names, or task YAML names in include_path); empty = no downstream evaluation. pip install -e '.[eval]'.",
    )
    include_path: str | None = Field(
        None, description="A folder of lm-eval task YAMLs for local data (relative data_files resolve there)."
    )
    every: int = Field(
        1, gt=0, description="Score every N-th periodic checkpoint (steps that are multiples of N x "
        "checkpoint.interval), and the last step's; eval.samples follow the same checkpoints."
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt; null = each task's own.")
    limit: int | None = Field(None, gt=0, description="At most this many examples per task; null = all.")
    batch_size: int = Field(8, gt=0, description="Sequences per forward in the harness.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each evaluation task.")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs Ray reserves for each evaluation task; null = 1 with scaling.use_gpu, else 0."
    )
    memory_gb: float | None = Field(
        None, gt=0, description="Memory Ray reserves for each evaluation task (GiB); it must hold the model's fp32 "
        "weights (bf16 on a GPU) and the harness's batches. null = no reservation."
    )
    final_wait_s: float = Field(
        1800.0, ge=0, description="After training, how long the job waits for evaluations still running "
        "(the last checkpoint's); those not done by then keep running and write their results later."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)


class TextSamplesConfig(Section):
    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts whose continuations each scored checkpoint writes (downstream/step-N/text_samples.jsonl, "
        "the trackers, the job log): the quickest human check that training works; empty = none.",
    )
    max_new_tokens: int = Field(64, gt=0, description="New tokens per continuation (it stops earlier at end of document).")
    temperature: float = Field(0.0, ge=0, description="0 = greedy; above 0 samples at this temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (with temperature > 0).")
    seed: int = Field(0, description="Seed of the sampling, so a checkpoint's samples can be drawn again.")


class EvalConfig(Section):
    samples: TextSamplesConfig = Field(
        default_factory=TextSamplesConfig, description="Text continuations of fixed prompts at each scored checkpoint."
    )
    downstream: DownstreamEvalConfig = Field(
        default_factory=DownstreamEvalConfig, description="Downstream tasks (lm-evaluation-harness) on checkpoints."
    )
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
    grow_save_timeout_s: float = Field(
        600.0,
        ge=0,
        description="Elastic training: before growing, the group saves the step it is at and waits; Ray resizes once "
        "that checkpoint is committed, or after this long (seconds).",
    )
    evict_stragglers: bool = Field(
        False,
        description="Elastic training: drain the node of a rank reported as a straggler (metrics.straggler_*), so the "
        "group saves, restarts without that node and goes on; never below scaling.min_workers.",
    )

    @model_validator(mode="after")
    def _eviction_needs_elasticity(self) -> "ScalingConfig":
        if self.evict_stragglers and not self.elastic:
            raise ValueError(
                "scaling.evict_stragglers=true needs an elastic run to go on without the node: set scaling.min_workers "
                "below scaling.num_workers"
            )
        return self

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
SHARED_FOLDERS = ("token_stores", "prometheus")


MAX_RUN_NAME = 128  # leaves room under a file system's 255-byte names for what meshtrain adds to it


class RunConfig(Section):
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
        "rank) exits so Ray restarts the group from the last checkpoint; bytes reaching checkpoint storage count as "
        "progress, so a long save that keeps writing is never cut; must exceed the slowest step and evaluation; null = off.",
    )
    preemption_save_s: float | None = Field(
        25.0,
        gt=0,
        description="On a preemption notice (SIGTERM, or Ray's drain notice) every worker stops at the next step, "
        "saves it and exits so Ray restarts the group; this is how long after the notice a worker may take to commit "
        "that save before it exits anyway. Fit it inside the notice period: GCP spot and Kubernetes' default grace 30 s, "
        "AWS spot 120 s. null = no handling (SIGTERM ends the worker at once).",
    )
    flight_recorder_entries: int = Field(
        2000,
        ge=0,
        description="Recent collectives each worker's torch flight recorder keeps (TORCH_FR_BUFFER_SIZE; gloo and "
        "NCCL groups alike); when the hang watchdog fires, every rank writes them to <run dir>/hangs/rank<R>.json "
        "and one line names the collective that never completed and the ranks that never entered it; 0 = off.",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or "/" in value or value in {".", ".."}):
            raise ValueError(f"must be a plain folder name (no '/', not '.' or '..'), got {value!r}")
        if value is not None and len(value) > MAX_RUN_NAME:
            raise ValueError(f"is {len(value)} characters; use at most {MAX_RUN_NAME} (files of the run, its Prometheus "
                             "targets and Ray's records all carry it in their names)")
        if value is not None and not value.isprintable():
            raise ValueError(f"holds a control character ({value[:40]!r}); use letters, digits and punctuation")
        if value in SHARED_FOLDERS:
            raise ValueError(
                f"{value!r} is a folder every run under run.storage_path shares ({', '.join(SHARED_FOLDERS)}); "
                "choose another run.name"
            )
        return value

    @field_validator("storage_path")
    @classmethod
    def _directory(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(
                f"must be a directory (on a cluster, one every node mounts), not a URL, got {redact_url(value)!r}; "
                "put s3:// storage in checkpoint.path and data.cache_dir"
            )
        return value


class CheckpointConfig(Section):
    enabled: bool = Field(True, description="Save checkpoints and resume from the newest committed one.")
    interval: int = Field(50, gt=0, description="Save every N steps (and always after the last step).")
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are deleted.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the loop waits only while state is staged to host memory; sync: until written."
    )
    path: OptionalLocation = Field(
        None,
        description="Root for checkpoints: a local/NFS path or s3://bucket/prefix (run.name is appended); "
        "unset = checkpoints/ in the run directory.",
    )
    storage_options: StorageOptions = Field(
        default_factory=dict,
        description="fsspec options for a remote path, e.g. {client_kwargs: {endpoint_url: ...}} for S3-compatible "
        "stores; shown redacted wherever meshtrain writes or prints the config.",
    )
    resume: bool = Field(True, description="Continue from the newest committed checkpoint when one exists.")
    allow_untested_scheme: bool = Field(
        False,
        description="Accept a checkpoint.path scheme other than a local path or s3:// (untested with meshtrain).",
    )

    @model_validator(mode="after")
    def _tested_path_scheme(self) -> "CheckpointConfig":
        if self.path is not None and not self.allow_untested_scheme:
            check_tested_scheme(self.path, "checkpoint.path", opt_in="checkpoint.allow_untested_scheme")
        return self


class FaultConfig(Section):
    """Fault injection for tests and demonstrations: nothing here belongs in a production config."""

    kill_rank: int | None = Field(
        None, ge=0, description="Chaos testing: this worker fails once, at fault.at_step (how: fault.kind)."
    )
    at_step: int | None = Field(None, gt=0, description="Step at which fault.kill_rank fails.")
    kind: Literal["kill", "hang", "nan", "slow"] = Field(
        "kill",
        description=(
            "kill: the worker sends itself SIGKILL; hang: it stops making progress (sleeps forever); nan: its "
            "logits are NaN from fault.at_step on, so the global loss and gradients are (the step guard's case); "
            "slow: its transformer blocks take fault.slow_factor times as long from fault.at_step on (a straggler)."
        ),
    )
    slow_factor: float = Field(3.0, gt=1, description="fault.kind=slow: how many times slower the worker computes.")
    node: str | None = Field(
        None, description="fault.kind=slow: slow every worker on the node with this address (Ray: its IP) instead of fault.kill_rank."
    )
    during_checkpoint: bool = Field(
        False, description="Die right after the checkpoint of fault.at_step starts writing (it must be a save step)."
    )
    downstream_fail_step: int | None = Field(
        None, gt=0, description="Chaos testing: the downstream evaluation of this step's checkpoint fails in its Ray "
        "task, as a crashed evaluation would (one line in the job log, a downstream_eval_failed record; training and "
        "the next evaluations go on)."
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, values: Any) -> Any:
        if isinstance(values, dict) and "preemption_save_s" in values:
            raise ValueError("fault.preemption_save_s is now run.preemption_save_s (the fault section is for tests); "
                             "move the setting")
        return values


class MetricsConfig(Section):
    straggler_factor: float = Field(
        1.5,
        gt=1,
        description="Straggler threshold: a rank's transformer-block compute per step over the median of the other "
        "ranks'; a rank at or above it for metrics.straggler_patience logged steps in a row is reported.",
    )
    straggler_patience: int = Field(
        5, ge=1, description="Logged steps in a row a rank must stay at or above metrics.straggler_factor to be reported "
        "as a straggler (metrics.jsonl, the job log, meshtrain_straggler)."
    )
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
    wandb: bool = Field(
        False,
        description="Log to Weights & Biases from rank 0 (pip install -e '.[wandb]'); one W&B run per meshtrain run, "
        "continued across restarts. WANDB_MODE=offline writes it under <run dir>/wandb for `wandb sync`.",
    )
    wandb_project: str = Field("meshtrain", min_length=1, description="W&B project of the run.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); unset = the API key's default.")
    wandb_tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    mlflow: bool = Field(
        False,
        description="Log to MLflow from rank 0 (pip install -e '.[mlflow]'); one MLflow run per meshtrain run, "
        "continued across restarts.",
    )
    mlflow_tracking_uri: OptionalLocation = Field(
        None, description="MLflow tracking URI (http(s)://server, sqlite:///file.db); unset = sqlite:///<run dir>/mlflow.db."
    )
    mlflow_experiment: str = Field("meshtrain", min_length=1, description="MLflow experiment of the run.")

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
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {value!r}") from None
        return value


class ProfileConfig(Section):
    start_step: int | None = Field(
        None,
        gt=0,
        description="First training step that torch.profiler traces (the step before it warms the profiler up); "
        "null = no profiling. Each rank writes <run dir>/profile/rank<R>.<step>.pt.trace.json (Perfetto, "
        "chrome://tracing, TensorBoard's profiler plugin) and one summary line to the job log per window.",
    )
    active_steps: int = Field(2, gt=0, description="Steps traced in each window, from its first step on.")
    every: int | None = Field(
        None, gt=0, description="Repeat the window every N steps (windows start at profile.start_step + k x N); "
        "null = one window."
    )
    ranks: list[int] | None = Field(None, description="Worker ranks that trace, e.g. [0]; null = every rank.")
    record_shapes: bool = Field(False, description="Record each op's input shapes (more overhead, larger traces).")
    profile_memory: bool = Field(
        False, description="Record tensor allocations and frees (TensorBoard's memory view; more overhead)."
    )
    with_stack: bool = Field(False, description="Record the Python stack of each op (source lines; much larger traces).")
    top: int = Field(
        8, gt=0, description="Ops named in each window's summary line, by self time (device time on GPU, CPU time on CPU)."
    )

    @property
    def enabled(self) -> bool:
        return self.start_step is not None

    @model_validator(mode="after")
    def _windows_apart(self) -> "ProfileConfig":
        if self.every is not None and self.start_step is None:
            raise ValueError(f"profile.every={self.every} repeats the window that profile.start_step starts; set "
                             "profile.start_step or unset profile.every")
        if self.every is not None and self.every <= self.active_steps:
            raise ValueError(f"profile.every={self.every} must exceed profile.active_steps={self.active_steps}: the "
                             "step before each window warms the profiler up; raise profile.every or lower "
                             "profile.active_steps")
        return self

    def check_within(self, steps: int, workers: int) -> None:
        """ConfigError unless the first window lies within ``steps`` and every rank named is a worker."""
        if self.start_step is not None:
            if self.start_step > steps:
                raise ConfigError(f"profile.start_step={self.start_step} is beyond train.steps={steps}; profile a "
                                  "step of the run or set profile.start_step=null")
            end = self.start_step + self.active_steps - 1
            if end > steps:
                raise ConfigError(f"profile.active_steps={self.active_steps} from profile.start_step="
                                  f"{self.start_step} ends at step {end}, beyond train.steps={steps}; start "
                                  "earlier or trace fewer steps")
        outside = [rank for rank in self.ranks or [] if not 0 <= rank < workers]
        if outside:
            raise ConfigError(f"profile.ranks={self.ranks}: no worker has rank {', '.join(map(str, outside))}; use "
                              f"ranks in 0..{workers - 1} (scaling.num_workers={workers}) or null for every rank")


class MemoryConfig(Section):
    cuda_alloc_conf: str | None = Field(
        None,
        description="PYTORCH_CUDA_ALLOC_CONF of the GPU workers, set through Ray's runtime env before CUDA starts; "
        "null = expandable_segments:True (less fragmentation from FSDP's per-block buffers), unless the driver's "
        "environment sets PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF (the workers then keep that); '' = torch's "
        "default allocator. A value that differs from one the environment sets is refused.",
    )
    history_entries: int | None = Field(
        None,
        gt=0,
        description="GPU: record this many CUDA allocator events with their stacks "
        "(torch.cuda.memory._record_memory_history), so the snapshot a rank writes when it runs out of memory "
        "(<run dir>/memory/rank<R>.step<S>.pickle, for pytorch.org/memory_viz) shows what allocated each block; "
        "null = the snapshot shows the segments and blocks alone.",
    )

    @field_validator("cuda_alloc_conf")
    @classmethod
    def _options(cls, value: str | None) -> str | None:
        if value and not all(re.fullmatch(r"[a-z0-9_]+:\S+", option) for option in _alloc_options(value)):
            raise ValueError(f"expected comma-separated name:value options such as 'expandable_segments:True', "
                             f"got {value!r}")
        return value

    def check_device(self, use_gpu: bool) -> None:
        if self.history_entries is not None and not use_gpu:
            raise ValueError(f"memory.history_entries={self.history_entries} records CUDA allocations; set "
                             "scaling.use_gpu=true or memory.history_entries=null")


def _alloc_options(value: str) -> list[str]:
    """PYTORCH_CUDA_ALLOC_CONF's options: split at commas outside brackets (roundup_power2_divisions:[...])."""
    options, depth, start = [], 0, 0
    for at, char in enumerate(value):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            options.append(value[start:at])
            start = at + 1
    return [*options, value[start:]]


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


class MeshtrainConfig(Section):
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
    profile: ProfileConfig = Field(
        default_factory=ProfileConfig, description="torch.profiler traces of chosen training steps, per rank."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig, description="The GPU workers' CUDA allocator and memory snapshots."
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> "MeshtrainConfig":
        # Shape checks only: a tokenizer file's vocabulary is known once it is loaded; a trained
        # tokenizer has at most data.vocab_size tokens, so model.vocab_size must hold that many.
        # With model.init_from the shape comes from its config.json: meshtrain.cluster.preflight
        # checks it, with the mesh against the layout and every path, file and store named.
        if self.model.init_from is None:
            tokenizer_vocab = self.data.vocab_size if self.data.tokenizer == "train" else (
                self.model.vocab_size or self.data.vocab_size
            )
            model = self.model.resolved(tokenizer_vocab)
            self.check_seq_len(model)
            self.check_model_parallel(model)
        self._check_parallel_degrees()
        self._check_metrics_ports()
        # TP and CP peers read the same samples: the data-parallel ranks are the workers over TP x CP.
        self.batch_layout(self.scaling.num_workers // self.parallel_group_size)
        sizes = self.elastic_sizes()
        if self.scaling.evict_stragglers:
            self._check_eviction_can_happen(sizes)
        # A re-run may resolve another horizon (the launcher keeps the first launch's); it checks again.
        self.optim.check_horizon(self.optim.schedule_steps or self.train.steps)
        self.profile.check_within(self.train.steps, self.scaling.num_workers)
        self.memory.check_device(self.scaling.use_gpu)
        if (self.eval.downstream.enabled or self.eval.samples.prompts) and not self.checkpoint.enabled:
            raise ValueError("eval.downstream.tasks and eval.samples.prompts work on committed checkpoints; set "
                             "checkpoint.enabled=true, or eval.downstream.tasks=[] and eval.samples.prompts=[]")
        if self.eval.interval is not None and self.data.validation.fraction == 0 and self.data.validation.source is None:
            raise ValueError(
                f"eval.interval={self.eval.interval} needs validation data; set data.validation.fraction (e.g. 0.01) "
                "or data.validation.source, or eval.interval=null to turn validation off"
            )
        fault = self.fault
        if fault.node is not None and (fault.kind != "slow" or fault.at_step is None):
            raise ValueError("fault.node is for fault.kind=slow with fault.at_step; set those, or unset fault.node")
        if fault.node is None and (fault.kill_rank is None) != (fault.at_step is None):
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

    @property
    def parallel_group_size(self) -> int:
        """Workers that share one data-parallel rank: a tensor- and context-parallel group."""
        return self.parallel.tensor * self.parallel.context

    def _check_metrics_ports(self) -> None:
        """Each worker serves /metrics on metrics.port + its local rank: the highest must be a port."""
        on_a_node = min(self.scaling.num_workers, self.scaling.workers_per_node or self.scaling.num_workers)
        highest = self.metrics.port + on_a_node - 1
        if self.metrics.port and highest > 65535:
            raise ValueError(f"metrics.port={self.metrics.port}: the {on_a_node} workers of a node serve on ports "
                             f"{self.metrics.port} to {highest}, beyond 65535; use a port at most {65536 - on_a_node}")

    def _check_parallel_degrees(self) -> None:
        """parallel.tensor / parallel.context against the workers, the nodes, the window and the paths."""
        parallel, scaling, inner = self.parallel, self.scaling, self.parallel_group_size
        if inner == 1:
            if parallel.async_tensor:
                raise ValueError("parallel.async_tensor needs tensor parallelism; set parallel.tensor > 1 or drop it")
            return
        per_node = scaling.workers_per_node
        check_parallel_groups(parallel.context, parallel.tensor, scaling.num_workers,
                              f"scaling.num_workers={scaling.num_workers}", per_node,
                              f"scaling.workers_per_node={per_node}")
        if parallel.context > 1 and self.data.seq_len % (2 * parallel.context):
            raise ValueError(f"data.seq_len={self.data.seq_len} is not a multiple of 2 x parallel.context="
                             f"{2 * parallel.context} (each rank holds two balanced chunks of a window); "
                             "change one of them")
        if parallel.async_tensor and (parallel.tensor == 1 or not scaling.use_gpu or not parallel.compile):
            raise ValueError("parallel.async_tensor needs parallel.tensor > 1, scaling.use_gpu=true and "
                             "parallel.compile=true (inductor pipelines the collectives on CUDA); drop it or set those")

    def check_model_parallel(self, model: ModelArgs) -> None:
        """ConfigError when ``parallel.tensor`` does not divide what it splits of ``model``."""
        tensor = self.parallel.tensor
        if tensor == 1:
            return
        for name, value in (("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
                            ("model.ffn_dim", model.ffn_dim), ("the vocabulary (model.vocab_size)", model.vocab_size)):
            if value % tensor:
                raise ConfigError(f"parallel.tensor={tensor} does not divide {name}={value}; choose a degree that "
                                  f"divides {model.n_heads} heads, {model.n_kv_heads} KV heads, FFN {model.ffn_dim} "
                                  f"and vocabulary {model.vocab_size}")

    def _check_eviction_can_happen(self, sizes: list[int]) -> None:
        """scaling.evict_stragglers with settings under which no straggler could ever be evicted
        (``sizes``: the trainable group sizes, :meth:`elastic_sizes`)."""
        patience, every = self.metrics.straggler_patience, self.train.log_every
        if patience * every >= self.train.steps:
            raise ValueError(
                f"scaling.evict_stragglers=true cannot act: metrics.straggler_patience={patience} logged steps of "
                f"train.log_every={every} is {patience * every} steps, not within train.steps={self.train.steps}; "
                "lower metrics.straggler_patience or train.log_every"
            )
        per_node = self.scaling.workers_per_node
        if per_node is not None and not any(size <= self.scaling.num_workers - per_node for size in sizes):
            raise ValueError(
                f"scaling.evict_stragglers=true cannot act: draining one node of scaling.workers_per_node={per_node} "
                f"leaves {self.scaling.num_workers - per_node} workers, below every trainable size "
                f"{sizes}; lower scaling.min_workers"
            )

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
        shard, inner = self.parallel.shard, self.parallel_group_size
        # The unit of workers a size is a whole number of: each data-parallel rank is a tensor x context
        # group of workers (one worker without TP/CP).
        if self.parallel.strategy in ("full_shard", "shard_grad_op", "no_shard"):
            unit = inner  # the shard group is every data-parallel rank (or one): any number holds it
        elif shard != "auto":
            if shard * inner > scaling.min_workers:
                raise ValueError(
                    f"parallel.shard={shard} does not fit scaling.min_workers={scaling.min_workers}: a smaller group "
                    f"could not hold one shard group of {shard * inner} workers; raise scaling.min_workers to "
                    f"{shard * inner} or use parallel.shard=auto"
                )
            unit = shard * inner
        else:
            unit = scaling.workers_per_node or inner  # learned from Ray when unset: checked when the group starts
        step_samples = self.train.micro_batch_size
        sizes = [
            size
            for size in range(scaling.min_workers, scaling.num_workers + 1)
            if size % unit == 0 and self.train.global_batch_size % (size // inner * step_samples) == 0
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

    def check_seq_len(self, model: ModelArgs) -> None:
        """ConfigError when data.seq_len exceeds the model's RoPE table."""
        if self.data.seq_len > model.max_seq_len:
            fix = "" if self.model.init_from is not None else " or raise model.max_seq_len"
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                f"lower data.seq_len{fix}"
            )


