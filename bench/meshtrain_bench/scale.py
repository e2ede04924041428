"""Simulate the data path at pretraining scale on a small machine, and print the ratios that prove
nothing per rank grows with the corpus.

Run with ``python jobs/bench_scale.py`` (``--help`` lists the options). Stores are written directly,
without tokenizing anything:

* *tiny-shard stores* of 1,000, 10,000 and 60,000 shards (60,000 is what 64 MiB units give at 1T
  tokens), each shard a few thousand random tokens with an end-of-document token every ~200;
* a *1T-token store*: 60,000 shards of 16.7M tokens made of sparse files (``os.truncate``: 2 TB that
  cost no disk), beside a 1M-token store of the same shard count's worth of tiny files.

Each store is trained on for ``--steps`` steps by a real :class:`~meshtrain.train.trainer.Trainer` (a
small Llama on CPU) in a fresh process, which then reports its open descriptors, memory maps and peak
RSS; the driver's launch-to-first-step time comes from ``jobs/pretrain.py`` run through Ray on the
smallest and the largest tiny-shard store. Then, against a local S3 endpoint (moto) that answers every
request after ``--delay-ms``, two processes read as two ranks of one node sharing one cache, with a
step time of ``--step-ms``: requests at start, bytes downloaded against bytes read plus the cache
bound, and the wait for data as a share of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshtrain_bench.synthetic_store import EOS, VOCAB, tokenizer_json, write_store

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 128


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def _plan(summary: dict[str, Any], options: dict[str, Any], cache_max_bytes: int = 32 * 2**30) -> Any:
    from meshtrain.data import DataPlan
    from meshtrain.data.pipeline import StoreRef
    from meshtrain.data.location import ReadSettings

    ref = StoreRef(summary["url"], 1.0, summary["fingerprint"], summary["tokens"], summary["shards"], "synthetic")
    return DataPlan(stores=(ref,), tokenizer_json=tokenizer_json(), vocab_size=VOCAB, eos_id=EOS,
                    validation_fraction=0.01, storage_options=options,
                    reading=ReadSettings(cache_max_bytes=cache_max_bytes, read_timeout_s=60))


def probe_training(summary: dict[str, Any], steps: int, workdir: str) -> dict[str, Any]:
    """Train ``steps`` steps on the store in this process; what one rank holds afterwards."""
    import torch

    from meshtrain.config.loading import load_config
    from meshtrain.data import open_data
    from meshtrain.distributed.layout import WorkerLayout
    from meshtrain.cluster.worker_plan import worker_plan
    from meshtrain.train.trainer import RankContext, Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        f"data.seq_len={SEQ_LEN}", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.warmup_steps=2",
        f"train.steps={steps}", "train.log_every=1", "checkpoint.enabled=false", f"eval.interval={steps}",
        "eval.batches=1", "run.hang_timeout_s=null", "train.gc_every=0", "scaling.num_workers=1",
        f"run.storage_path={workdir}", "run.name=probe",
    ])
    fds, maps = _descriptors(), _mappings()
    started = time.perf_counter()
    data = open_data(_plan(summary, {}), SEQ_LEN, cfg.train.seed)
    opened_s = time.perf_counter() - started
    trainer = Trainer(worker_plan(cfg, data), data, RankContext(WorkerLayout(), torch.device("cpu")))
    try:
        result = trainer.run()
        after = {"fds": _descriptors() - fds, "maps": _mappings() - maps, "fds_total": _descriptors(),
                 "maps_total": _mappings()}
    finally:
        trainer.close()
    records = result.records[2:]  # after warm-up
    return {
        **after,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "open_s": opened_s,
        "data_wait_s": statistics.mean(r.data_wait_s for r in records),
        "step_time_s": statistics.mean(r.step_time_s for r in records),
        "eval_loss": result.eval_loss,
    }


def probe_reading(summary: dict[str, Any], options: dict[str, Any], rank: int, ranks: int, steps: int,
                  step_s: float, cache_max_bytes: int, seq_len: int, windows: int) -> dict[str, Any]:
    """Read this rank's batches of ``steps`` steps with a simulated step time; what it waited and fetched.
    The ranks of a node share one block cache bounded by ``cache_max_bytes``."""
    import torch

    from meshtrain.config import DataConfig
    from meshtrain.data import DataParallelBatches, open_data

    started = time.perf_counter()
    data = open_data(_plan(summary, options, cache_max_bytes), seq_len, 0)
    stores = _stores_of(data)
    at_start = _stats(stores)
    opened_s = time.perf_counter() - started
    defaults = DataConfig()
    batches = DataParallelBatches(data.train, windows * ranks, min(windows, 8), dp_rank=rank, dp_size=ranks, device=torch.device("cpu"),
                                  read_ahead_steps=defaults.read_ahead_steps, read_threads=defaults.read_threads)
    waits, windows = [], 0
    try:
        for _ in range(steps):
            waiting = time.perf_counter()
            rows = list(batches.next_step())
            waits.append(time.perf_counter() - waiting)
            windows += sum(len(inputs) for inputs, _ in rows)
            time.sleep(step_s)
    finally:
        batches.close()
    return {"open_s": opened_s, "start": at_start, "end": _stats(stores), "waits": waits,
            "bytes_read": windows * (seq_len + 1) * 2}


def _stores_of(data: Any) -> list[Any]:
    stream = getattr(data.train, "stream", None)
    return [stream] if stream is not None else [c.stream for c in data.train.components]


def _stats(stores: list[Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for store in stores:
        for key, value in store.stats().items():
            totals[key] = totals.get(key, 0) + value
    return totals


def _in_subprocess(kind: str, env: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run a probe in a fresh interpreter, so descriptors, maps and peak RSS are its own."""
    command = [sys.executable, "-m", "meshtrain_bench.scale", "--probe", json.dumps({"kind": kind, **kwargs})]
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, env=child_env)
    if result.returncode:
        raise SystemExit(f"probe {kind} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def launch_to_first_step(store: str, work: Path, name: str) -> float:
    from meshtrain_bench.data import first_step

    seconds, _ = first_step(store, work / "runs", name)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 60000], help="tiny-shard store sizes")
    parser.add_argument("--tiny-tokens", type=int, default=1024, help="tokens per tiny shard")
    parser.add_argument("--steps", type=int, default=30, help="training steps per store")
    parser.add_argument("--launches", type=int, default=2, help="Ray launches per store for the start time (median)")
    parser.add_argument("--s3-shards", type=int, default=2000, help="shards of the store on the S3 endpoint")
    parser.add_argument("--s3-tokens", type=int, default=65536, help="tokens per shard of the S3 store (128 KiB)")
    parser.add_argument("--s3-seq-len", type=int, default=8192, help="sequence length of the S3 readers (16 KiB windows of uint16 tokens)")
    parser.add_argument("--skip-local", action="store_true", help="only the S3 part")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="latency of every S3 request")
    parser.add_argument("--step-ms", type=float, default=400.0, help="simulated step time of the S3 readers")
    parser.add_argument("--s3-windows", type=int, default=8,
                        help="windows each S3 reader reads per step (8 x 8,193 tokens in 400 ms is ~160k tokens/s per "
                        "rank, over 10x what a GPU trains an 8B model at; more saturates a moto server on 2 cores)")
    parser.add_argument("--cache-mib", type=int, default=4, help="data.cache_max_bytes of the S3 readers, MiB (less than they download, so it evicts)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "meshtrain-bench-scale"))
    parser.add_argument("--skip-launch", action="store_true", help="skip the Ray launches (start time)")
    parser.add_argument("--skip-s3", action="store_true", help="skip the S3 part")
    args = parser.parse_args()
    if args.probe:
        spec = json.loads(args.probe)
        kind = spec.pop("kind")
        result = probe_training(**spec) if kind == "train" else probe_reading(**spec)
        print(json.dumps(result))
        return 0

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.skip_local:
        s3_part(args, work)
        return 0
    stores = {f"{n:,} shards": write_store(work / f"tiny-{n}", n, args.tiny_tokens, sparse=False) for n in args.shards}
    stores["1M tokens"] = write_store(work / "1m", 1000, 1000, sparse=False)
    stores["1T tokens (sparse)"] = write_store(work / "1t", 60000, 10**12 // 60000, sparse=True)

    rows: dict[str, dict[str, Any]] = {}
    for label, summary in stores.items():
        rows[label] = _in_subprocess("train", summary=summary, steps=args.steps, workdir=str(work / "probe-runs"))
        print(f"{label}: {json.dumps(rows[label])}", flush=True)
    if not args.skip_launch:
        for label in (f"{args.shards[0]:,} shards", f"{args.shards[-1]:,} shards"):
            times = [launch_to_first_step(stores[label]["url"], work, f"launch-{k}") for k in range(args.launches)]
            rows[label]["launch_s"] = statistics.median(times)
            print(f"{label}: launch to first step {times}", flush=True)

    print()
    print("| store | tokens | descriptors (opened by the run) | memory maps (added by the run) | peak RSS (MiB) | open (s) "
          "| launch to first step (s) | data wait / step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        launch = f"{row['launch_s']:.1f}" if "launch_s" in row else "-"
        print(f"| {label} | {stores[label]['tokens']:,} | {row['fds_total']} ({row['fds']:+d}) | {row['maps_total']} ({row['maps']:+d}) "
              f"| {row['peak_rss_bytes'] / 2**20:,.0f} | {row['open_s']:.2f} | {launch} | {row['data_wait_s'] / row['step_time_s']:.1%} |")
    small, large = rows[f"{args.shards[0]:,} shards"], rows[f"{args.shards[-1]:,} shards"]
    print()
    for key, name in (("fds_total", "descriptors"), ("maps_total", "memory maps")):
        print(f"{name} {args.shards[-1]:,}/{args.shards[0]:,} shards: {large[key] / small[key]:.3f} (goal <= 1.1)")
    print(f"peak RSS {args.shards[-1]:,}/{args.shards[0]:,} shards: {large['peak_rss_bytes'] / small['peak_rss_bytes']:.3f} (goal <= 1.1)")
    print(f"peak RSS 1T/1M tokens: {rows['1T tokens (sparse)']['peak_rss_bytes'] / rows['1M tokens']['peak_rss_bytes']:.3f} (goal <= 1.1)")
    if "launch_s" in large:
        print(f"launch to first step {args.shards[-1]:,}/{args.shards[0]:,} shards: {large['launch_s'] / small['launch_s']:.2f} (goal <= 1.3)")
    if not args.skip_s3:
        s3_part(args, work)
    return 0


def s3_part(args: argparse.Namespace, work: Path) -> None:
    from meshtrain_bench.s3 import SlowS3

    local = write_store(work / f"s3-{args.s3_shards}x{args.s3_tokens}", args.s3_shards, args.s3_tokens, sparse=False)
    with SlowS3(args.delay_ms / 1000) as s3:
        url = s3.upload(Path(local["url"]), "bench", "store")
        cache = work / "s3-cache"
        shutil.rmtree(cache, ignore_errors=True)
        options = {**s3.storage_options}
        summary = {**local, "url": url}
        requests_before = s3.requests
        results: list[dict[str, Any]] = [{} for _ in range(2)]

        def rank(k: int) -> None:
            results[k] = _in_subprocess(
                "read", env={"MESHTRAIN_TOKEN_CACHE": str(cache)}, summary=summary, options=options, rank=k, ranks=2,
                steps=args.steps, step_s=args.step_ms / 1000, cache_max_bytes=args.cache_mib * 2**20, seq_len=args.s3_seq_len,
                windows=args.s3_windows,
            )

        threads = [threading.Thread(target=rank, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        served = s3.requests - requests_before
    cached = sum(path.stat().st_size for path in cache.rglob("*") if path.is_file() and path.name != "index.npy")
    start_requests = sum(r["start"].get("requests", 0) for r in results)
    downloaded = sum(r["end"].get("bytes_downloaded", 0) for r in results)
    read = sum(r["bytes_read"] for r in results)
    waits = [w for r in results for w in r["waits"][2:]]
    print()
    print(f"S3 ({args.s3_shards:,} shards of {args.s3_tokens:,} tokens, {args.s3_windows} windows of "
          f"{args.s3_seq_len + 1:,} tokens per rank and step, "
          f"{args.delay_ms:.0f} ms per request, 2 ranks of one node, cache bound "
          f"{args.cache_mib} MiB, step {args.step_ms:.0f} ms):")
    print("| requests at start (2 ranks) | requests in all | bytes read by the ranks | bytes downloaded by the node | "
          "downloaded / read | read + cache bound | node cache at the end | mean data wait after 2 steps | data wait / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    bound = read + args.cache_mib * 2**20
    print(f"| {start_requests} | {served} | {read:,} | {downloaded:,} | {downloaded / read:.3f} | {bound:,} | {cached:,} "
          f"| {statistics.mean(waits) * 1000:.1f} ms | {statistics.mean(waits) / (args.step_ms / 1000):.1%} |")
    print(f"downloaded <= read + cache bound: {downloaded <= bound}; data wait <= 5% of the step: "
          f"{statistics.mean(waits) <= 0.05 * args.step_ms / 1000}")


if __name__ == "__main__":
    sys.exit(main())
