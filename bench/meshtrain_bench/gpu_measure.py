"""What a finished bench_gpu run measured: tokens/s, MFU by both FLOPs counts against the device's peak,
and peak memory against the plan for the mesh it trained on, from its summary.json and rank 0's records
(meshtrain_bench.gpu's docstring says what each figure is). jobs/gpu_check.py uses the same figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtrain.config import ModelArgs
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import tokenizer_vocab_size
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.distributed.parallelize import param_dtype, use_tf32
from meshtrain.distributed.plan import memory_plan
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token, gpu_peak_flops
from meshtrain.observe.run_folder import TrainRecord, read_records
from meshtrain_bench.gpu_configs import Window

FLOPS_FORMULA = "6 x matmul weights + 12 x layers x seq_len x dim"
MFU_FORMULA = (
    "MFU = tokens/s per worker x model FLOPs per token / device peak FLOP/s; FLOPs per token with attention over "
    f"the (query, key) pairs the masks allowed (MFU) or over the whole window (MFU full attn: {FLOPS_FORMULA})"
)


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



def train_records(run_dir: Path) -> dict[int, TrainRecord]:
    return {r.step: r for r in read_records(run_dir / "metrics.jsonl", TrainRecord)}


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


def timed_figures(records: dict[int, TrainRecord], window: Window) -> Timed:
    """The timed steps' figures, from the logged records at both ends of the window and those between."""
    start, end = records.get(window.warmup), records.get(window.total)
    if start is None or end is None:
        raise RuntimeError(f"metrics.jsonl lacks the logged steps {window.warmup} and {window.total}")
    seconds = end.elapsed_s - start.elapsed_s
    waited, flops, previous = 0.0, 0.0, window.warmup
    counted = True
    for step in sorted(s for s in records if window.warmup < s <= window.total):
        # Each record holds its logging interval's means: weigh them by the steps of the interval.
        counting = records[step].flops_per_token
        waited += records[step].data_wait_s * (step - previous)
        counted = counted and counting is not None
        flops += (counting or 0.0) * (step - previous)
        previous = step
    return Timed(
        tokens_per_s=(end.tokens - start.tokens) / seconds,
        step_s=seconds / window.timed,
        data_wait_s=waited / window.timed,
        warmup_step_s=start.elapsed_s / window.warmup,
        final_loss=end.loss,
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
    row.planned_bytes = memory_plan(args, actual_mesh(cfg, summary), cfg.parallel, cfg.train, cfg.data.seq_len, cfg.scaling.use_gpu, cfg.model.document_mask).total
    if on_gpu and row.measured_peak_bytes is not None:
        row.measured_over_planned = row.measured_peak_bytes / row.planned_bytes
    row.alloc_retries = summary.get("num_alloc_retries")
