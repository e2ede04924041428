"""The in-process GPU check: meshtrain's own worker code on one GPU, in one process, with no Ray.

Run with ``python jobs/gpu_check.py`` (``--help`` lists the options). It is what a machine with one
GPU and its own torch (2.11 or later) can run without a cluster: every configuration goes through
``meshtrain.train.trainer.train`` — the function each Ray Train worker calls — on a one-rank process
group, so the model is built on meta, sharded with ``fully_shard`` on a one-GPU mesh, initialized,
trained with the optimizer, step guard and chunked loss, and (one configuration) checkpointed and
resumed, exactly as on a cluster. Nothing from ``ray`` is imported on this path, and the data is a
prepared token store (``--data``; ``jobs/gpu_check_pack.py`` prepares one), so ``datasets`` is not
needed either.

Configurations, in the order they run (a failed one becomes a row with its one-line reason and the
next runs; a time budget turns the ones it cannot fit into skipped rows):

- correctness: the debug model for 10 steps on the CPU (the reference) and on the GPU in fp32 (losses
  within 1e-4 relative of the CPU's), in bf16 (within 2e-2), with the document mask (flex attention
  on both sides), and resumed from a checkpoint saved at step 5 (steps 6-10 against the unbroken GPU run);
- throughput: Llama 3.2 1B (seq 4096) and Llama 3 8B with 8 of its 32 layers (seq 8192) in bf16,
  eager, compiled, compiled with selective recompute, the document mask on and off, and float8
  (tensorwise and rowwise) where torchao is installed.

Each row reports tokens/s, MFU by both counts (see meshtrain_bench.gpu), the peak CUDA allocation
against the memory plan, the allocator's retries, the warm-up's excess over the timed steps (compile
time, mostly), and the loss. With ``--out DIR``: ``gpu_check.json``, ``gpu_check.md``, one profiler
trace and one CUDA memory snapshot (gzipped).

``--cpu-smoke`` runs the same path on the CPU with the debug shapes (for CI and machines without a
GPU); its figures say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import gzip
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain_bench.gpu_configs import Window, build_config
from meshtrain_bench.gpu_measure import device_peak, timed_figures
from meshtrain.config import ConfigError, one_line
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan, prepare_data
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.distributed.parallelize import set_matmul_precision, use_tf32
from meshtrain.distributed.plan import GIB, memory_plan
from meshtrain.distributed.torch_support import UnsupportedTorch, check_torch
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    MemorySnapshotRecord,
    ProfileRecord,
    Record,
    TrainRecord,
)

CORRECTNESS_STEPS = 10
RESUME_AT = 5
FP32_BOUND = 1e-4
BF16_BOUND = 2e-2
HISTORY_ENTRIES = 20_000  # allocator events kept for the one memory snapshot
FILE_LIMIT = 16 * 2**20  # the largest file a device call brings back


@dataclass(frozen=True)
class Check:
    """One configuration: dotted settings over the check's base, and what its losses are held to."""

    name: str
    settings: dict[str, Any]
    kind: str  # "reference", "correctness", "resume" or "throughput"
    quick: bool = False
    reference: str | None = None  # the configuration whose losses this one is compared with
    bound: float | None = None  # largest relative loss difference allowed against the reference
    extra: bool = False  # a follow-up measurement: runs only when --only names it


_DEBUG = {"model.preset": "debug", "data.seq_len": 128, "train.global_batch_size": 8, "train.micro_batch_size": 8}
_MASK = {"model.document_mask": True, "data.seq_len": 512}  # windows long enough to hold document ends
_FP32 = {"parallel.mixed_precision": "fp32", "train.tf32": False, "model.document_mask": False}
_1B = {"model.preset": "llama3_1b", "data.seq_len": 4096}
_8B = {"model.preset": "llama3_8b", "model.n_layers": 8, "data.seq_len": 8192}
_BF16 = {"parallel.mixed_precision": "bf16", "train.micro_batch_size": 1, "train.global_batch_size": 1}
_COMPILE = {"parallel.compile": True}
_SEL = {"parallel.compile": True, "parallel.activation_checkpointing": "selective"}
_NOMASK = {"model.document_mask": False}
_F8 = {"parallel.float8": True}
_ROWWISE = {"parallel.float8": True, "parallel.float8_recipe": "rowwise"}
_MB2 = {"train.micro_batch_size": 2, "train.global_batch_size": 2}
_MB4 = {"train.micro_batch_size": 4, "train.global_batch_size": 4}

CHECKS: tuple[Check, ...] = (
    Check("debug-cpu-fp32", {**_DEBUG, **_FP32}, "reference", quick=True),
    Check("debug-fp32", {**_DEBUG, **_FP32}, "correctness", True, "debug-cpu-fp32", FP32_BOUND),
    Check("debug-bf16", {**_DEBUG, **_FP32, "parallel.mixed_precision": "bf16"}, "correctness", True,
          "debug-cpu-fp32", BF16_BOUND),
    Check("debug-fp32-resume", {**_DEBUG, **_FP32}, "resume", True, "debug-fp32", FP32_BOUND),
    Check("debug-cpu-fp32-mask", {**_DEBUG, **_FP32, **_MASK}, "reference"),
    Check("debug-fp32-mask", {**_DEBUG, **_FP32, **_MASK}, "correctness", False,
          "debug-cpu-fp32-mask", FP32_BOUND),
    Check("1b-eager", {**_1B, **_BF16}, "throughput", quick=True),
    Check("1b-compile", {**_1B, **_BF16, **_COMPILE}, "throughput", quick=True),
    Check("8b8l-compile-sel", {**_8B, **_BF16, **_SEL}, "throughput", quick=True),
    Check("1b-compile-sel", {**_1B, **_BF16, **_SEL}, "throughput"),
    Check("1b-compile-nomask", {**_1B, **_BF16, **_COMPILE, **_NOMASK}, "throughput"),
    Check("1b-compile-float8", {**_1B, **_BF16, **_COMPILE, **_F8}, "throughput"),
    Check("1b-compile-float8-rowwise", {**_1B, **_BF16, **_COMPILE, **_ROWWISE}, "throughput"),
    Check("8b8l-eager", {**_8B, **_BF16}, "throughput"),
    Check("8b8l-compile-sel-nomask", {**_8B, **_BF16, **_SEL, **_NOMASK}, "throughput"),
    Check("8b8l-compile-sel-float8", {**_8B, **_BF16, **_SEL, **_F8}, "throughput"),
    Check("8b8l-compile-sel-float8-rowwise", {**_8B, **_BF16, **_SEL, **_ROWWISE}, "throughput"),
    # Follow-ups (--only): more tokens per step, where the weights' float8 casts and the optimizer's pass
    # over the weights weigh less against the matrix multiplies.
    Check("1b-compile-mb4", {**_1B, **_BF16, **_COMPILE, **_MB4}, "throughput", extra=True),
    Check("1b-compile-float8-mb4", {**_1B, **_BF16, **_COMPILE, **_F8, **_MB4}, "throughput", extra=True),
    Check("1b-compile-float8-rowwise-mb4", {**_1B, **_BF16, **_COMPILE, **_ROWWISE, **_MB4}, "throughput", extra=True),
    Check("1b-compile-sel-mb4", {**_1B, **_BF16, **_SEL, **_MB4}, "throughput", extra=True),  # the product path's
    Check("8b8l-compile-sel-mb2", {**_8B, **_BF16, **_SEL, **_MB2}, "throughput", extra=True),
    Check("8b8l-compile-sel-float8-mb2", {**_8B, **_BF16, **_SEL, **_F8, **_MB2}, "throughput", extra=True),
)
TRACED = "1b-compile"  # the configuration whose step after the timed ones is traced (--trace)
SNAPSHOT = "1b-eager"  # the configuration that records the allocator's history for a snapshot
# On the CPU every Llama shape becomes the debug model: the path is the same, the figures are not GPU figures.
CPU_SHAPES = {"llama3_1b": {"data.seq_len": 128}, "llama3_8b": {"data.seq_len": 256, "model.n_layers": None}}


@dataclass
class CheckRow:
    """One configuration's result; None where a figure does not apply or the run failed."""

    name: str
    status: str = "failed"  # "ok", "failed" or "skipped"
    reason: str | None = None
    device: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    parameters: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_full_attention: float | None = None
    peak_source: str | None = None
    peak_bytes: int | None = None
    planned_bytes: int | None = None
    measured_over_planned: float | None = None
    alloc_retries: int | None = None
    step_ms: float | None = None
    warmup_excess_s: float | None = None  # warm-up time beyond as many timed steps: compilation, mostly
    final_loss: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    compared_with: str | None = None
    max_rel_diff: float | None = None
    bound: float | None = None
    wall_s: float | None = None


# --- settings -------------------------------------------------------------------------------


def base_settings(run_dir: Path, name: str, data: str) -> dict[str, Any]:
    """What every configuration shares: one worker, no evaluation, no checkpoints, no metrics server."""
    return {
        "run.name": name,
        "run.storage_path": str(run_dir),
        "data.source": data,
        "scaling.num_workers": 1,
        "eval.interval": None,
        "checkpoint.enabled": False,
        "metrics.port": 0,
        "optim.lr": 3e-4,
        "optim.schedule": "constant",
        "optim.warmup_steps": 0,
    }


def for_cpu(settings: dict[str, Any]) -> dict[str, Any]:
    """A configuration's settings for --cpu-smoke: the debug model in place of a Llama shape."""
    shape = CPU_SHAPES.get(settings.get("model.preset", "debug"))
    if shape is None:
        return dict(settings)
    cpu = {**settings, "model.preset": "debug", "train.micro_batch_size": 2, "train.global_batch_size": 2}
    for key, value in shape.items():
        if value is None:
            cpu.pop(key, None)
        else:
            cpu[key] = value
    cpu.pop("parallel.mixed_precision", None)  # bf16 on a CPU computes through fp32 conversions: no figure
    return cpu


def run_length(check: Check, window: Window) -> dict[str, Any]:
    if check.kind == "throughput":
        return {"train.steps": window.total, "train.log_every": window.log_every}
    return {"train.steps": CORRECTNESS_STEPS, "train.log_every": 1}


# --- one configuration ----------------------------------------------------------------------


def card_bytes(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def out_of_memory_line(exc: BaseException, planned: int | None, card: int | None) -> str:
    """A configuration that does not fit: its plan against the card, then what torch said."""
    plan = f"plan {planned / GIB:.1f} GiB" if planned is not None else "plan unknown"
    against = f" against the card's {card / GIB:.1f} GiB" if card is not None else ""
    return f"out of memory: {plan}{against} ({one_line(exc, 200)})"


def _is_out_of_memory(exc: BaseException) -> bool:
    from meshtrain.train.memory_snapshot import DeviceOutOfMemory

    return isinstance(exc, (torch.OutOfMemoryError, DeviceOutOfMemory))


def relative_difference(losses: dict[int, float], reference: dict[int, float]) -> float:
    """The largest |a - b| / |b| over the steps both hold."""
    steps = sorted(set(losses) & set(reference))
    if not steps:
        raise RuntimeError("no common logged steps to compare")
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in steps)


class Runner:
    """Runs configurations in this process, on one rank, and fills their rows."""

    def __init__(self, device: torch.device, work: Path, data_source: str, window: Window, profile: bool,
                 traced: str = TRACED) -> None:
        self.device, self.work, self.window, self.profile, self.traced = device, work, window, profile, traced
        self.data_source = data_source
        self.plans: dict[str, DataPlan] = {}
        self.rows: dict[str, CheckRow] = {}
        self.trace: Path | None = None
        self.snapshot: Path | None = None

    def data(self, cfg: MeshtrainConfig) -> DataPlan:
        """The token store's plan (prepared once per sequence length, without Ray)."""
        key = json.dumps([cfg.data.source, cfg.data.seq_len])
        if key not in self.plans:
            self.plans[key] = prepare_data(cfg.data, str(self.work / "token_stores"), cfg.data.seq_len,
                                           use_ray=False, log=lambda line: print(line, flush=True))
        return self.plans[key]

    def settings(self, check: Check, cpu: bool) -> dict[str, Any]:
        settings = check.settings if not cpu else for_cpu(check.settings)
        owned = {**base_settings(self.work / "runs", check.name, self.data_source), **run_length(check, self.window)}
        if check.kind == "reference":
            owned["scaling.use_gpu"] = False
        elif self.device.type == "cuda":
            owned["scaling.use_gpu"] = True
        if self.profile and check.name == self.traced:
            owned.update({"train.steps": self.window.total + 2, "profile.start_step": self.window.total + 2,
                          "profile.active_steps": 1, "profile.ranks": [0], "profile.top": 8})
        if self.profile and check.name == SNAPSHOT and self.device.type == "cuda":
            owned["memory.history_entries"] = HISTORY_ENTRIES
        return {**settings, **owned}

    def run(self, check: Check, cpu: bool) -> CheckRow:
        row = CheckRow(check.name, settings=dict(check.settings))
        device = torch.device("cpu") if check.kind == "reference" else self.device
        row.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        started = time.perf_counter()
        planned: int | None = None
        try:
            cfg = build_config(self.settings(check, cpu))
            shutil.rmtree(self.work / "runs" / check.name, ignore_errors=True)
            data = self.data(cfg)
            args = model_args(cfg.model, data.vocab_size)
            plan = resolve_mesh_shape(1, 1, cfg.parallel.strategy, cfg.parallel.shard, cfg.parallel.context,
                                      cfg.parallel.tensor)
            planned = memory_plan(args, plan, cfg.parallel, cfg.train, cfg.data.seq_len, device.type == "cuda", cfg.model.document_mask).total
            if check.kind == "resume":
                records, parameters = self._train_resumed(cfg, data, device)
            else:
                records, parameters = self._train(cfg, data, device)
            self._fill(row, check, cfg, args, records, parameters, planned, device)
            row.status = "ok"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - one configuration's failure must not end the check (DCP's
            # CheckpointException is a BaseException)
            row.reason = out_of_memory_line(exc, planned, card_bytes(device)) if _is_out_of_memory(exc) else one_line(exc)
        finally:
            self._release(device)
        row.wall_s = time.perf_counter() - started
        self.rows[check.name] = row
        return row

    def _train(self, cfg: MeshtrainConfig, data: DataPlan, device: torch.device) -> tuple[list[Record], int]:
        """The run's records and its model's parameter count."""
        from meshtrain.cluster.worker_plan import worker_plan
        from meshtrain.train.trainer import train

        if device.type == "cuda":
            set_matmul_precision(use_tf32(cfg.train.tf32, cfg.parallel.mixed_precision, device.type))
            torch.cuda.reset_peak_memory_stats(device)
        records: list[Record] = []
        result = train(worker_plan(cfg, data), WorkerLayout(), device, records.append)
        self._keep_diagnostics(records)
        return records, result.parameters

    def _train_resumed(self, cfg: MeshtrainConfig, data: DataPlan, device: torch.device) -> tuple[list[Record], int]:
        """Steps 1-5 with a checkpoint at step 5, then a second trainer that loads it and trains 6-10:
        the checkpoint's save and load on this device, held to the unbroken run's losses."""
        first = cfg.model_copy(deep=True)
        first.train.steps, first.checkpoint.enabled, first.checkpoint.interval = RESUME_AT, True, RESUME_AT
        first.checkpoint.mode = "sync"
        saved, _ = self._train(first, data, device)
        if not any(isinstance(r, CheckpointSaveRecord) and r.step == RESUME_AT for r in saved):
            raise RuntimeError(f"no checkpoint was saved at step {RESUME_AT}")
        self._release(device)
        second = cfg.model_copy(deep=True)
        second.checkpoint.enabled, second.checkpoint.interval, second.checkpoint.mode = True, 1000, "sync"
        resumed, parameters = self._train(second, data, device)
        if not any(isinstance(r, CheckpointLoadRecord) for r in resumed):
            raise RuntimeError("the second trainer loaded no checkpoint")
        steps = [r.step for r in resumed if isinstance(r, TrainRecord)]
        if not steps or steps[0] != RESUME_AT + 1:
            raise RuntimeError(f"the second trainer did not resume after step {RESUME_AT} (its first step: {steps[:1]})")
        return resumed, parameters

    def _keep_diagnostics(self, records: list[Record]) -> None:
        for record in records:
            if isinstance(record, ProfileRecord) and record.trace:
                self.trace = Path(record.trace)
            if isinstance(record, MemorySnapshotRecord) and record.path:
                self.snapshot = Path(record.path)

    def _fill(self, row: CheckRow, check: Check, cfg: MeshtrainConfig, args: Any, records: list[Record],
              parameters: int, planned: int, device: torch.device) -> None:
        train_records = {r.step: r for r in records if isinstance(r, TrainRecord)}
        if not train_records:
            raise RuntimeError("the run logged no training step")
        row.losses = {step: float(r.loss) for step, r in sorted(train_records.items())}
        row.final_loss = row.losses[max(row.losses)]
        if not all(math.isfinite(loss) for loss in row.losses.values()):
            raise RuntimeError(f"non-finite loss: {row.losses}")
        row.parameters = parameters
        row.planned_bytes = planned
        if device.type == "cuda":
            row.peak_bytes = torch.cuda.max_memory_allocated(device)
            row.alloc_retries = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
            row.measured_over_planned = row.peak_bytes / planned
        if check.kind == "throughput":
            timed = timed_figures(train_records, self.window)
            row.tokens_per_s = timed.tokens_per_s
            row.step_ms = 1000 * timed.step_s
            row.warmup_excess_s = max(0.0, train_records[self.window.warmup].elapsed_s - self.window.warmup * timed.step_s)
            peak, row.peak_source = device_peak(cfg, "cpu" if device.type == "cpu" else row.device or "cuda")
            if peak:
                row.mfu_full_attention = timed.tokens_per_s * flops_per_token(args, cfg.data.seq_len) / peak
                if timed.flops_per_token is not None:
                    row.mfu = timed.tokens_per_s * timed.flops_per_token / peak
        if check.reference is not None:
            reference = self.rows.get(check.reference)
            row.compared_with, row.bound = check.reference, check.bound
            if reference is None or reference.status != "ok":
                raise RuntimeError(f"its reference {check.reference} did not run")
            row.max_rel_diff = relative_difference(row.losses, reference.losses)
            assert check.bound is not None
            if not row.max_rel_diff <= check.bound:
                raise RuntimeError(
                    f"losses differ from {check.reference}'s by {row.max_rel_diff:.2e} relative (bound {check.bound:g})"
                )

    def _release(self, device: torch.device) -> None:
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


# --- output ---------------------------------------------------------------------------------

COLUMNS = ("config", "status", "tok/s", "MFU", "MFU full attn", "peak GiB", "plan GiB", "peak/plan",
           "alloc retries", "step ms", "warm-up excess s", "final loss", "vs reference", "wall s")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_row(row: CheckRow) -> str:
    status = row.status if row.reason is None else f"{row.status}: {row.reason}"
    compared = "-"
    if row.max_rel_diff is not None:
        compared = f"{row.max_rel_diff:.1e} vs {row.compared_with} (bound {row.bound:g})"
    cells = [
        row.name, status, _fmt(row.tokens_per_s, ",.0f"),
        "-" if row.mfu is None else f"{100 * row.mfu:.1f}%",
        "-" if row.mfu_full_attention is None else f"{100 * row.mfu_full_attention:.1f}%",
        "-" if row.peak_bytes is None else f"{row.peak_bytes / GIB:.2f}",
        "-" if row.planned_bytes is None else f"{row.planned_bytes / GIB:.2f}",
        _fmt(row.measured_over_planned, ".2f"), _fmt(row.alloc_retries, ",d"), _fmt(row.step_ms, ".1f"),
        _fmt(row.warmup_excess_s, ".1f"), _fmt(row.final_loss, ".4f"), compared, _fmt(row.wall_s, ".0f"),
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(rows: list[CheckRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + [table_row(row) for row in rows])


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        env["cuda"] = torch.version.cuda
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = None
    env["ray_imported"] = "ray" in sys.modules
    return env


def write_outputs(out: Path, rows: list[CheckRow], env: dict[str, Any], window: Window, runner: Runner | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    document = {"environment": env, "warmup_steps": window.warmup, "timed_steps": window.timed,
                "rows": [asdict(row) for row in rows], "table": table}
    for name, text in (("gpu_check.json", json.dumps(document, indent=2) + "\n"),
                       ("gpu_check.md", f"{heading(env)}\n\n{table}\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    if runner is not None:
        for source, name in ((runner.trace, "trace.json.gz"), (runner.snapshot, "memory_snapshot.pickle.gz")):
            if source is not None and source.is_file() and not (out / name).exists():
                _gzip_within_limit(source, out / name)


def _gzip_within_limit(source: Path, target: Path) -> None:
    with source.open("rb") as raw, gzip.open(target, "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed)
    if target.stat().st_size > FILE_LIMIT:
        target.unlink()
        print(f"[gpu_check] {source.name} is over {FILE_LIMIT // 2**20} MiB gzipped; left in {source.parent}")


def heading(env: dict[str, Any]) -> str:
    where = env.get("gpu") or "CPU (--cpu-smoke: the path only, not GPU figures)"
    return (f"gpu_check on {where}, torch {env['torch']}, torchao {env.get('torchao') or 'not installed'}; "
            f"ray imported: {'yes' if env['ray_imported'] else 'no'}")


# --- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with the debug shapes")
    parser.add_argument("--quick", action="store_true",
                        help="the correctness runs, 1B eager and compiled, and 8B-8-layer compiled with recompute")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="only configurations whose name matches (repeatable, comma-separated)")
    parser.add_argument("--data", default="stdlib",
                        help="data.source: a prepared token store (jobs/gpu_check_pack.py makes one), or a raw "
                        "source, prepared here without Ray (needs the datasets package); default %(default)s")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_check"),
                        help="run folders and prepared token stores (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write gpu_check.json, gpu_check.md, a trace and a snapshot here")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of a throughput configuration")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps first (compilation, allocator growth)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip configurations once this many seconds have passed (default 390, --quick 150)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help=f"no profiler trace ({TRACED}) and no allocator history ({SNAPSHOT})")
    parser.add_argument("--trace", default=TRACED, metavar="NAME",
                        help="the configuration whose step after the timed ones is traced (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = parser.parse_args(argv)
    args.only = [p.strip() for item in args.only for p in item.split(",") if p.strip()]
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.budget_s is None:
        args.budget_s = 150.0 if args.quick else 390.0
    if not any(check.name == args.trace for check in CHECKS):
        parser.error(f"--trace: {args.trace!r} is no configuration; see --list")
    return args


def selected(args: argparse.Namespace) -> list[Check]:
    chosen = [c for c in CHECKS if not args.quick or c.quick]
    if not args.only:
        return [c for c in chosen if not c.extra]
    for pattern in args.only:
        if not any(fnmatch.fnmatch(c.name, pattern) for c in CHECKS):
            raise ConfigError(f"--only: {pattern!r} matches no configuration; see --list")
    wanted = {c.name for c in chosen if any(fnmatch.fnmatch(c.name, p) for p in args.only)}
    # A comparison needs its reference: run it too.
    for check in list(chosen):
        if check.name in wanted and check.reference is not None:
            wanted.add(check.reference)
            reference = next(c for c in CHECKS if c.name == check.reference)
            if reference.reference is not None:
                wanted.add(reference.reference)
    return [c for c in CHECKS if c.name in wanted]


def init_single_rank(device: torch.device) -> None:
    """A process group of one rank, so that fully_shard builds a real one-device mesh."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for check in CHECKS:
            quick = " (--quick)" if check.quick else " (--only)" if check.extra else ""
            print(f"{check.name}{quick}: {check.kind}; " + " ".join(f"{k}={v}" for k, v in check.settings.items()))
        return 0
    try:  # the arguments first: a bad name is the line to fix on any machine
        checks = selected(args)
    except ConfigError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    try:
        check_torch()
    except UnsupportedTorch as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__} sees none); run "
              "python jobs/gpu_check.py --cpu-smoke to check the same path on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if not args.cpu_smoke else torch.device("cpu")
    window = Window.for_request(args.warmup, args.steps)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    init_single_rank(device)
    runner = Runner(device, args.work.resolve(), args.data, window, args.profile, args.trace)
    env = environment()
    print(f"[gpu_check] {heading(env)}; {len(checks)} configurations, budget {args.budget_s:.0f}s", flush=True)
    began = time.perf_counter()
    rows: list[CheckRow] = []
    try:
        for index, check in enumerate(checks, 1):
            spent = time.perf_counter() - began
            if spent > args.budget_s:
                row = CheckRow(check.name, "skipped", f"time budget: {spent:.0f}s of --budget-s {args.budget_s:.0f} spent")
            else:
                print(f"[gpu_check] {index}/{len(checks)} {check.name}", flush=True)
                row = runner.run(check, args.cpu_smoke)
            rows.append(row)
            print(table_row(row), flush=True)
            if args.out is not None:  # after every configuration: a killed check keeps what it measured
                write_outputs(args.out, rows, environment(), window, runner)
    finally:
        dist.destroy_process_group()
    env = environment()
    print()
    print(heading(env))
    print(format_table(rows))
    print(f"[gpu_check] {time.perf_counter() - began:.0f}s in all; "
          f"{sum(r.status == 'ok' for r in rows)} ok, {sum(r.status == 'failed' for r in rows)} failed, "
          f"{sum(r.status == 'skipped' for r in rows)} skipped")
    if args.out is not None:
        write_outputs(args.out, rows, env, window, runner)
        print(f"[gpu_check] wrote {args.out}/gpu_check.json and gpu_check.md")
    return 0 if all(row.status != "failed" for row in rows) else 1
