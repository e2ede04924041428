"""Training throughput, MFU and peak memory of Llama shapes on GPUs, one real training job per configuration.

Run with ``python jobs/bench_gpu.py`` (its docstring shows examples; ``--help`` lists the options).

The configurations are named sets of dotted settings in ``jobs/bench_gpu.yaml`` (``--matrix``
another file): ``gpu`` (default) holds Llama 3.2 1B and an 8-layer Llama 3 8B, bf16, ``parallel.compile``
and ``parallel.activation_checkpointing=selective`` on and off, several micro-batch sizes; ``tiny``
(``--cpu-smoke``) holds the debug model on CPU workers. Each configuration runs through
``meshtrain.cluster.launcher.launch``, the path ``jobs/pretrain.py`` takes (one Ray Train worker per GPU, the
offline standard-library corpus, a token store prepared once under ``--storage``), for ``--warmup`` +
``--steps`` optimizer steps with checkpoints and evaluation off and ``run.max_failures=0``. A
configuration that fails (out of memory, say) gets a failed row with its one-line reason and the next
one runs; the exit code is then 1.

Unless ``--no-profile``, each run also keeps what explains its figures, in its run folder:

- a torch.profiler trace of rank 0 (``profile/rank0.<step>.pt.trace.json``, for Perfetto or
  chrome://tracing) of one step after the timed ones, and the top ops by self time in that step (the
  run's ``profile`` record, the line the profiler prints to the job log: device kernels on GPU, CPU
  ops on CPU);
- on GPU, the CUDA allocator's history (``memory.history_entries``) from the start of the run, so that
  every rank writes a snapshot saying what allocated each block when its steps are done
  (``memory/rank<R>.step<S>.end.pickle``, for pytorch.org/memory_viz), and a rank that runs out of
  memory one at that step (``memory/rank<R>.step<S>.pickle``). Recording it costs host time at each
  allocation, in the timed steps too: ``--no-profile`` times without it.

What each row reports (rank 0's records in ``metrics.jsonl`` and ``summary.json`` of the run):

- tokens/s per worker = (tokens of the timed steps) / (their wall time) / workers. The timed steps
  follow the warm-up (compilation, allocator growth, Ray Train's first report). The window runs from
  one logged step to another, each timed on the host after its step was queued and just before the
  loss read that waits for the device; both ends lie a whole logging interval after the previous
  read, so the host is as far ahead of the device at either end. Logging every L = ceil(W/2) steps
  puts the first logged step inside the warm-up: the warm-up is rounded up to 2L steps and the timed
  steps up to a multiple of L (default 6 + 21). The profiled steps come after the timed ones.
- MFU = tokens/s per worker x model FLOPs per token / device peak FLOP/s, by two counts of the FLOPs per
  token: "MFU" with attention over the (query, key) pairs the masks allowed (the train records'
  ``flops_per_token``, the timed steps' mean: what the steps computed, as the ``meshtrain_mfu_ratio``
  gauge counts), and "MFU full attn" with every query against the whole window, 6 x matmul weights +
  12 x layers x seq_len x dim (``meshtrain.model.flops.flops_per_token``, the records'
  ``flops_per_token_full_attention``: the PaLM / torchtitan convention that other frameworks' MFU
  uses). Both forward and backward, recomputation not counted. The peak is ``metrics.peak_flops_per_s``
  when set, else the dense peak of the worker's GPU for the compute dtype (``meshtrain.model.flops``), else on
  CPU the nominal ``metrics.cpu_peak_flops_per_s`` (1e11 by default: CPU MFU is not a real figure).
- peak memory: on GPU ``torch.cuda.max_memory_allocated`` after training, the largest over the ranks
  (``peak_device_memory_bytes`` in summary.json), against the ``--dry-run`` plan's per-rank total
  (``meshtrain.distributed.plan.memory_plan``) as measured/planned. On CPU the worker's peak resident set
  (``peak_host_rss_bytes``), which holds Python, PyTorch and Ray too: no ratio is printed for it.
- CUDA allocator retries: how often the caching allocator had to free its cached blocks and retry an
  allocation (``num_alloc_retries`` of ``torch.cuda.memory_stats``; a count above 0 means fragmentation
  near the memory limit, which slows steps), from summary.json's ``num_alloc_retries`` where the run
  recorded it; "-" where it did not, and on CPU.
- step time breakdown per timed step: data wait (host time rank 0 spent getting its batch, ``data_wait_s``
  in metrics.jsonl; on GPU the host runs ahead of the device, so it only costs throughput when it is
  long) and the rest (forward, backward, communication, optimizer); also the warm-up's mean step time
  (compilation shows here) and the setup time (launch to first step and teardown: Ray workers, data,
  model build; the first configuration also prepares the token store unless --storage holds it).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run its jobs/ and read its configs

from meshtrain.config import (
    ConfigError,
    MeshtrainConfig,
    ModelArgs,
    ScalingConfig,
    TrainConfig,
    load_config,
)
from meshtrain.data import tokenizer_vocab_size
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.distributed.parallelize import param_dtype, use_tf32
from meshtrain.distributed.plan import (
    GIB,
    MemoryPlan,
    describe_plan,
    memory_plan,
    planned_device,
    planned_mesh,
)
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token, gpu_peak_flops
from meshtrain.observe.run_folder import RunPaths, read_records, read_worker_starts
from meshtrain.train.profiling import summary_line

DEFAULT_MATRIX = REPO / "jobs" / "bench_gpu.yaml"
FLOPS_FORMULA = "6 x matmul weights + 12 x layers x seq_len x dim"
MFU_FORMULA = (
    "MFU = tokens/s per worker x model FLOPs per token / device peak FLOP/s; FLOPs per token with attention over "
    f"the (query, key) pairs the masks allowed (MFU) or over the whole window (MFU full attn: {FLOPS_FORMULA})"
)
PROFILED_STEPS = 1  # traced by rank 0 after the timed steps, the step before them starting the profiler
PROFILE_TOP = 8  # ops in the profile's summary line
HISTORY_ENTRIES = 100_000  # CUDA allocator events kept with their stacks (torchtitan's default)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: its name and its dotted settings (set base, its own, command line)."""

    name: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class Window:
    """The optimizer steps of one job: warm-up then the timed ones, both whole logging intervals."""

    warmup: int
    timed: int
    log_every: int

    @classmethod
    def for_request(cls, warmup: int, timed: int) -> "Window":
        """Logging every ceil(warmup/2) steps puts the first logged step, which makes Ray Train's first
        report, inside the warm-up; whole intervals make both ends of the timed window alike (below)."""
        log_every = math.ceil(warmup / 2)
        return cls(2 * log_every, log_every * math.ceil(timed / log_every), log_every)

    @property
    def total(self) -> int:
        return self.warmup + self.timed


@dataclass
class Row:
    """One configuration's result; None where a figure does not apply or the run failed."""

    name: str
    status: str  # "ok" or "failed"
    reason: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    world_size: int | None = None
    mesh_shape: list[int] | None = None
    parameters: int | None = None
    tokens_per_s_per_worker: float | None = None
    flops_per_token: float | None = None  # attention over the pairs the masks allowed: the records' timed mean
    flops_per_token_full_attention: float | None = None
    peak_flops_per_s: float | None = None
    peak_source: str | None = None
    mfu: float | None = None
    mfu_full_attention: float | None = None
    measured_peak_bytes: int | None = None
    measured_kind: str | None = None  # "cuda_max_allocated" or "host_peak_rss"
    planned_bytes: int | None = None
    measured_over_planned: float | None = None
    alloc_retries: int | None = None
    step_ms: float | None = None
    data_wait_ms: float | None = None
    rest_ms: float | None = None
    warmup_ms_per_step: float | None = None
    setup_s: float | None = None
    final_loss: float | None = None
    run_dir: str | None = None
    # Relative to run_dir: rank 0's profiler trace, and the CUDA memory snapshots (end of steps, out of memory).
    profile_trace: str | None = None
    profile_summary: str | None = None
    memory_snapshots: list[str] = field(default_factory=list)


# --- configurations ---------------------------------------------------------------------------


def load_matrix(path: Path) -> dict[str, dict[str, Any]]:
    """The sets of a matrix file: {set: {"description", "base", "configs": {name: settings}}}."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"--matrix: cannot read {path} ({type(exc).__name__}); give a YAML file like {DEFAULT_MATRIX.name}"
        ) from None
    sets = loaded.get("sets") if isinstance(loaded, dict) else None
    if not isinstance(sets, dict) or not sets:
        raise ConfigError(f"--matrix: {path} has no 'sets:' mapping; see {DEFAULT_MATRIX}")
    for set_name, entry in sets.items():
        configs = entry.get("configs") if isinstance(entry, dict) else None
        if not isinstance(configs, dict) or not configs:
            raise ConfigError(f"--matrix: set {set_name!r} in {path} has no 'configs:' mapping")
        for name, settings in configs.items():
            if not _NAME.fullmatch(str(name)) or not isinstance(settings, dict):
                raise ConfigError(
                    f"--matrix: configuration {name!r} of set {set_name!r} must be a plain name with a mapping"
                )
    return sets


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings as a dotted mapping (values read as YAML, as jobs/pretrain.py does)."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. scaling.num_workers=8")
        try:
            parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            parsed[key.strip()] = raw
    return parsed


def select(
    sets: dict[str, dict[str, Any]], set_name: str, patterns: list[str], overrides: dict[str, Any]
) -> list[BenchConfig]:
    """The set's configurations whose names match any of ``patterns`` (shell globs; none = all)."""
    if set_name not in sets:
        raise ConfigError(f"--set: unknown set {set_name!r}; choose one of {', '.join(sets)}")
    entry = sets[set_name]
    names = list(entry["configs"])
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(
                f"--only: {pattern!r} matches no configuration of set {set_name!r}; it has {', '.join(names)}"
            )
    chosen = [name for name in names if not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)]
    base = entry.get("base") or {}
    return [BenchConfig(name, {**base, **entry["configs"][name], **overrides}) for name in chosen]


def _field_default(section: type[TrainConfig] | type[ScalingConfig], name: str) -> Any:
    return section.model_fields[name].default


def owned_settings(window: Window, run_name: str, storage: str) -> dict[str, Any]:
    """What the benchmark sets over every configuration: run length and logging, outputs, no checkpoints,
    no evaluation, no restarts, and Ray Train reports only at the first logged step and the last step."""
    return {
        "train.steps": window.total,
        "train.log_every": window.log_every,
        "eval.interval": None,
        "checkpoint.enabled": False,
        "run.name": run_name,
        "run.storage_path": storage,
        "run.max_failures": 0,
        "metrics.ray_report_interval_s": 1e9,
    }


def profile_settings(window: Window, use_gpu: bool) -> dict[str, Any]:
    """Rank 0's profiler window and, on GPU, the CUDA allocator's history.

    The window comes after the timed steps, not inside them: a traced step runs slower (every op
    recorded, the trace and its summary written at its end) and so does the step before it, which
    starts the profiler. The timed window's last figure is read during its last step (window.total),
    before either, so two more steps leave tokens/s as it was. The allocator's history must record
    from the start to say what allocated each block, so it is on for the whole run, timed steps included.
    """
    first = window.total + 2
    settings: dict[str, Any] = {
        "train.steps": first + PROFILED_STEPS - 1,
        "profile.start_step": first,
        "profile.active_steps": PROFILED_STEPS,
        "profile.ranks": [0],
        "profile.top": PROFILE_TOP,
    }
    if use_gpu:  # memory.history_entries is refused on CPU workers
        settings["memory.history_entries"] = HISTORY_ENTRIES
    return settings


def run_settings(
    config: BenchConfig, window: Window, run_name: str, storage: str, profile: bool = True
) -> dict[str, Any]:
    """The configuration's settings, a global batch of one micro-batch per worker unless it sets one, and
    the benchmark's own settings over them (with ``profile``, the profiler's window and allocator history too)."""
    settings = dict(config.settings)
    if "train.global_batch_size" not in settings:
        micro = settings.get("train.micro_batch_size", _field_default(TrainConfig, "micro_batch_size"))
        workers = settings.get("scaling.num_workers", _field_default(ScalingConfig, "num_workers"))
        # Tensor- and context-parallel peers share their samples: one micro-batch per data-parallel rank.
        peers = int(settings.get("parallel.tensor", 1)) * int(settings.get("parallel.context", 1))
        settings["train.global_batch_size"] = int(micro) * (int(workers) // peers)
    owned = owned_settings(window, run_name, storage)
    if profile:
        use_gpu = settings.get("scaling.use_gpu", _field_default(ScalingConfig, "use_gpu"))
        owned.update(profile_settings(window, bool(use_gpu)))
    return {**settings, **owned}


def to_overrides(settings: dict[str, Any]) -> list[str]:
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in settings.items()]


def build_config(settings: dict[str, Any]) -> MeshtrainConfig:
    return load_config(None, to_overrides(settings))


def for_plan(cfg: MeshtrainConfig, device_type: str) -> MeshtrainConfig:
    """The config the fit verdict is judged on: ``device_type`` for GPU runs that name no device of their own
    (only for the plan: the run itself does not require that accelerator type from Ray)."""
    if not cfg.scaling.use_gpu or cfg.scaling.accelerator_type or cfg.scaling.device_memory_gib:
        return cfg
    planned = cfg.model_copy(deep=True)
    planned.scaling.accelerator_type = device_type
    return planned


# --- dry run ----------------------------------------------------------------------------------


def short_verdict(cfg: MeshtrainConfig, memory: MemoryPlan) -> str:
    """The gist of meshtrain.distributed.plan.fit_verdict for the summary table."""
    if not cfg.scaling.use_gpu:
        return "CPU workers: no device verdict"
    device = planned_device(cfg.scaling)
    if device is None:
        return "device memory unknown"
    fits = memory.total / GIB <= device.usable_gib
    return f"{'fits' if fits else 'does not fit'} {device.name} ({device.usable_gib:.1f} GiB usable)"


def dry_run(
    configs: list[BenchConfig], window: Window, device_type: str, trace: bool = False, profile: bool = True
) -> int:
    """Each configuration's plan (and, for GPU ones, the fit verdict); no Ray. 2 if one is invalid.
    ``trace``: also each configuration's traced step (meshtrain.train.trace), plan against traced peak."""
    summary: list[tuple[str, ...]] = []
    status = 0
    owned = owned_settings(window, "<config>-<time>", "<--storage>")
    if profile:
        owned.update(profile_settings(window, use_gpu=False))
    print("set by the benchmark over every configuration: " + " ".join(to_overrides(owned)))
    if profile:
        print(f"and memory.history_entries={HISTORY_ENTRIES} on GPU workers (--no-profile: neither the profiler "
              "nor the allocator history)")
    print("and train.global_batch_size = micro-batch x data-parallel ranks unless a configuration sets it\n")
    for config in configs:
        print(f"== {config.name} ==")
        print("settings: " + " ".join(to_overrides(config.settings)))
        try:
            cfg = for_plan(
                build_config(run_settings(config, window, "dry-run", "runs/bench_gpu", profile)), device_type
            )
            args = model_args(cfg.model, tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size))
            report = describe_plan(cfg, args)
        except ConfigError as exc:
            print(f"config error: {exc}\n")
            summary.append((config.name, "-", "-", f"config error: {exc}"))
            status = 2
            continue
        print(f"model FLOPs per token: {flops_per_token(args, cfg.data.seq_len):.4g} ({FLOPS_FORMULA})")
        print(report + "\n")
        plan, _ = planned_mesh(cfg.scaling, cfg.parallel)
        memory = memory_plan(cfg, args, plan, cfg.scaling.use_gpu)
        verdict = short_verdict(cfg, memory)
        row = (config.name, f"{memory.total / GIB:.1f}", f"{cfg.scaling.num_workers}", verdict)
        if trace:
            from meshtrain.train.trace import trace_step

            traced = trace_step(cfg, args, plan).on_device(cfg.parallel.cpu_offload)
            print(f"traced peak per rank: {traced / GIB:.2f} GiB; plan/traced {memory.total / traced:.3f}\n", flush=True)
            row = (*row[:2], f"{traced / GIB:.1f}", f"{memory.total / traced:.3f}", *row[2:])
        summary.append(row)
    if trace:
        print("| config | plan per rank (GiB) | traced peak (GiB) | plan/traced | workers | verdict |")
        print("|---|---|---|---|---|---|")
    else:
        print("| config | plan per rank (GiB) | workers | verdict |")
        print("|---|---|---|---|")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    return status


# --- measuring one run ------------------------------------------------------------------------


def train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in read_records(run_dir / "metrics.jsonl", ["train"])}


@dataclass(frozen=True)
class Timed:
    """The timed steps' figures (rank 0's records): global tokens/s, per-step seconds, and the mean FLOPs
    per token the records counted with attention over the allowed pairs (None if one lacks them)."""

    tokens_per_s: float
    step_s: float
    data_wait_s: float
    warmup_step_s: float
    final_loss: float
    flops_per_token: float | None


def timed_figures(records: dict[int, dict[str, Any]], window: Window) -> Timed:
    """The timed steps' figures, from the logged records at both ends of the window and those between."""
    start, end = records.get(window.warmup), records.get(window.total)
    if start is None or end is None:
        raise RuntimeError(f"metrics.jsonl lacks the logged steps {window.warmup} and {window.total}")
    seconds = end["elapsed_s"] - start["elapsed_s"]
    waited, flops, previous = 0.0, 0.0, window.warmup
    counted = True
    for step in sorted(s for s in records if window.warmup < s <= window.total):
        # Each record holds its logging interval's means: weigh them by the steps of the interval.
        waited += records[step]["data_wait_s"] * (step - previous)
        counted = counted and "flops_per_token" in records[step]
        flops += records[step].get("flops_per_token", 0.0) * (step - previous)
        previous = step
    return Timed(
        tokens_per_s=(end["tokens"] - start["tokens"]) / seconds,
        step_s=seconds / window.timed,
        data_wait_s=waited / window.timed,
        warmup_step_s=start["elapsed_s"] / window.warmup,
        final_loss=end["loss"],
        flops_per_token=flops / window.timed if counted else None,
    )


def actual_mesh(cfg: MeshtrainConfig, summary: dict[str, Any]) -> MeshPlan:
    """The mesh the run trained on (summary.json's shape), resharding as its strategy does."""
    workers = summary["workers"]
    per_node = sum(w["node_rank"] == workers[0]["node_rank"] for w in workers)
    plan = resolve_mesh_shape(summary["world_size"], per_node, cfg.parallel.strategy, cfg.parallel.shard,
                              cfg.parallel.context, cfg.parallel.tensor)
    replicate, shard = summary["mesh_shape"][:2]
    return MeshPlan(replicate, shard, plan.reshard_after_forward, plan.context, plan.tensor)


def device_peak(cfg: MeshtrainConfig, device: str) -> tuple[float | None, str]:
    """The peak FLOP/s MFU divides by, and where it comes from (as the workers' own MFU gauge does)."""
    if cfg.metrics.peak_flops_per_s is not None:
        peak, source = cfg.metrics.peak_flops_per_s, "metrics.peak_flops_per_s"
    elif device == "cpu":
        peak, source = cfg.metrics.cpu_peak_flops_per_s, "CPU nominal (metrics.cpu_peak_flops_per_s)"
    else:
        dtype = param_dtype(cfg.parallel.mixed_precision, "cuda")
        tf32 = use_tf32(cfg.train.tf32, cfg.parallel.mixed_precision, "cuda")
        peak = gpu_peak_flops(device, dtype, tf32)
        source = f"{device} dense {'bf16' if dtype == torch.bfloat16 else 'tf32' if tf32 else 'fp32'}"
        if peak is None:
            return None, f"{device}: unknown, set metrics.peak_flops_per_s"
    return peak, f"{source} {peak / 1e12:,.4g} TFLOP/s"


def run_model_args(cfg: MeshtrainConfig, run_dir: Path) -> ModelArgs:
    """The trained shape: the run's own tokenizer fixes the vocabulary when the preset leaves it open."""
    return model_args(cfg.model, tokenizer_vocab_size(str(run_dir / "tokenizer.json"), cfg.data.vocab_size))


def measure(row: Row, cfg: MeshtrainConfig, summary: dict[str, Any], window: Window) -> Row:
    """Fill ``row`` from a finished run's summary.json and metrics.jsonl, and mark it ok."""
    run_dir = Path(summary["run_dir"])
    args = run_model_args(cfg, run_dir)
    row.device, row.world_size = summary.get("device", "unknown"), summary["world_size"]
    row.mesh_shape, row.parameters, row.run_dir = summary["mesh_shape"], summary["parameters"], str(run_dir)
    _fill_speed(row, cfg, args, timed_figures(train_records(run_dir), window))
    _fill_memory(row, cfg, args, summary)
    row.setup_s = summary["wall_time_s"] - summary["train_time_s"]
    row.status = "ok"
    return row


def _fill_speed(row: Row, cfg: MeshtrainConfig, args: ModelArgs, timed: Timed) -> None:
    assert row.world_size is not None and row.device is not None
    row.tokens_per_s_per_worker = timed.tokens_per_s / row.world_size
    row.flops_per_token = timed.flops_per_token
    row.flops_per_token_full_attention = flops_per_token(args, cfg.data.seq_len)
    row.peak_flops_per_s, row.peak_source = device_peak(cfg, row.device)
    if row.peak_flops_per_s:
        tokens_per_peak_flop = row.tokens_per_s_per_worker / row.peak_flops_per_s
        row.mfu_full_attention = tokens_per_peak_flop * row.flops_per_token_full_attention
        if row.flops_per_token is not None:
            row.mfu = tokens_per_peak_flop * row.flops_per_token
    row.step_ms, row.data_wait_ms = 1000 * timed.step_s, 1000 * timed.data_wait_s
    row.rest_ms = row.step_ms - row.data_wait_ms
    row.warmup_ms_per_step = 1000 * timed.warmup_step_s
    row.final_loss = timed.final_loss


def _fill_memory(row: Row, cfg: MeshtrainConfig, args: ModelArgs, summary: dict[str, Any]) -> None:
    """The measured peak, the plan for the mesh the run had, and their ratio where both count device memory."""
    on_gpu = "peak_device_memory_bytes" in summary
    row.measured_peak_bytes = summary.get("peak_device_memory_bytes" if on_gpu else "peak_host_rss_bytes")
    row.measured_kind = "cuda_max_allocated" if on_gpu else "host_peak_rss"
    row.planned_bytes = memory_plan(cfg, args, actual_mesh(cfg, summary), cfg.scaling.use_gpu).total
    if on_gpu and row.measured_peak_bytes is not None:
        row.measured_over_planned = row.measured_peak_bytes / row.planned_bytes
    row.alloc_retries = summary.get("num_alloc_retries")


def read_diagnostics(row: Row, run_dir: Path) -> None:
    """The run's memory snapshots (a rank that ran out of CUDA memory, and every rank at the end with the
    allocator history on) and rank 0's profiler trace with its summary line, from the run folder."""
    row.memory_snapshots = sorted(str(path.relative_to(run_dir)) for path in (run_dir / "memory").glob("*.pickle"))
    windows = [r for r in read_records(run_dir / "metrics.jsonl", ["profile"]) if r.get("rank") == 0]
    if not windows:
        return
    window = windows[0]
    trace = Path(window["trace"])
    row.profile_trace = str(trace.relative_to(run_dir)) if trace.is_relative_to(run_dir) else str(trace)
    ops = [(str(name), float(ms)) for name, ms in window["top_ms_per_step"]]
    row.profile_summary = summary_line(0, window["first_step"], window["step"], window["device"] == "cuda", ops,
                                       Path(row.profile_trace))


def failure_reason(exc: BaseException) -> str:
    """One line: the launcher's root cause (the rank that failed first, not one that lost its peer), or
    for any other error its own line."""
    from meshtrain.cluster.failures import root_failure
    from meshtrain.cluster.outcome import TrainingFailed

    failure = getattr(exc, "failure", None)
    if failure is None and isinstance(exc, TrainingFailed) and exc.__context__ is not None:
        failure = root_failure(exc.__context__)  # a TrainingFailed raised over Ray's error without its cause
    return (failure or root_failure(exc)).describe()


def wait_for_workers_to_exit(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Let the run's worker processes on this node exit (and free their GPU memory) before the next run."""
    import psutil
    import ray

    here = ray.util.get_node_ip_address() if ray.is_initialized() else None
    starts = read_worker_starts(RunPaths(run_dir.name, run_dir.parent))
    pids = {worker["pid"] for start in starts for worker in start["workers"] if worker["node_ip"] == here}
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)


def run_one(
    config: BenchConfig, window: Window, stamp: str, storage: str, local_ray: bool, profile: bool = True
) -> Row:
    """Train one configuration through meshtrain.cluster.launcher.launch and measure it; failures become a row."""
    from meshtrain.cluster.capacity import check_capacity
    from meshtrain.cluster.launcher import launch

    row = Row(config.name, "failed", settings=dict(config.settings))
    run_name = f"{config.name}-{stamp}"
    run_dir = Path(storage).expanduser().resolve() / run_name
    cfg: MeshtrainConfig | None = None
    try:
        cfg = build_config(run_settings(config, window, run_name, storage, profile))
        check_capacity(cfg.scaling, local_ray)  # launch's own check would take this Ray for a cluster that may grow
        summary = launch(cfg)
        row = measure(row, cfg, summary, window)
    except Exception as exc:  # noqa: BLE001 - one configuration's failure must not end the benchmark
        row.reason = failure_reason(exc)
    finally:
        wait_for_workers_to_exit(run_dir)
    if cfg is not None and run_dir.is_dir():
        row.run_dir = str(run_dir)
        read_diagnostics(row, run_dir)
    return row


# --- output -----------------------------------------------------------------------------------

COLUMNS = (
    "config", "tok/s/worker", "MFU", "MFU full attn", "MFU's peak", "peak mem (GiB)", "plan (GiB)", "measured/plan",
    "alloc retries", "step ms", "data wait ms", "rest ms", "warm-up ms/step", "setup s",
)


def header(window: Window, set_name: str, profile: bool) -> list[str]:
    lines = [
        f"bench_gpu: set {set_name}, {window.timed} timed steps after {window.warmup} warm-up steps each",
        MFU_FORMULA + " (meshtrain.model.flops; peak from metrics.peak_flops_per_s, else the GPU's dense peak for the "
        "compute dtype, else the nominal metrics.cpu_peak_flops_per_s on CPU)",
        "peak mem: torch.cuda.max_memory_allocated, max over ranks, vs the --dry-run plan per rank "
        "(meshtrain.distributed.plan.memory_plan); on CPU the worker's peak RSS (Python, torch and Ray included: no ratio)",
        "alloc retries: the CUDA caching allocator's num_alloc_retries (summary.json), '-' where not recorded",
        "step ms = data wait (rank 0 waiting for its batch) + rest (forward, backward, communication, optimizer)",
    ]
    if profile:
        lines.append(
            f"profile: rank 0 traces {PROFILED_STEPS} step after the timed ones (not timed); on GPU the CUDA "
            f"allocator records its history ({HISTORY_ENTRIES:,} events) for the snapshot of a rank that runs out "
            "of memory; paths are relative to each run folder"
        )
    return lines


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table_row(row: Row) -> str:
    if row.status != "ok":
        cells = [row.name, f"FAILED: {row.reason}"] + ["-"] * (len(COLUMNS) - 2)
        return "| " + " | ".join(cells) + " |"
    gpu = row.measured_kind == "cuda_max_allocated"
    cells = [
        row.name,
        f"{row.tokens_per_s_per_worker:,.0f}",
        _percent(row.mfu),
        _percent(row.mfu_full_attention),
        row.peak_source or "-",
        _gib(row.measured_peak_bytes) + ("" if gpu else " (RSS)"),
        _gib(row.planned_bytes),
        "-" if row.measured_over_planned is None else f"{row.measured_over_planned:.2f}",
        "-" if row.alloc_retries is None else f"{row.alloc_retries:,}",
        f"{row.step_ms:.1f}",
        f"{row.data_wait_ms:.2f}",
        f"{row.rest_ms:.1f}",
        f"{row.warmup_ms_per_step:.1f}",
        f"{row.setup_s:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + [table_row(row) for row in rows])


def diagnostics(rows: list[Row]) -> list[str]:
    """Each run's folder with its profile summary (which names the trace) and its memory snapshots."""
    lines = []
    for row in rows:
        if row.run_dir is None:
            continue
        lines.append(f"{row.name}: run folder {row.run_dir}")
        if row.profile_summary is not None:
            lines.append(f"  {row.profile_summary}")
        if row.memory_snapshots:
            lines.append(f"  memory snapshots (pytorch.org/memory_viz): {', '.join(row.memory_snapshots)}")
    return lines


def write_json(path: Path, lines: list[str], window: Window, rows: list[Row], profile: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "header": lines,
        "mfu_formula": MFU_FORMULA,
        "warmup_steps": window.warmup,
        "timed_steps": window.timed,
        "profiled_steps": PROFILED_STEPS if profile else 0,
        "rows": [asdict(row) for row in rows],
        "table": format_table(rows),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="YAML file of configuration sets")
    parser.add_argument("--set", dest="set_name", default="gpu", help="which set of the matrix to run (default gpu)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the `tiny` set on CPU workers (= --set tiny)")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="run only configurations whose name matches (repeatable, comma-separated globs)")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed optimizer steps per configuration, rounded up to whole logging intervals "
                        "(default %(default)s)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="untimed steps first (compilation, allocator growth), rounded up to an even number "
                        "(default %(default)s)")
    parser.add_argument("--storage", default="runs/bench_gpu",
                        help="run.storage_path of the jobs: runs and the cached token store (shared on a cluster; "
                        "default %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the table and every figure as JSON here")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help=f"neither trace rank 0's step after the timed ones ({PROFILED_STEPS} more step, plus "
                        "the one that starts the profiler) nor record the CUDA allocator's history (which costs "
                        "host time at each allocation, timed steps included)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each configuration's memory plan and verdict; no Ray")
    parser.add_argument("--trace", action="store_true",
                        help="with --dry-run: trace one step of each configuration on fake tensors and a fake process "
                        "group (no GPU needed) and print its peak beside the plan")
    parser.add_argument("--device-type", default="H100",
                        help="GPU the --dry-run verdict is for, unless a configuration sets scaling.accelerator_type "
                        "or scaling.device_memory_gib (default H100)")
    parser.add_argument("--list", action="store_true", help="list the sets and their configurations, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings applied to every configuration")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.set_name = "tiny"
    args.only = [p.strip() for item in args.only for p in item.split(",") if p.strip()]
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    return args


def list_sets(sets: dict[str, dict[str, Any]]) -> None:
    for set_name, entry in sets.items():
        print(f"{set_name}: {entry.get('description', '').strip()}")
        for name in entry["configs"]:
            print(f"  {name}")


def run_all(
    configs: list[BenchConfig], window: Window, storage: str, out: Path | None, lines: list[str], profile: bool
) -> list[Row]:
    """Every configuration in turn, on one Ray (joined or started here, as jobs/pretrain.py does)."""
    from meshtrain.cluster.launcher import init_ray

    local_ray = init_ray()
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    rows: list[Row] = []
    for index, config in enumerate(configs, 1):
        settings = " ".join(to_overrides(config.settings))
        print(f"[bench_gpu] {index}/{len(configs)} {config.name}: {settings}", flush=True)
        started = time.perf_counter()
        rows.append(run_one(config, window, stamp, storage, local_ray, profile))
        print(f"[bench_gpu] {config.name} {rows[-1].status} in {time.perf_counter() - started:.0f}s", flush=True)
        print(table_row(rows[-1]), flush=True)
        if out is not None:
            write_json(out, lines, window, rows, profile)  # after every configuration: a crash keeps what was measured
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sets = load_matrix(args.matrix)
        if args.list:
            list_sets(sets)
            return 0
        configs = select(sets, args.set_name, args.only, parse_overrides(args.overrides))
    except ConfigError as exc:
        print(f"bench_gpu: config error: {exc}", file=sys.stderr)
        return 2
    window = Window.for_request(args.warmup, args.steps)
    if args.dry_run:
        return dry_run(configs, window, args.device_type, args.trace, args.profile)
    lines = header(window, args.set_name, args.profile)
    rows = run_all(configs, window, args.storage, args.out, lines, args.profile)
    print()
    print("\n".join(lines))
    print(format_table(rows))
    for line in diagnostics(rows):
        print(line)
    if args.out is not None:
        print(f"[bench_gpu] wrote {args.out}")
    return 0 if all(row.status == "ok" for row in rows) else 1


