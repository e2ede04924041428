"""Benchmark the token store: what checking every read costs, prepare throughput on 1 and 2 CPUs, and
launch-to-first-step time (median of --launches) and worker memory with a cached store, for a small and
a 20x larger synthetic corpus.

The verification cost comes first and takes about a minute (``--verification-only`` stops there):
one rank's batches are read from a store written directly, checked (blocks against the shards'
.crc32 lists, tokens against the vocabulary) and unchecked (as reads were before the checks), the
two taking the same windows step by step in turn. Two figures per sequence length, each the wait
for a step's batches (the trainer's ``data_wait_s``): with the reads in the step
(``data.read_ahead_steps=0``: the checks' whole cost is in it) and with the default read-ahead while
a simulated step of --step-ms runs; the goal is a checked/unchecked ratio <= 1.02 for the latter.

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
from typing import Any

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run its jobs/ and read its configs

from meshtrain.data import stdlib_source_files
from meshtrain.observe.run_folder import TrainRecord, read_records

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
        if first is None and read_records(metrics, TrainRecord):
            first = time.perf_counter() - started
        time.sleep(0.05)
    memory.running = False
    output = job.stdout.read() if job.stdout else ""
    if job.returncode or first is None:
        raise SystemExit(f"pretrain failed ({job.returncode}):\n{output}")
    return first, memory.peak


def flip_token_bit(store: str, token: int, bit: int) -> tuple[Path, int]:
    """Flip bit ``bit`` (0 = lowest) of token ``token`` (its position in the stream) in a local store's
    shard, leaving the shard's size and checksum lists as they were, as a bad disk would: a read of
    that token then fails with :class:`~meshtrain.data.integrity.CorruptTokens`. Returns the shard's
    path and the byte changed in it. Shards are ``<store>/shard-NNNNNN.bin``, little-endian tokens."""
    from meshtrain.data.store import TokenStore
    from meshtrain.data.store_format import shard_name

    tokens = TokenStore(store)
    tokens.close()
    if not tokens.location.is_local:
        raise ValueError(f"{store} is not a local store; flip bits in a local copy")
    itemsize = tokens.dtype.itemsize
    if not 0 <= token < len(tokens) or not 0 <= bit < 8 * itemsize:
        raise ValueError(f"token {token} bit {bit} is not in {store} ({len(tokens)} tokens of {8 * itemsize} bits)")
    shard = tokens.index.shard_of(token)
    byte = (token - tokens.index.start(shard)) * itemsize + bit // 8
    path = Path(tokens.location.path(shard_name(shard)))
    with open(path, "r+b") as handle:
        handle.seek(byte)
        value = handle.read(1)[0] ^ (1 << bit % 8)
        handle.seek(byte)
        handle.write(bytes([value]))
    return path, byte


class UncheckedReads:
    """A store's stream read as it was before reads were checked: positional reads of exactly the bytes
    asked for, no checksum and no vocabulary check (the baseline of the verification cost)."""

    def __init__(self, store: Any) -> None:
        from meshtrain.data.open_files import OpenFiles

        self.store, self.files = store, OpenFiles()

    def __len__(self) -> int:
        return len(self.store)

    def read(self, start: int, stop: int) -> np.ndarray:
        from meshtrain.data.store_format import shard_name

        index, itemsize, dtype = self.store.index, self.store.dtype.itemsize, self.store.dtype
        shard, position, pieces = index.shard_of(start), start, []
        while position < stop:
            shard_start, end = index.start(shard), min(stop, index.end(shard))
            if end > position:
                offset, size = (position - shard_start) * itemsize, (end - position) * itemsize
                data = self.files.read(self.store.location.path(shard_name(shard)), offset, size)
                pieces.append(np.frombuffer(data, dtype=dtype))
            position, shard = end, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _paired_waits(streams: dict[str, Any], seq_len: int, steps: int, batch: int, read_ahead: int,
                  step_s: float) -> dict[str, list[float]]:
    """Seconds the calling thread waits for each step's batches (the trainer's ``data_wait_s``), one
    rank reading the same windows from each stream: the streams take steps in turn (the first one
    alternating), each step followed by ``step_s`` of sleep, so load that comes and goes on a shared
    machine weighs on both. Python's automatic garbage collection is off meanwhile, as the trainer
    has it (``train.gc_every``)."""
    import gc

    import torch

    from meshtrain.config import DataConfig
    from meshtrain.data import DataParallelBatches, PackedSequences

    threads = DataConfig().read_threads
    batches = {name: DataParallelBatches(PackedSequences(stream, seq_len, 0), batch, 8, 0, 1, torch.device("cpu"),
                                         read_ahead_steps=read_ahead, read_threads=threads)
               for name, stream in streams.items()}
    waits: dict[str, list[float]] = {name: [] for name in streams}
    gc.collect()
    gc.disable()
    try:
        for step in range(steps):
            for name in (list(streams) if step % 2 else list(streams)[::-1]):
                started = time.perf_counter()
                list(batches[name].next_step())
                waits[name].append(time.perf_counter() - started)
                time.sleep(step_s)
    finally:
        gc.enable()
        for reader in batches.values():
            reader.close()
    return {name: times[read_ahead:] for name, times in waits.items()}  # from the first step read ahead


def verification_cost(work: Path, seq_lens: list[int], batch: int, steps: int, step_s: float) -> None:
    """Print, per sequence length, one rank's data-path time per step with checked and unchecked reads."""
    from meshtrain_bench.synthetic_store import write_store
    from meshtrain.config import DataConfig
    from meshtrain.data import TokenStore

    summary = write_store(work / "verify-store", shards=64, tokens_per_shard=1 << 20, sparse=False)
    checked = TokenStore(summary["url"])
    streams = {"unchecked": UncheckedReads(checked), "checked": checked}
    read_ahead = DataConfig().read_ahead_steps
    print(f"verification cost: {summary['tokens']:,}-token uint16 store with .crc32 lists, {batch} samples per step on "
          f"one rank (micro-batches of 8), {steps} steps each way; ms per step (medians), ratio = median of the "
          "steps' checked / unchecked")
    print("| seq_len | bytes read / step | in the step (read_ahead_steps=0): unchecked | checked | ratio | "
          f"with read-ahead {read_ahead} and {step_s * 1000:.0f} ms steps: unchecked | checked | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        cells = [f"{seq_len}", f"{batch * (seq_len + 1) * 2:,}"]
        for ahead, pause in ((0, 0.0), (read_ahead, step_s)):
            waits = _paired_waits(streams, seq_len, steps, batch, ahead, pause)
            plain, verified = waits["unchecked"], waits["checked"]
            ratio = statistics.median(v / p for v, p in zip(verified, plain))
            cells += [f"{statistics.median(plain) * 1000:.2f}", f"{statistics.median(verified) * 1000:.2f}",
                      f"{ratio:.3f}"]
        print(f"| {' | '.join(cells)} |", flush=True)
    checked.close()
    print("goal: checked / unchecked <= 1.02 with read-ahead (the default: a step's reads and their checks run in "
          "the reader threads while the step before trains)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs=2, default=[10, 200], help="small and large corpus, MB of text")
    parser.add_argument("--launches", type=int, default=3, help="launches per corpus; the median time is shown")
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-data", help="corpora, stores and runs go here")
    parser.add_argument("--verify-seq-lens", type=int, nargs="+", default=[2048, 8192],
                        help="sequence lengths of the verification cost")
    parser.add_argument("--verify-batch", type=int, default=64,
                        help="one rank's samples per step in the verification cost")
    parser.add_argument("--verify-steps", type=int, default=200, help="steps each way in the verification cost")
    parser.add_argument("--step-ms", type=float, default=50.0, help="simulated step time while reading ahead")
    parser.add_argument("--verification-only", action="store_true", help="measure the verification cost only")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    verification_cost(work, args.verify_seq_lens, args.verify_batch, args.verify_steps, args.step_ms / 1000)
    if args.verification_only:
        return
    print()
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


