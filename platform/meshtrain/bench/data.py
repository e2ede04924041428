"""Benchmark the token store: prepare throughput on 1 and 2 CPUs, and launch-to-first-step time (median of
--launches) and worker memory with a cached store, for a small and a 20x larger synthetic corpus.

Run with ``python jobs/bench_data.py`` (its docstring shows examples; ``--help`` lists the options).

The corpora are jsonl files made from the standard library's sources (each copy of a document is
prefixed with its copy number, so no two documents are identical). One tokenizer is trained first and
shared, so the prepare figures measure tokenization and writing only. Prints one table and the
ratios the design aims for: large/small launch-to-first-step and worker RSS (goal <= 1.2), and
prepare throughput on 2 CPUs over 1 CPU (goal >= 1.7).
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
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[3]  # the checkout: benchmarks run its jobs/ and read its configs

from meshtrain.data import stdlib_source_files

FILE_BYTES = 8 * 2**20


def make_corpus(folder: Path, megabytes: int) -> Path:
    """jsonl files of about FILE_BYTES each, until the corpus holds ``megabytes`` of text."""
    done = folder / "COMPLETE"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    texts = [p.read_text() for p in stdlib_source_files()]
    target, written, copy, index = megabytes * 2**20, 0, 0, 0
    out = None
    while written < target:
        for text in texts:
            if out is None or out.tell() >= FILE_BYTES:
                if out is not None:
                    out.close()
                out = (folder / f"part-{index:05d}.jsonl").open("w")
                index += 1
            document = f"# copy {copy}\n{text}"
            out.write(json.dumps({"text": document}) + "\n")
            written += len(document)
            if written >= target:
                break
        copy += 1
    assert out is not None
    out.close()
    done.write_text("")
    return folder


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def run(command: list[str]) -> str:
    result = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def prepare(corpus: Path, output: Path, tokenizer: Path, cpus: int) -> tuple[float, int, str]:
    """Prepare ``corpus`` from scratch with ``cpus`` tasks in flight: (tokens/s, tokens, store)."""
    shutil.rmtree(output, ignore_errors=True)
    stdout = run([sys.executable, "jobs/prepare_data.py", "--output", str(output), f"--max-parallel={cpus}",
                  f"data.source={corpus}", f"data.tokenizer={tokenizer}", "metrics.progress_interval_s=600"])
    match = re.search(r"prepared .*: ([\d,]+) tokens in .* \(([\d,]+) tok/s\) -> (\S+)", stdout)
    if match is None:
        raise SystemExit(f"no prepare line in:\n{stdout}")
    return float(match[2].replace(",", "")), int(match[1].replace(",", "")), match[3]


class WorkerMemory(threading.Thread):
    """Largest resident set of any Ray Train worker process while the job runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def run(self) -> None:
        while self.running:
            for process in psutil.process_iter(["cmdline", "memory_info"]):
                cmdline = " ".join(process.info["cmdline"] or [])
                if "RayTrainWorker" in cmdline and process.info["memory_info"] is not None:
                    self.peak = max(self.peak, process.info["memory_info"].rss)
            time.sleep(0.2)


def first_step(store: str, storage: Path, name: str) -> tuple[float, int]:
    """(seconds from launching jobs/pretrain.py to its first logged step, peak worker RSS)."""
    run_dir = storage / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "jobs/pretrain.py", f"data.source={store}", "train.steps=20", "optim.warmup_steps=5",
               "train.log_every=1",
               f"run.storage_path={storage}", f"run.name={name}", "checkpoint.enabled=false", "metrics.port=0"]
    memory = WorkerMemory()
    memory.start()
    started = time.perf_counter()
    job = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, first = run_dir / "metrics.jsonl", None
    while job.poll() is None:
        if first is None and metrics.exists() and '"event": "train"' in metrics.read_text():
            first = time.perf_counter() - started
        time.sleep(0.05)
    memory.running = False
    output = job.stdout.read() if job.stdout else ""
    if job.returncode or first is None:
        raise SystemExit(f"pretrain failed ({job.returncode}):\n{output}")
    return first, memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs=2, default=[10, 200], help="small and large corpus, MB of text")
    parser.add_argument("--launches", type=int, default=3, help="launches per corpus; the median time is shown")
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-data", help="corpora, stores and runs go here")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpora = {size: make_corpus(work / f"corpus-{size}mb", size) for size in args.sizes_mb}

    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        from meshtrain.config import SourceConfig
        from meshtrain.data.sources import plan_source
        from meshtrain.data.tokenizer import sample_documents, train_tokenizer

        small = plan_source(SourceConfig(source=str(corpora[args.sizes_mb[0]])), 64 * 2**20)
        train_tokenizer(sample_documents([small], [1.0], 8 * 2**20), 2048).save(str(tokenizer))

    rows = {}
    for size, corpus in corpora.items():
        rate1, tokens, _ = prepare(corpus, work / f"stores-{size}-1cpu", tokenizer, 1)
        rate2, _, store = prepare(corpus, work / f"stores-{size}-2cpu", tokenizer, 2)
        launches = [first_step(store, work / "runs", f"first-step-{size}mb") for _ in range(args.launches)]
        seconds = statistics.median(t for t, _ in launches)
        rss = max(r for _, r in launches)
        rows[size] = (tokens, rate1, rate2, seconds, rss)
        print(f"{size} MB: {tokens:,} tokens; prepare {rate1:,.0f} tok/s (1 CPU), {rate2:,.0f} tok/s (2 CPUs); "
              f"launch to first step {seconds:.1f}s; worker peak RSS {rss / 2**20:,.0f} MiB", flush=True)

    small, large = args.sizes_mb
    print()
    print("| corpus | tokens | prepare 1 CPU (tok/s) | prepare 2 CPUs (tok/s) | 2/1 | launch to first step (s) | worker peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for size, (tokens, rate1, rate2, seconds, rss) in rows.items():
        print(f"| {size} MB | {tokens:,} | {rate1:,.0f} | {rate2:,.0f} | {rate2 / rate1:.2f} | {seconds:.1f} | {rss / 2**20:,.0f} |")
    print()
    print(f"launch-to-first-step large/small: {rows[large][3] / rows[small][3]:.2f} (goal <= 1.2)")
    print(f"worker peak RSS large/small: {rows[large][4] / rows[small][4]:.2f} (goal <= 1.2)")
    print(f"prepare throughput 2 CPUs / 1 CPU on the large corpus: {rows[large][2] / rows[large][1]:.2f} (goal >= 1.7)")


