"""meshtrain's training speed on this machine's CPUs against a plain single-process PyTorch loop.

Run with ``python jobs/bench_cpu_gap.py`` (``--help`` lists the options).

Three runs of the same model, batch and data, one after another (then the plain loop again, so
drift shows): a plain loop in one process with as many threads as the machine has CPUs (the same
Llama module, ``F.cross_entropy`` on the full logits, gradient clipping, fused AdamW); meshtrain on
one Ray worker holding every CPU (no collectives between processes); meshtrain on one worker per
CPU; and meshtrain's trainer in this process without Ray. Each figure is the median tokens/s over
the logged steps after a warm-up. Prints tokens/s and the ratios to the plain loop: in-process/plain
is meshtrain's own overhead, 1-worker/in-process what Ray's processes take from the same cores, and
N-workers/1-worker the cost of gloo collectives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from meshtrain.observe.run_folder import Record, TrainRecord, read_records

REPO = Path(__file__).resolve().parents[2]
# The shape of the comparison: hidden 256, 4 layers, seq 256, 16 sequences per step, vocab 8192.
SHAPE = ["model.preset=debug", "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_dim=768", "model.vocab_size=8192", "data.seq_len=256", "train.global_batch_size=16"]


def plain_loop(overrides: list[str], steps: int, warmup: int, workdir: str) -> float:
    """Median tokens/s of a plain PyTorch loop over the first ``steps`` global batches of the run's data."""
    import torch
    import torch.nn.functional as F

    from meshtrain.config.loading import load_config
    from meshtrain.data import DataParallelBatches, open_data, prepare_data
    from meshtrain.model.args import model_args
    from meshtrain.model.init import init_weights
    from meshtrain.model.llama import build_model, materialize

    cfg = load_config(None, [*overrides, "scaling.num_workers=1"])
    plan = prepare_data(cfg.data, workdir, cfg.data.seq_len, use_ray=False, log=lambda _: None)
    data = open_data(plan, cfg.data.seq_len, cfg.train.seed)
    document_eos = data.eos_id if cfg.model.document_mask else None
    model = materialize(build_model(model_args(cfg.model, data.vocab_size), "meta", document_eos=document_eos), "cpu")
    init_weights(model, cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=True)
    batches = DataParallelBatches(data.train, cfg.train.global_batch_size, cfg.train.global_batch_size, 0, 1,
                                  torch.device("cpu"))
    rates = []
    for step in range(steps):
        started = time.perf_counter()
        ((inputs, targets),) = batches.next_step()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # as a logged step would
        if step >= warmup:
            rates.append(targets.numel() / (time.perf_counter() - started))
    return statistics.median(rates)


# What every meshtrain run of the comparison sets: one log record per step, nothing but training.
RUN_SETTINGS = ["train.log_every=1", "eval.interval=null", "checkpoint.enabled=false", "metrics.port=0",
                "optim.warmup_steps=0"]


def median_rate(records: Sequence[object], warmup: int) -> float:
    """Median tokens/s of the logged steps after ``warmup``."""
    return statistics.median(r.tokens_per_s for r in records if isinstance(r, TrainRecord) and r.step > warmup)


def trainer_in_process(overrides: list[str], steps: int, warmup: int, workdir: str, storage: str) -> float:
    """Median tokens/s of meshtrain's trainer in this process on a gloo group of one (so FSDP2 wraps the
    model, as in a one-worker Ray run), without Ray: meshtrain's own cost, apart from Ray's."""
    import torch
    import torch.distributed as dist

    from meshtrain.config.loading import load_config
    from meshtrain.data import prepare_data
    from meshtrain.distributed.layout import WorkerLayout
    from meshtrain.cluster.worker_plan import worker_plan
    from meshtrain.train.trainer import train

    cfg = load_config(None, [*overrides, *RUN_SETTINGS, "scaling.num_workers=1", f"train.steps={steps}",
                             f"run.storage_path={storage}", "run.name=in-process"])
    plan = prepare_data(cfg.data, workdir, cfg.data.seq_len, use_ray=False, log=lambda _: None)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    records: list[Record] = []
    try:
        train(worker_plan(cfg, plan), WorkerLayout(), torch.device("cpu"), records.append)
    finally:
        dist.destroy_process_group()
    return median_rate(records, warmup)


def meshtrain_run(overrides: list[str], workers: int, cpus: int, steps: int, warmup: int, storage: str) -> float:
    """Median tokens/s of meshtrain's logged steps after ``warmup``, on ``workers`` Ray workers."""
    name = f"gap-{workers}w-{int(time.time())}"
    command = [sys.executable, str(REPO / "jobs" / "pretrain.py"), *overrides, *RUN_SETTINGS,
               f"scaling.num_workers={workers}", f"scaling.cpus_per_worker={cpus / workers:g}", f"train.steps={steps}",
               f"run.storage_path={storage}", f"run.name={name}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"meshtrain run failed ({result.returncode}): {result.stderr[-2000:]}")
    return median_rate(read_records(Path(storage) / name / "metrics.jsonl"), warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each median")
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-cpu-gap")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) over the benchmark's shape")
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    overrides = [*SHAPE, f"data.cache_dir={args.workdir}/stores", *args.overrides]
    with tempfile.TemporaryDirectory(dir=args.workdir if os.path.isdir(args.workdir) else None) as storage:
        plain = plain_loop(overrides, args.steps, args.warmup, args.workdir)
        in_process = trainer_in_process(overrides, args.steps, args.warmup, args.workdir, storage)
        one = meshtrain_run(overrides, 1, cpus, args.steps, args.warmup, storage)
        many = meshtrain_run(overrides, cpus, cpus, args.steps, args.warmup, storage)
        plain_again = plain_loop(overrides, args.steps, args.warmup, args.workdir)
    reference = (plain + plain_again) / 2
    print(f"CPUs: {cpus}; shape: {' '.join(overrides)}")
    print("| run | tokens/s | / plain |")
    print("|---|---|---|")
    print(f"| plain PyTorch, 1 process, {cpus} threads (before, after) | {plain:,.0f}, {plain_again:,.0f} | 1 |")
    print(f"| meshtrain's trainer in this process, no Ray (gloo group of 1) | {in_process:,.0f} | "
          f"{in_process / reference:.3f} |")
    print(f"| meshtrain, 1 worker x {cpus} CPUs | {one:,.0f} | {one / reference:.3f} |")
    print(f"| meshtrain, {cpus} workers x 1 CPU | {many:,.0f} | {many / reference:.3f} |")
