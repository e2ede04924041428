"""Each pipeline schedule's bubble at one layout, from torch's own schedule order, in one process.

Run with ``python jobs/bench_pipeline.py`` (``--help`` lists the options). No GPU, model or process group:
torch's schedule classes build every rank's order from stand-in stages, and
``meshtrain.distributed.pipeline.simulate`` times it (F=1, B=2, I=W=1 per stage forward; every stage alike;
sends free). Prints, per schedule, the stages it runs, the bubble (idle share of each rank's step), the
step's length in stage forwards per rank, and the most activations rank 0 keeps for backward, in units of
one micro-batch through all of that rank's layers.

``--mask-cost SEQ [SEQ ...]`` also times what each pipeline stage adds under the document mask: every
stage finds the mask and the RoPE positions from the windows' token ids itself, once per micro-batch (only
tensors cross stages), against one block's forward and backward at that length, on this machine's device
(CUDA's block mask when it has one, else SDPA's dense mask), with the debug model's width.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from meshtrain.config import PIPELINE_SCHEDULES
from meshtrain.distributed.pipeline import peak_in_flight, schedule_order, simulate


def schedule_row(schedule: str, pipeline: int, microbatches: int, virtual_stages: int) -> dict[str, object]:
    """One schedule at the layout: its stages per rank and, unless torch refuses the layout, its figures."""
    kind = PIPELINE_SCHEDULES[schedule]
    virtual = {"one": 1, "two": 2}.get(kind.stages_per_rank, virtual_stages)
    row: dict[str, object] = {"schedule": schedule, "virtual": virtual}
    try:
        order = schedule_order(schedule, pipeline, virtual, microbatches)
    except ValueError as exc:
        return {**row, "refused": str(exc)}
    timeline = simulate(order)
    row.update(bubble=timeline.bubble, makespan=timeline.makespan / virtual,
               in_flight=peak_in_flight(order, 0, lambda stage: 1 / virtual))
    return row


def _seconds(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` calls of ``work()`` after one warm-up, in seconds (the least disturbed by
    whatever else runs on the machine)."""
    work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


def mask_cost(seq_len: int, micro_batch: int, documents: int, device: torch.device) -> tuple[float, float]:
    """(seconds to find one micro-batch's document mask and positions, seconds of one block's forward and
    backward) at ``seq_len`` with ``documents`` documents per window, the debug preset's width."""
    from meshtrain.config.loading import load_config
    from meshtrain.model.args import model_args
    from meshtrain.model.llama import build_model

    eos = 1
    args = model_args(load_config(None, [f"model.max_seq_len={max(seq_len, 1024)}", "model.n_layers=1"]).model, 512)
    model = build_model(args, device, document_eos=eos)
    tokens = torch.randint(2, 512, (micro_batch, seq_len), device=device)
    tokens[:, :: max(1, seq_len // documents)] = eos
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype)
    find = _seconds(lambda: model._attention_inputs(tokens, dtype, None), 15, device)
    h = torch.randn(micro_batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin, mask = model._attention_inputs(tokens, dtype, None)
    block = next(iter(model.layers.values()))
    block_time = _seconds(lambda: block(h, cos, sin, mask).float().sum().backward(), 15, device)
    return find, block_time


def bench(pipeline: int, microbatches: int, virtual_stages: int) -> list[dict[str, object]]:
    return [schedule_row(name, pipeline, microbatches, virtual_stages) for name in PIPELINE_SCHEDULES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks (parallel.pipeline)")
    parser.add_argument("--microbatches", type=int, default=16, help="micro-batches per run (parallel.pipeline_microbatches)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per rank for the looped schedules (the V schedules always hold 2, 1F1B/GPipe 1)")
    parser.add_argument("--mask-cost", type=int, nargs="*", default=[], metavar="SEQ",
                        help="also time a stage's document mask at these sequence lengths (see above)")
    args = parser.parse_args()
    if min(args.stages, args.microbatches, args.virtual_stages) < 1:
        parser.error("--stages, --microbatches and --virtual-stages are at least 1")
    p, m = args.stages, args.microbatches
    print(f"torch {torch.__version__}: {p} pipeline ranks, {m} micro-batches; 1F1B's (p-1)/(m+p-1) = "
          f"{(p - 1) / (m + p - 1):.2%}")
    print("| schedule | stages per rank | bubble | step (stage forwards per rank) | rank 0 keeps (micro-batches) |")
    print("|---|---|---|---|---|")
    for row in bench(p, m, args.virtual_stages):
        if "refused" in row:
            print(f"| {row['schedule']} | {row['virtual']} | torch refuses: {row['refused']} | | |")
            continue
        print(f"| {row['schedule']} | {row['virtual']} | {row['bubble']:.2%} | {row['makespan']:.1f} "
              f"| {row['in_flight']:g} |")
    if args.mask_cost:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"\nThe document mask each stage finds itself, per micro-batch of 1 window with 8 documents ({device}, "
              f"debug width), against one block's forward and backward:")
        print("| seq | mask and positions, ms | one block fwd+bwd, ms | mask / block |")
        print("|---|---|---|---|")
        for seq_len in args.mask_cost:
            find, block = mask_cost(seq_len, 1, 8, device)
            print(f"| {seq_len} | {find * 1e3:.2f} | {block * 1e3:.2f} | {find / block:.1%} |")
