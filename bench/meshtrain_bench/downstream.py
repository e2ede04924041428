"""Training throughput with downstream evaluation on and off, through the real job (local Ray).

Each run trains the same model on the same data with 2 CPU workers through ``launch`` (the driver
that scores checkpoints in Ray tasks beside the workers); with evaluation on, the harness scores
every ``--every``-th checkpoint on the test suite's local tasks (tests/data/downstream). Runs
alternate off/on ``--repeats`` times; the figure is the median of each run's mean training tokens/s
(after its first logged interval), and the ratio on/off is printed.

``--eval-cpus`` is what Ray reserves per evaluation: with the default 1, two workers of one CPU
each fill a two-core machine, so evaluations wait until training ends (training never waits for
them); a small share (0.01) runs them beside the workers on the same cores, which is the worst
case for training (a GPU cluster gives evaluations a GPU of their own).

    python jobs/bench_downstream.py                    # evaluations queue behind training
    python jobs/bench_downstream.py --eval-cpus 0.01   # evaluations share the training cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from meshtrain.config.loading import load_config

TASKS = Path(__file__).resolve().parents[2] / "tests" / "data" / "downstream"


def one_run(storage: Path, name: str, steps: int, interval: int, evaluate: bool, every: int, eval_cpus: float) -> dict:
    from meshtrain.cluster.launcher import launch

    overrides = [
        f"train.steps={steps}", "train.log_every=10", f"checkpoint.interval={interval}", "eval.interval=null",
        "optim.warmup_steps=5", f"run.storage_path={storage}", f"run.name={name}", "metrics.progress_interval_s=600",
    ]
    if evaluate:
        overrides += ["eval.downstream.tasks=[meshtrain_mc,meshtrain_ppl]", f"eval.downstream.include_path={TASKS}",
                      f"eval.downstream.every={every}", f"eval.downstream.num_cpus={eval_cpus}"]
    started = time.perf_counter()
    summary = launch(load_config(None, overrides))
    return {"tokens_per_s": summary["mean_tokens_per_s"], "wall_s": time.perf_counter() - started,
            "scored": sorted({record["step"] for record in summary.get("downstream", {}).values()})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint.interval")
    parser.add_argument("--every", type=int, default=2, help="eval.downstream.every")
    parser.add_argument("--eval-cpus", type=float, default=1.0, help="eval.downstream.num_cpus")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as storage:
        for repeat in range(args.repeats):
            for evaluate in (False, True):
                run = one_run(Path(storage), f"{'on' if evaluate else 'off'}-{repeat}", args.steps, args.interval,
                              evaluate, args.every, args.eval_cpus)
                rates[evaluate].append(run["tokens_per_s"])
                print(f"evaluation {'on ' if evaluate else 'off'}: {run['tokens_per_s']:,.0f} tokens/s, job "
                      f"{run['wall_s']:.0f}s" + (f", newest scored step {run['scored']}" if evaluate else ""), flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"training tokens/s with evaluation every {args.every} checkpoints (eval.downstream.num_cpus="
          f"{args.eval_cpus:g}) / without: {on:,.0f} / {off:,.0f} = {on / off:.3f}")
    return 0
