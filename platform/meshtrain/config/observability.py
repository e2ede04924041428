"""What a run shows of itself: Prometheus metrics and trackers, profiler windows, GPU memory settings."""

from __future__ import annotations

import ipaddress
import re

from pydantic import Field, field_validator, model_validator

from meshtrain.config.errors import ConfigError
from meshtrain.config.redaction import OptionalLocation
from meshtrain.config.section import MAX_DURATION_S, Section


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
        ge=0, le=MAX_DURATION_S,
        description="After the last step, wait up to this long for a scrape of the final values (only if scraped lately).",
    )
    progress_interval_s: float = Field(
        30.0,
        ge=0, le=MAX_DURATION_S,
        description="Driver progress line at most this often when output is not a terminal (0 = every logged step).",
    )
    ray_report_interval_s: float = Field(
        10.0,
        ge=0, le=MAX_DURATION_S,
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
        description="Log to Weights & Biases from the driver (pip install -e '.[wandb]'); one W&B run per meshtrain run, "
        "continued across restarts. WANDB_MODE=offline writes it under <run dir>/wandb for `wandb sync`.",
    )
    wandb_project: str = Field("meshtrain", min_length=1, description="W&B project of the run.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); unset = the API key's default.")
    wandb_tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    mlflow: bool = Field(
        False,
        description="Log to MLflow from the driver (pip install -e '.[mlflow]'); one MLflow run per meshtrain run, "
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
