"""Training throughput, MFU and peak memory of Llama shapes on GPUs, one real training job per configuration.

Run with ``python jobs/bench_gpu.py`` (its docstring shows examples; ``--help`` lists the options).

The configurations are named sets of dotted settings in ``jobs/bench_gpu.yaml`` (``--matrix``
another file): ``gpu`` (default) holds Llama 3.2 1B and an 8-layer Llama 3 8B, bf16, ``parallel.compile``
and ``parallel.activation_checkpointing=selective`` on and off, several micro-batch sizes; ``tiny``
(``--cpu-smoke``) holds the debug model on CPU workers. Each configuration runs through
``meshtrain.cluster.launcher.launch``, the path ``jobs/pretrain.py`` takes (one Ray Train worker per GPU, the
offline standard-library corpus, a token store prepared once under ``--storage``), for ``--warmup`` +
``--steps`` optimizer steps with checkpoints and evaluation off and ``run.max_failures=0``. A
configuration that fails (out of memory, say) gets a failed row with its one-line reason and the next
one runs; the exit code is then 1.

Unless ``--no-profile``, each run also keeps what explains its figures, in its run folder:

- a torch.profiler trace of rank 0 (``profile/rank0.<step>.pt.trace.json``, for Perfetto or
  chrome://tracing) of one step after the timed ones, and the top ops by self time in that step (the
  run's ``profile`` record, the line the profiler prints to the job log: device kernels on GPU, CPU
  ops on CPU);
- on GPU, the CUDA allocator's history (``memory.history_entries``) from the start of the run, so that
  every rank writes a snapshot saying what allocated each block when its steps are done
  (``memory/rank<R>.step<S>.end.pickle``, for pytorch.org/memory_viz), and a rank that runs out of
  memory one at that step (``memory/rank<R>.step<S>.pickle``). Recording it costs host time at each
  allocation, in the timed steps too: ``--no-profile`` times without it.

What each row reports (rank 0's records in ``metrics.jsonl`` and ``summary.json`` of the run):

- tokens/s per worker = (tokens of the timed steps) / (their wall time) / workers. The timed steps
  follow the warm-up (compilation, allocator growth, Ray Train's first report). The window runs from
  one logged step to another, each timed on the host after its step was queued and just before the
  loss read that waits for the device; both ends lie a whole logging interval after the previous
  read, so the host is as far ahead of the device at either end. Logging every L = ceil(W/2) steps
  puts the first logged step inside the warm-up: the warm-up is rounded up to 2L steps and the timed
  steps up to a multiple of L (default 6 + 21). The profiled steps come after the timed ones.
- MFU = tokens/s per worker x model FLOPs per token / device peak FLOP/s, by two counts of the FLOPs per
  token: "MFU" with attention over the (query, key) pairs the masks allowed (the train records'
  ``flops_per_token``, the timed steps' mean: what the steps computed, as the ``meshtrain_mfu_ratio``
  gauge counts), and "MFU full attn" with every query against the whole window, 6 x matmul weights +
  12 x layers x seq_len x dim (``meshtrain.model.flops.flops_per_token``, the records'
  ``flops_per_token_full_attention``: the PaLM / torchtitan convention that other frameworks' MFU
  uses). Both forward and backward, recomputation not counted. The peak is ``metrics.peak_flops_per_s``
  when set, else the dense peak of the worker's GPU for the compute dtype (``meshtrain.model.flops``), else on
  CPU the nominal ``metrics.cpu_peak_flops_per_s`` (1e11 by default: CPU MFU is not a real figure).
- peak memory: on GPU ``torch.cuda.max_memory_allocated`` after training, the largest over the ranks
  (``peak_device_memory_bytes`` in summary.json), against the ``--dry-run`` plan's per-rank total
  (``meshtrain.distributed.plan.memory_plan``) as measured/planned. On CPU the worker's peak resident set
  (``peak_host_rss_bytes``), which holds Python, PyTorch and Ray too: no ratio is printed for it.
- CUDA allocator retries: how often the caching allocator had to free its cached blocks and retry an
  allocation (``num_alloc_retries`` of ``torch.cuda.memory_stats``; a count above 0 means fragmentation
  near the memory limit, which slows steps), from summary.json's ``num_alloc_retries`` where the run
  recorded it; "-" where it did not, and on CPU.
- step time breakdown per timed step: data wait (host time rank 0 spent getting its batch, ``data_wait_s``
  in metrics.jsonl; on GPU the host runs ahead of the device, so it only costs throughput when it is
  long) and the rest (forward, backward, communication, optimizer); also the warm-up's mean step time
  (compilation shows here) and the setup time (launch to first step and teardown: Ray workers, data,
  model build; the first configuration also prepares the token store unless --storage holds it).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError
from meshtrain_bench.gpu_configs import (
    DEFAULT_MATRIX,
    PROFILED_STEPS,
    BenchConfig,
    Window,
    load_matrix,
    parse_overrides,
    select,
    to_overrides,
)
from meshtrain_bench.gpu_dry_run import dry_run
from meshtrain_bench.gpu_launch import run_one
from meshtrain_bench.gpu_measure import Row
from meshtrain_bench.gpu_report import diagnostics, format_table, header, table_row, write_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="YAML file of configuration sets")
    parser.add_argument("--set", dest="set_name", default="gpu", help="which set of the matrix to run (default gpu)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the `tiny` set on CPU workers (= --set tiny)")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="run only configurations whose name matches (repeatable, comma-separated globs)")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed optimizer steps per configuration, rounded up to whole logging intervals "
                        "(default %(default)s)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="untimed steps first (compilation, allocator growth), rounded up to an even number "
                        "(default %(default)s)")
    parser.add_argument("--storage", default="runs/bench_gpu",
                        help="run.storage_path of the jobs: runs and the cached token store (shared on a cluster; "
                        "default %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the table and every figure as JSON here")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help=f"neither trace rank 0's step after the timed ones ({PROFILED_STEPS} more step, plus "
                        "the one that starts the profiler) nor record the CUDA allocator's history (which costs "
                        "host time at each allocation, timed steps included)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each configuration's memory plan and verdict; no Ray")
    parser.add_argument("--trace", action="store_true",
                        help="with --dry-run: trace one step of each configuration on fake tensors and a fake process "
                        "group (no GPU needed) and print its peak beside the plan")
    parser.add_argument("--device-type", default="H100",
                        help="GPU the --dry-run verdict is for, unless a configuration sets scaling.accelerator_type "
                        "or scaling.device_memory_gib (default H100)")
    parser.add_argument("--list", action="store_true", help="list the sets and their configurations, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings applied to every configuration")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.set_name = "tiny"
    args.only = [p.strip() for item in args.only for p in item.split(",") if p.strip()]
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    return args


def list_sets(sets: dict[str, dict[str, Any]]) -> None:
    for set_name, entry in sets.items():
        print(f"{set_name}: {entry.get('description', '').strip()}")
        for name in entry["configs"]:
            print(f"  {name}")


def run_all(
    configs: list[BenchConfig], window: Window, storage: str, out: Path | None, lines: list[str], profile: bool
) -> list[Row]:
    """Every configuration in turn, on one Ray (joined or started here, as jobs/pretrain.py does)."""
    from meshtrain.cluster.launcher import init_ray

    local_ray = init_ray()
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    rows: list[Row] = []
    for index, config in enumerate(configs, 1):
        settings = " ".join(to_overrides(config.settings))
        print(f"[bench_gpu] {index}/{len(configs)} {config.name}: {settings}", flush=True)
        started = time.perf_counter()
        rows.append(run_one(config, window, stamp, storage, local_ray, profile))
        print(f"[bench_gpu] {config.name} {rows[-1].status} in {time.perf_counter() - started:.0f}s", flush=True)
        print(table_row(rows[-1]), flush=True)
        if out is not None:
            write_json(out, lines, window, rows, profile)  # after every configuration: a crash keeps what was measured
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sets = load_matrix(args.matrix)
        if args.list:
            list_sets(sets)
            return 0
        configs = select(sets, args.set_name, args.only, parse_overrides(args.overrides))
    except ConfigError as exc:
        print(f"bench_gpu: config error: {exc}", file=sys.stderr)
        return 2
    window = Window.for_request(args.warmup, args.steps)
    if args.dry_run:
        return dry_run(configs, window, args.device_type, args.trace, args.profile)
    lines = header(window, args.set_name, args.profile)
    rows = run_all(configs, window, args.storage, args.out, lines, args.profile)
    print()
    print("\n".join(lines))
    print(format_table(rows))
    for line in diagnostics(rows):
        print(line)
    if args.out is not None:
        print(f"[bench_gpu] wrote {args.out}")
    return 0 if all(row.status == "ok" for row in rows) else 1
