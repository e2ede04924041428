"""bench_gpu's output: the header that says what the columns mean, the markdown table, each run's
diagnostics, and the JSON document of every figure."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from meshtrain.distributed.plan import GIB
from meshtrain_bench.gpu_configs import HISTORY_ENTRIES, PROFILED_STEPS, Window
from meshtrain_bench.gpu_measure import MFU_FORMULA, Row

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
