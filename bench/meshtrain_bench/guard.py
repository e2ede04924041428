"""Cost of the step guard and of an evaluation, in one process on this machine's CPU (or GPU).

Run with ``python jobs/bench_guard.py`` (its docstring shows examples; ``--help`` lists the options).

Times optimizer steps of the same model and batches two ways, alternating in blocks so drift
affects both alike: with meshtrain's train_step (loss and gradient norm checked on the device, the
decision passed to fused AdamW as found_inf) and with a plain step (no check, optimizer.step()).
Then the guard with the spike rules on (train.loss_spike_factor, train.grad_norm_spike_factor and the
rollback window: medians and a ring buffer on the device, no host read) against it with them off.
Also times one evaluation of eval.batches global batches against one training step. With more than
one rank the guard adds one scalar all-reduce per step, which this single-process figure omits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run its jobs/ and read its configs

from meshtrain_bench.single_process import alternating_medians, single_process_run
from meshtrain.config.loading import load_config
from meshtrain.distributed.layout import RankLayout
from meshtrain.distributed.parallelize import clip_grad_norm_
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.train.evaluation import evaluate, validation_samples
from meshtrain.train.guard import SpikeRules, StepGuard
from meshtrain.train.step import train_step


def plain_step(model, optimizer, micro_batches, grad_clip: float) -> None:  # noqa: ANN001
    tokens = sum(t.numel() for _, t in micro_batches)
    for inputs, targets in micro_batches:
        (token_cross_entropy_sum(model(inputs), targets) / tokens).backward()
    clip_grad_norm_(list(model.parameters()), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="timed steps per variant")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-guard")
    args = parser.parse_args()
    cfg = load_config(None, [f"model.preset={args.preset}", f"data.seq_len={args.seq_len}", "scaling.num_workers=1"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = single_process_run(cfg, args.workdir, device, 8)
    model, optimizer, guard, data, steps = run.model, run.optimizer, run.guard, run.data, run.steps
    micro, _ = cfg.train.batch_layout(1)

    def guarded_steps(count: int) -> None:
        for index in range(count):
            train_step(model, guard, steps[index % len(steps)], RankLayout.single_process(), cfg.optim.grad_clip)

    def plain_steps(count: int) -> None:
        for index in range(count):
            plain_step(model, optimizer, steps[index % len(steps)], cfg.optim.grad_clip)

    block = 10
    g, p, blocks = alternating_medians(guarded_steps, plain_steps, args.steps, block, 10, device)
    print(f"step with guard {g * 1000:.2f} ms, without {p * 1000:.2f} ms (medians of {blocks} blocks of "
          f"{block}); guard/plain = {g / p:.3f}")

    spiky = StepGuard(optimizer, device, SpikeRules(3.0, 3.0, window=50, rollback_window=20))

    def spike_rule_steps(count: int) -> None:
        for index in range(count):
            train_step(model, spiky, steps[index % len(steps)], RankLayout.single_process(), cfg.optim.grad_clip)

    s, g, blocks = alternating_medians(spike_rule_steps, guarded_steps, args.steps, block, 10, device)
    print(f"step with the spike rules {s * 1000:.2f} ms, without {g * 1000:.2f} ms (medians of {blocks} blocks of "
          f"{block}); rules/no rules = {s / g:.3f}")

    assert data.validation is not None
    selected = data.validation.select(cfg.eval.batches * cfg.train.global_batch_size)
    chosen = selected[: validation_samples(len(selected), cfg.eval.batches, cfg.train.global_batch_size)]
    samples = len(chosen)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        evaluate(model, data.validation, chosen, micro, RankLayout.single_process(), device)
        runs.append(time.perf_counter() - started)
    e = statistics.median(runs)
    print(f"evaluation of {samples} sequences {e * 1000:.1f} ms = {e / p:.2f} training steps; at eval.interval="
          f"{cfg.eval.interval} that is {e / (p * cfg.eval.interval):.1%} of training time")


