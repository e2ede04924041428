"""What the Prometheus metrics cost the default job: tokens/s with and without the exporter.

Run with ``python jobs/bench_metrics.py`` (its docstring shows examples; ``--help`` lists the options).

Each pair runs ``jobs/pretrain.py`` once with ``metrics.port=0`` (no exporter) and once with the
default exporter while a scraper reads every worker's /metrics at ``--scrape-interval`` (from the
run's file_sd targets file, like Prometheus). The order alternates between pairs so drift on the
machine cancels. Also times the per-step and per-log metric updates in this process. Prints each
job's mean tokens/s and the ratio with/without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client import generate_latest

from meshtrain.observe.metrics import TrainingMetrics
from meshtrain.observe.run_folder import TrainRecord

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run its jobs/ and read its configs


def scrape_forever(targets: Path, interval_s: float, stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(interval_s):
        try:
            groups = json.loads(targets.read_text())
        except (OSError, ValueError):
            continue
        for target in (t for group in groups for t in group["targets"]):
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
                    response.read()
                counts[0] += 1
            except OSError:
                pass


def run_job(storage: Path, name: str, exporter: bool, scrape_interval: float, overrides: list[str]) -> float:
    args = [
        sys.executable, "jobs/pretrain.py", f"run.storage_path={storage}", f"run.name={name}",
        "checkpoint.enabled=false", *overrides,
    ]
    args += ["metrics.bind_address=127.0.0.1"] if exporter else ["metrics.port=0"]
    stop, counts = threading.Event(), [0]
    scraper = threading.Thread(
        target=scrape_forever, args=(storage / "prometheus" / f"{name}.json", scrape_interval, stop, counts)
    )
    if exporter:
        scraper.start()
    try:
        subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
    finally:
        stop.set()
        if exporter:
            scraper.join()
    summary = json.loads((storage / name / "summary.json").read_text())
    label = f"with exporter ({counts[0]} scrapes)" if exporter else "without exporter"
    print(f"{name}: {label}: {summary['mean_tokens_per_s']:,.0f} tok/s, train {summary['train_time_s']:.1f}s", flush=True)
    return summary["mean_tokens_per_s"]


def update_cost_us() -> tuple[float, float, float]:
    """Microseconds per step_done() call, per logged() call, and per scrape (rendering /metrics)."""
    metrics = TrainingMetrics(
        run="bench", rank=0, node="127.0.0.1", device=torch.device("cpu"), flops_per_token=1e6, peak_flops_per_s=1e11
    )
    metrics.start_steps(0, 0)
    calls = 20000
    started = time.perf_counter()
    for step in range(calls):
        metrics.step_done(step, 1024, 0.001)
    per_step = (time.perf_counter() - started) / calls * 1e6
    record = TrainRecord(step=1, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=10, tokens_per_s=1e4, step_time_s=0.1,
                         data_wait_s=0.0, interval_steps=1, elapsed_s=0.1, skipped_steps=0, world_size=2,
                         time=time.time(), samples=[0, 8])
    started = time.perf_counter()
    for _ in range(calls // 10):
        metrics.step_done(0, 1024, 0.001)
        metrics.logged(record, 2)
    per_log = (time.perf_counter() - started) / (calls // 10) * 1e6 - per_step
    scrapes = 500
    started = time.perf_counter()
    for _ in range(scrapes):
        generate_latest(metrics.registry)
    per_scrape = (time.perf_counter() - started) / scrapes * 1e6
    return per_step, per_log, per_scrape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("overrides", nargs="*", help="dotted key=value settings for every job")
    args = parser.parse_args()

    per_step, per_log, per_scrape = update_cost_us()
    print(
        f"metric updates: {per_step:.1f} us per step, {per_log:.1f} us more per logged step; "
        f"{per_scrape:.0f} us to render one scrape",
        flush=True,
    )
    with_exporter: list[float] = []
    without: list[float] = []
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-metrics-") as tmp:
        storage = Path(tmp)
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for exporter in order:
                name = f"pair{pair}-{'on' if exporter else 'off'}"
                tokens_per_s = run_job(storage, name, exporter, args.scrape_interval, args.overrides)
                (with_exporter if exporter else without).append(tokens_per_s)
    on, off = statistics.mean(with_exporter), statistics.mean(without)
    spread = max(without) / min(without) - 1 if len(without) > 1 else 0.0
    print(
        f"mean tok/s: without exporter {off:,.0f}, with exporter {on:,.0f}; ratio with/without {on / off:.3f} "
        f"(run-to-run spread without exporter {spread:.1%})"
    )


