"""Throughput of tensor and context parallel against 2-way FSDP at the same shape, on CPU workers.

Every layout trains the same model on the same data with 2 gloo workers in processes of their own
(the trainer the Ray workers run, without Ray): 2-way FSDP (the data-parallel baseline), TP=2 and
CP=2, and with ``--workers 4`` also FSDP x TP and CP x TP. Each runs ``--steps`` steps; the figure is
the median tokens/s of the steps after ``--warmup``, from the step records (``train.log_every=1``).
On CPU this is for the record, not a goal: gloo moves activations through host memory, and TP and CP
add per-layer collectives that NVLink hides on a GPU node.

    python jobs/bench_parallel.py                       # 2 workers, debug model, seq 512
    python jobs/bench_parallel.py --workers 4 --seq-len 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan, prepare_data

LAYOUTS_2 = {"FSDP 2": [], "TP 2": ["parallel.tensor=2"], "CP 2": ["parallel.context=2"]}
LAYOUTS_4 = {
    "FSDP 4": [], "FSDP 2 x TP 2": ["parallel.tensor=2"], "FSDP 2 x CP 2": ["parallel.context=2"],
    "CP 2 x TP 2": ["parallel.context=2", "parallel.tensor=2"],
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, cfg: MeshtrainConfig, data: DataPlan, out: str) -> None:
    from meshtrain.distributed.layout import WorkerLayout
    from meshtrain.cluster.worker_plan import worker_plan
    from meshtrain.train.trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = train(worker_plan(cfg, data), WorkerLayout(rank, world, rank, world, 0), torch.device("cpu"))
        if rank == 0:
            Path(out).write_text(repr([r.tokens_per_s for r in result.records]))
    finally:
        dist.destroy_process_group()


def tokens_per_second(cfg: MeshtrainConfig, data: DataPlan, warmup: int) -> float:
    """Median tokens/s of one layout's steps after ``warmup``, on ``cfg.scaling.num_workers`` processes."""
    import ast

    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        world = cfg.scaling.num_workers
        mp.start_processes(_rank, args=(world, _free_port(), cfg, data, out.name), nprocs=world, start_method="spawn")
        rates = ast.literal_eval(Path(out.name).read_text())
    return statistics.median(rates[warmup:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, choices=(2, 4), default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-parallel")
    parser.add_argument("overrides", nargs="*", help="more dotted.key=value settings for every layout")
    args = parser.parse_args(argv)
    layouts = LAYOUTS_2 if args.workers == 2 else LAYOUTS_4
    base = [f"scaling.num_workers={args.workers}", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
            "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "data.max_documents=24",
            "checkpoint.enabled=false", "eval.interval=null", "optim.warmup_steps=2", *args.overrides]
    first = load_config(None, [*base, "train.micro_batch_size=1"])
    data = prepare_data(first.data, args.workdir, first.data.seq_len, use_ray=False, log=lambda _: None)
    print(f"{first.model.preset} model, {args.workers} CPU workers (gloo), 8 sequences x {args.seq_len} tokens per "
          f"step, median of steps {args.warmup + 1}-{args.steps}")
    print("| layout | tokens/s | / FSDP |")
    print("|---|---|---|")
    baseline = None
    for name, extra in layouts.items():
        cfg = load_config(None, [*base, *extra])
        # The same global batch: a layout with fewer data-parallel ranks takes larger micro-batches.
        cfg.train.micro_batch_size = 8 // (args.workers // cfg.parallel.group_size)
        rate = tokens_per_second(cfg, data, args.warmup)
        baseline = baseline or rate
        print(f"| {name} | {rate:,.0f} | {rate / baseline:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
