"""Cost of document-masked attention (``model.document_mask``) in one process on this machine.

Run with ``python jobs/bench_documents.py`` (``--help`` lists the options).

Times meshtrain's training step on the same model and the same batches of the default corpus, with
the document mask and without it, alternating in blocks so drift affects both alike, at each
requested sequence length. On CPU the mask is SDPA's with an explicit (seq, seq) boolean mask per
sample; on GPU it is flex attention with a block mask. Prints tokens/s both ways and the ratio
masked/unmasked, and how many documents a window holds (the mask saves attention work only where
windows hold several).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain.config import load_config
from meshtrain.data import DataParallelBatches, open_data, prepare_data
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.train.guard import StepGuard
from meshtrain.train.optim import build_optimizer
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.step import train_step


def measure(overrides: list[str], steps: int, workdir: str, device: torch.device) -> tuple[float, float, float]:
    """(masked tokens/s, unmasked tokens/s, documents per window) for the config ``overrides``."""
    cfg = load_config(None, [*overrides, "scaling.num_workers=1"])
    plan = prepare_data(cfg.data, workdir, cfg.data.seq_len, use_ray=False, log=lambda _: None)
    data = open_data(plan, cfg.data.seq_len, cfg.train.seed)
    model, _ = build_sharded_model(cfg, data.vocab_size, WorkerLayout(), device)
    optimizer = build_optimizer(model, cfg.optim)
    guard = StepGuard(optimizer, device, cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
    micro, _ = cfg.batch_layout(1)
    batches = DataParallelBatches(data.train, cfg.train.global_batch_size, micro, 0, 1, device)
    cycle = [list(batches.next_step()) for _ in range(4)]
    tokens = sum(t.numel() for _, t in cycle[0])
    inputs = torch.cat([i for step in cycle for i, _ in step])
    # An end-of-document token opens a document; so does a window's first token unless it is one.
    starts = (inputs == data.eos_id).sum(dim=1) + (inputs[:, 0] != data.eos_id)
    per_window = float(starts.float().mean())

    def timed(masked: bool, count: int) -> float:
        model.mask_documents(data.eos_id if masked else None)
        started = time.perf_counter()
        for index in range(count):
            train_step(model, guard, cycle[index % len(cycle)], 1, cfg.optim.grad_clip)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / count

    timed(True, 3), timed(False, 3)  # warm-up (and, on GPU, compiling the block mask and flex attention)
    block = 5
    masked, plain = [], []
    for _ in range(max(1, steps // block)):
        masked.append(timed(True, block))
        plain.append(timed(False, block))
    return tokens / statistics.median(masked), tokens / statistics.median(plain), per_window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant and length")
    parser.add_argument("--seq-lens", default="128,2048", help="comma-separated data.seq_len values")
    parser.add_argument("--workdir", default="/tmp/meshtrain-bench-documents")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. model.preset=125m")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device}; overrides: {' '.join(args.overrides) or 'none (the default job)'}")
    print("| seq_len | documents per window | masked tokens/s | unmasked tokens/s | masked/unmasked |")
    print("|---|---|---|---|---|")
    for seq_len in (int(value) for value in args.seq_lens.split(",")):
        overrides = [f"data.seq_len={seq_len}", f"model.max_seq_len={max(seq_len, 1024)}", *args.overrides]
        masked, plain, per_window = measure(overrides, args.steps, args.workdir, device)
        print(f"| {seq_len} | {per_window:.1f} | {masked:,.0f} | {plain:,.0f} | {masked / plain:.3f} |", flush=True)
