"""Each pipeline schedule's bubble at one layout, from torch's own schedule order, in one process.

Run with ``python jobs/bench_pipeline.py`` (``--help`` lists the options). No GPU, model or process group:
torch's schedule classes build every rank's order from stand-in stages, and
``meshtrain.distributed.pipeline.simulate`` times it (F=1, B=2, I=W=1 per stage forward; every stage alike;
sends free). Prints, per schedule, the stages it runs, the bubble (idle share of each rank's step), the
step's length in stage forwards per rank, and the most activations rank 0 keeps for backward, in units of
one micro-batch through all of that rank's layers.
"""

from __future__ import annotations

import argparse

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


def bench(pipeline: int, microbatches: int, virtual_stages: int) -> list[dict[str, object]]:
    return [schedule_row(name, pipeline, microbatches, virtual_stages) for name in PIPELINE_SCHEDULES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks (parallel.pipeline)")
    parser.add_argument("--microbatches", type=int, default=16, help="micro-batches per run (parallel.pipeline_microbatches)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per rank for the looped schedules (the V schedules always hold 2, 1F1B/GPipe 1)")
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
