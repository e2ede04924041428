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
from collections.abc import Callable

import torch

from meshtrain_bench.single_process import alternating_medians, single_process_run
from meshtrain.config.loading import load_config
from meshtrain.distributed.layout import RankLayout
from meshtrain.train.step import train_step


def measure(overrides: list[str], steps: int, workdir: str, device: torch.device) -> tuple[float, float, float]:
    """(masked tokens/s, unmasked tokens/s, documents per window) for the config ``overrides``."""
    cfg = load_config(None, [*overrides, "scaling.num_workers=1"])
    runs = {masked: single_process_run(cfg, workdir, device, 4, document_mask=masked) for masked in (True, False)}
    run = runs[True]
    eos = run.data.eos_id
    tokens = sum(t.numel() for _, t in run.steps[0])
    inputs = torch.cat([i for step in run.steps for i, _ in step])
    # An end-of-document token opens a document; so does a window's first token unless it is one.
    starts = (inputs == eos).sum(dim=1) + (inputs[:, 0] != eos)
    per_window = float(starts.float().mean())

    def steps_with(masked: bool) -> Callable[[int], None]:
        chosen = runs[masked]  # the same weights and batches; only the model's document mask differs

        def run_steps(count: int) -> None:
            for index in range(count):
                train_step(chosen.model, chosen.guard, chosen.steps[index % len(chosen.steps)],
                           RankLayout.single_process(), chosen.cfg.optim.grad_clip)
        return run_steps

    # Warm-up 3 (on GPU, compiling the block mask and flex attention), blocks of 5.
    masked, plain, _ = alternating_medians(steps_with(True), steps_with(False), steps, 5, 3, device)
    return tokens / masked, tokens / plain, per_window


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
