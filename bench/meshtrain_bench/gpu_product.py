"""The product path on one GPU: ``jobs/pretrain.py`` through a local Ray, against the in-process trainer.

Run with ``python jobs/gpu_product.py`` on a GPU machine (``--help`` lists the options; the device
command is ``meshtrain_bench.device_pack.PRODUCT_COMMAND``). Two parts, bounded to 150 s and 300 s
(``--timeout-s``), so one device call of 540 s holds it with time to spare:

1. **In process**: ``jobs/gpu_check.py --only 1b-compile-sel-mb4`` (Llama 3.2 1B, seq 4096, bf16,
   compiled, selective recompute, 4 sequences per step), the reference for the speed through Ray.
2. **Through Ray**: ``jobs/pretrain.py`` with the same settings on one GPU worker of a local Ray head,
   async DCP checkpoints to local disk every ``--interval`` steps, the worker's Prometheus endpoint
   scraped every half second, and the worker SIGKILLed before step ``--kill-at`` (``fault.kill_rank=0``)
   so Ray restarts it and the run resumes from its newest checkpoint. From the run's records and scrapes:

   * tokens/s through Ray (first-time steps after the warm-up, before the kill) over the in-process
     row's (goal >= 0.98);
   * async saves: the mean time of the steps a save overlaps against the other steps after the warm-up,
     the save's blocking seconds, and what both cost over one checkpoint interval (goal <= 2%);
   * the kill: seconds from the last step before it to the first step after the resume, and the steps
     redone;
   * Prometheus against the trainer: the scraped peak CUDA allocation against ``result.json``'s, and the
     scraped ``meshtrain_mfu_ratio`` against the MFU of the same step's ``train`` record.

Replica mode is not run: a worker holds one whole GPU (``scaling.use_gpu``), so two replica groups on one
GPU would need fractional GPUs, and NCCL refuses two ranks of one communicator on the same device; the
replica-over-restart ratio is measured on CPU workers by ``jobs/bench_recovery.py``.

``--cpu-smoke`` runs the same path with the debug shapes on CPU workers (no compile: Inductor's C++
build would dominate); its figures say nothing about GPUs. With ``--out DIR``: ``gpu_product.json`` and
``gpu_product.md``, and the in-process check's own files under ``in_process/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.observe.run_folder import CheckpointSaveRecord, ReadRecord, TrainRecord, read_records
from meshtrain_bench.gpu_check import CHECKS, for_cpu
from meshtrain_bench.recovery import WARMUP_STEPS, first_time_steps, kill_gap, steady, steps_redone, tokens_per_s

REPO = Path(__file__).resolve().parents[2]
REFERENCE = "1b-compile-sel-mb4"  # the in-process check's configuration with the product path's settings
RUN = "product"
PORT = 9800
IN_PROCESS_TIMEOUT_S = 150
# What the product path owns over the reference's settings: Ray's single GPU worker, checkpoints, metrics.
OWNED = {
    "run.name": RUN, "scaling.num_workers": 1, "train.log_every": 1, "metrics.progress_interval_s": 0,
    "metrics.port": PORT, "metrics.bind_address": "127.0.0.1", "eval.interval": None, "checkpoint.mode": "async",
    "checkpoint.keep": 1, "run.max_failures": 1, "fault.kill_rank": 0, "optim.lr": 3e-4, "optim.schedule": "constant",
    "optim.warmup_steps": 0,
}


@dataclass
class Scrapes:
    """What the scraper read from the worker's /metrics: per logged step, the MFU gauge; the largest
    peak CUDA allocation (the RSS on CPU workers) seen."""

    mfu_by_step: dict[int, float] = field(default_factory=dict)
    peak_device_bytes: float | None = None
    peak_flops_per_s: float | None = None
    ok: int = 0
    failed: int = 0


@dataclass
class ProductReport:
    device: str
    settings: dict[str, Any]
    in_process_tokens_per_s: float | None = None
    in_process_error: str | None = None
    exit_code: int | None = None
    error: str | None = None
    ray_tokens_per_s: float | None = None
    ray_over_in_process: float | None = None
    step_s_saving: float | None = None
    step_s_not_saving: float | None = None
    save_blocking_s: float | None = None
    save_total_s: float | None = None
    save_cost_over_interval: float | None = None
    kill_to_first_step_s: float | None = None
    kill_to_new_step_s: float | None = None
    steps_redone: int | None = None
    prometheus_peak_bytes: float | None = None
    trainer_peak_bytes: int | None = None
    prometheus_mfu: float | None = None
    trainer_mfu: float | None = None
    mfu_max_rel_diff: float | None = None
    scrapes_ok: int = 0
    wall_s: float | None = None
    replica_mode: str = ("not run: one GPU per worker (scaling.use_gpu), and NCCL refuses two ranks of a "
                         "communicator on one device; measured on CPU workers by jobs/bench_recovery.py")


# --- settings -------------------------------------------------------------------------------------------


def product_settings(cpu: bool, data: str, storage: Path, steps: int, interval: int, kill_at: int) -> dict[str, Any]:
    reference = next(c for c in CHECKS if c.name == REFERENCE).settings
    settings = for_cpu(reference) if cpu else dict(reference)
    return {**settings, **OWNED, "scaling.use_gpu": not cpu, "data.source": data, "run.storage_path": str(storage),
            "train.steps": steps, "checkpoint.interval": interval, "fault.at_step": kill_at}


def overrides(settings: dict[str, Any]) -> list[str]:
    return [f"{key}={json.dumps(value) if value is None or isinstance(value, bool) else value}"
            for key, value in settings.items()]


# --- the scraper ----------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(meshtrain_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Each meshtrain sample's value by metric name (one worker: one labelled series per name)."""
    values = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(3) != "NaN":
            values[match.group(1)] = float(match.group(3))
    return values


def scrape(url: str, scrapes: Scrapes, stop: threading.Event, every_s: float = 0.5) -> None:
    while not stop.wait(every_s):
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                values = parse_metrics(response.read().decode())
        except OSError:  # the worker is starting, restarting or gone
            scrapes.failed += 1
            continue
        scrapes.ok += 1
        if "meshtrain_step" in values and values.get("meshtrain_mfu_ratio"):
            scrapes.mfu_by_step[int(values["meshtrain_step"])] = values["meshtrain_mfu_ratio"]
        peak = values.get("meshtrain_cuda_memory_peak_allocated_bytes", values.get("meshtrain_process_resident_memory_bytes"))
        if peak is not None:
            scrapes.peak_device_bytes = max(peak, scrapes.peak_device_bytes or 0.0)
        if values.get("meshtrain_device_peak_flops_per_second"):
            scrapes.peak_flops_per_s = values["meshtrain_device_peak_flops_per_second"]


# --- figures from the records -----------------------------------------------------------------------------


def saving_split(records: list[ReadRecord], before: int | None) -> tuple[list[float], list[float], list[CheckpointSaveRecord]]:
    """(step times while a save was in flight, the other step times, the saves): a save of step s runs
    from the end of step s for its ``total_s``; a step overlaps it when it starts before the save ends."""
    steps = steady(records, before)
    ends = {r.step: r.time for r in first_time_steps(records)}
    saves = [r for r in records if isinstance(r, CheckpointSaveRecord) and r.step in ends
             and (before is None or r.step < before)]
    windows = [(ends[s.step], ends[s.step] + s.total_s) for s in saves]
    saving, quiet = [], []
    for r in steps:
        start = r.time - r.step_time_s
        (saving if any(begin <= start < end for begin, end in windows) else quiet).append(r.step_time_s)
    return saving, quiet, saves


def record_mfu(record: TrainRecord, peak_flops_per_s: float) -> float | None:
    if record.flops_per_token is None:
        return None
    return record.tokens_per_s * record.flops_per_token / peak_flops_per_s


def fill_from_run(report: ProductReport, records: list[ReadRecord], result: dict[str, Any], scrapes: Scrapes,
                  interval: int, kill_at: int) -> None:
    if steady(records, kill_at):  # first-time steps after recovery's warm-up (compilation, the allocator's growth)
        report.ray_tokens_per_s = tokens_per_s(records, kill_at)
    saving, quiet, saves = saving_split(records, kill_at)
    if saving and quiet and saves:
        report.step_s_saving, report.step_s_not_saving = statistics.fmean(saving), statistics.fmean(quiet)
        report.save_blocking_s = statistics.fmean(s.blocking_s for s in saves)
        report.save_total_s = statistics.fmean(s.total_s for s in saves)
        slowed = sum(t - report.step_s_not_saving for t in saving) / len(saves)
        report.save_cost_over_interval = (report.save_blocking_s + slowed) / (interval * report.step_s_not_saving)
    report.kill_to_first_step_s, report.kill_to_new_step_s = kill_gap(records, kill_at)
    report.steps_redone = steps_redone(records)
    report.prometheus_peak_bytes = scrapes.peak_device_bytes
    report.trainer_peak_bytes = result.get("peak_device_memory_bytes") or result.get("peak_host_rss_bytes")
    report.scrapes_ok = scrapes.ok
    if scrapes.peak_flops_per_s:
        own = {r.step: record_mfu(r, scrapes.peak_flops_per_s) for r in first_time_steps(records)}
        # The step gauge moves when a step ends, the MFU gauge when its record is logged just after: a
        # scrape between the two reads step N with step N-1's MFU.
        pairs = []
        for step, scraped in scrapes.mfu_by_step.items():
            candidates = [own[s] for s in (step, step - 1) if s > WARMUP_STEPS and own.get(s)]
            if candidates:
                pairs.append((scraped, min(candidates, key=lambda value: abs(value - scraped))))
        if pairs:
            report.prometheus_mfu = statistics.fmean(p[0] for p in pairs)
            report.trainer_mfu = statistics.fmean(p[1] for p in pairs)
            report.mfu_max_rel_diff = max(abs(a - b) / b for a, b in pairs)


# --- the two parts ----------------------------------------------------------------------------------------


def in_process(cpu: bool, data: str, work: Path, out: Path | None, timeout_s: float) -> tuple[float | None, str | None]:
    """The reference row's tokens/s from jobs/gpu_check.py, or why there is none."""
    target = (out or work) / "in_process"
    command = [sys.executable, "jobs/gpu_check.py", "--only", REFERENCE, "--no-profile", "--data", data,
               "--work", str(work / "in_process"), "--out", str(target), *(["--cpu-smoke"] if cpu else [])]
    try:
        subprocess.run(command, cwd=REPO, timeout=timeout_s, check=False)
        rows = json.loads((target / "gpu_check.json").read_text())["rows"]
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    row = next((r for r in rows if r["name"] == REFERENCE), None)
    if row is None or row["status"] != "ok":
        return None, (row or {}).get("reason") or "no row"
    return row["tokens_per_s"], None


def through_ray(report: ProductReport, settings: dict[str, Any], storage: Path, interval: int, kill_at: int,
                timeout_s: float) -> None:
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_TRAIN_")}
    scrapes, stop = Scrapes(), threading.Event()
    scraper = threading.Thread(target=scrape, args=(f"http://127.0.0.1:{PORT}/metrics", scrapes, stop), daemon=True)
    scraper.start()
    log = storage / "job.log"
    with log.open("w") as output:
        try:
            report.exit_code = subprocess.run([sys.executable, "jobs/pretrain.py", *overrides(settings)], cwd=REPO,
                                              env=env, stdout=output, stderr=subprocess.STDOUT,
                                              timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            report.exit_code = -1
    stop.set()
    scraper.join()
    text = log.read_text()
    print(text[-4000:], flush=True)
    folder = storage / RUN
    if report.exit_code != 0 or not (folder / "result.json").is_file():
        report.error = f"exit {report.exit_code}; " + (text.strip().splitlines() or ["no output"])[-1][:300]
        return
    fill_from_run(report, read_records(folder / "metrics.jsonl"), json.loads((folder / "result.json").read_text()),
                  scrapes, interval, kill_at)
    if report.ray_tokens_per_s and report.in_process_tokens_per_s:
        report.ray_over_in_process = report.ray_tokens_per_s / report.in_process_tokens_per_s


# --- output ------------------------------------------------------------------------------------------------


def _n(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: ProductReport) -> str:
    gib = 2**30
    rows = [
        ("tokens/s: in process / through Ray", f"{_n(report.in_process_tokens_per_s, ',.0f')} / "
         f"{_n(report.ray_tokens_per_s, ',.0f')}", f"{_n(report.ray_over_in_process, '.3f')} (goal >= 0.98)"),
        ("step s: while an async save runs / not", f"{_n(report.step_s_saving, '.4f')} / {_n(report.step_s_not_saving, '.4f')}",
         f"save blocks {_n(report.save_blocking_s, '.3f')} s, commits after {_n(report.save_total_s, '.2f')} s; "
         f"{_n(report.save_cost_over_interval, '.2%')} of an interval (goal <= 2%)"),
        ("SIGKILL before a step: to the first step after the resume / to a new step",
         f"{_n(report.kill_to_first_step_s, '.1f')} s / {_n(report.kill_to_new_step_s, '.1f')} s",
         f"{_n(report.steps_redone, 'd')} steps redone"),
        ("peak memory GiB: Prometheus / the trainer", f"{_n(report.prometheus_peak_bytes and report.prometheus_peak_bytes / gib, '.2f')} / "
         f"{_n(report.trainer_peak_bytes and report.trainer_peak_bytes / gib, '.2f')}", f"{report.scrapes_ok} scrapes"),
        ("MFU: Prometheus / the trainer's records", f"{_n(report.prometheus_mfu, '.1%')} / {_n(report.trainer_mfu, '.1%')}",
         f"largest difference on one step {_n(report.mfu_max_rel_diff, '.1e')} relative"),
        ("replica mode / restart mode", "-", report.replica_mode),
    ]
    lines = ["| figure | measured | against |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    if report.error or report.in_process_error:
        lines.append(f"\nfailed: {report.error or ''} {report.in_process_error or ''}".rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU workers and the debug shapes")
    parser.add_argument("--data", default="stdlib", help="data.source: a prepared token store (default %(default)s)")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_product"), help="run folders (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write gpu_product.json and gpu_product.md here")
    # A 1B checkpoint with its Adam state is about 15 GB: 20 steps (about 6 s on an H200) after a save
    # starts, it has committed, so the resume redoes the steps since it and not those since the one before.
    parser.add_argument("--steps", type=int, default=75, help="steps of the Ray run (default %(default)s)")
    parser.add_argument("--interval", type=int, default=25, help="checkpoint.interval (default %(default)s)")
    parser.add_argument("--kill-at", type=int, default=70, help="the worker is killed before this step (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=300, help="seconds for the Ray run (default %(default)s)")
    args = parser.parse_args(argv)
    if not WARMUP_STEPS + args.interval < args.kill_at <= args.steps:
        parser.error(f"--kill-at must be after one checkpoint past the warm-up ({WARMUP_STEPS + args.interval + 1}) "
                     f"and at most --steps ({args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"gpu_product: no CUDA GPU here (torch {torch.__version__} sees none); run "
              "python jobs/gpu_product.py --cpu-smoke to check the same path on the CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    work = args.work.resolve()
    data = str(Path(args.data).resolve()) if Path(args.data).exists() else args.data
    settings = product_settings(args.cpu_smoke, data, work / "ray", args.steps, args.interval, args.kill_at)
    device = "cpu (--cpu-smoke: the path only, not GPU figures)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    report = ProductReport(device=device, settings=settings)
    print(f"[gpu_product] {device}: in process ({REFERENCE}) ...", flush=True)
    report.in_process_tokens_per_s, report.in_process_error = in_process(args.cpu_smoke, data, work, args.out,
                                                                      IN_PROCESS_TIMEOUT_S)
    print(f"[gpu_product] through Ray: {args.steps} steps, async checkpoints every {args.interval}, "
          f"the worker killed before step {args.kill_at} ...", flush=True)
    through_ray(report, settings, work / "ray", args.interval, args.kill_at, args.timeout_s)
    report.wall_s = time.perf_counter() - started
    table = format_report(report)
    print(f"\n[gpu_product] {device}, {report.wall_s:.0f} s\n{table}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_product.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        (args.out / "gpu_product.md").write_text(f"# The product path on {device}\n\n{table}\n")
    return 0 if report.error is None and report.in_process_error is None else 1
