"""The chunked cross entropy's own time, eager against compiled chunk functions, in one process.

Run with ``python jobs/bench_loss.py`` (``--help`` lists the options).

Logits come from an output head (hidden x weight, so they are a computed tensor whose buffer the
backward overwrites, as in training); the timer covers the loss's forward and its backward to the
logits only, not the head. The two variants alternate in blocks so drift affects both alike. Prints
the median milliseconds of each, the ratio eager/compiled, and how far apart their losses and
gradients are (both are fp32 sums; the gradient entries lie in [-1, 1]).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshtrain.model.loss import loss_chunk_tokens, token_cross_entropy_sum


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class LossCase:
    """Hidden states, head weight and targets of one shape; each call runs the loss on fresh logits."""

    def __init__(self, tokens: int, vocab: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        self.hidden = torch.randn(tokens, dim, generator=generator, device=device, dtype=dtype)
        self.weight = (torch.randn(vocab, dim, generator=generator, device=device, dtype=dtype) * dim**-0.5).requires_grad_()
        self.targets = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
        self.device = device

    def run(self, compiled: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(seconds of the loss's forward and backward, the loss, the logits' gradient)."""
        logits = F.linear(self.hidden, self.weight)
        _sync(self.device)
        started = time.perf_counter()
        loss = token_cross_entropy_sum(logits[None], self.targets[None], compiled=compiled)
        (grad,) = torch.autograd.grad(loss, logits)
        _sync(self.device)
        return time.perf_counter() - started, loss.detach(), grad


def measure(case: LossCase, repeats: int, block: int) -> dict[str, float]:
    """Median seconds per call of each variant, and the largest difference between their results."""
    _, eager_loss, eager_grad = case.run(compiled=False)
    _, compiled_loss, compiled_grad = case.run(compiled=True)  # compiles (twice: the last chunk is shorter)
    loss_gap = abs(float(eager_loss) - float(compiled_loss)) / abs(float(eager_loss))
    grad_gap = float((eager_grad.detach().float() - compiled_grad.detach().float()).abs().max())
    del eager_grad, compiled_grad
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(max(1, repeats // block)):
        for compiled in (False, True):
            times[compiled].extend(case.run(compiled)[0] for _ in range(block))
    return {"eager": statistics.median(times[False]), "compiled": statistics.median(times[True]),
            "loss_rel_gap": loss_gap, "grad_max_gap": grad_gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--dim", type=int, default=512, help="hidden size of the head that makes the logits")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the logits' dtype; auto: bfloat16 on CUDA, float32 on CPU (what training computes in)")
    parser.add_argument("--repeats", type=int, default=12, help="timed calls per variant")
    parser.add_argument("--block", type=int, default=3, help="calls per variant before switching")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    chunk = loss_chunk_tokens(args.vocab)
    print(f"device: {device} ({torch.get_num_threads()} threads); logits {args.tokens} x {args.vocab} {dtype} "
          f"from dim {args.dim}; chunks of {chunk} tokens")
    result = measure(LossCase(args.tokens, args.vocab, args.dim, dtype, device), args.repeats, args.block)
    print("| eager ms | compiled ms | eager/compiled | loss rel. gap | grad max gap |")
    print("|---|---|---|---|---|")
    print(f"| {result['eager'] * 1e3:.1f} | {result['compiled'] * 1e3:.1f} | {result['eager'] / result['compiled']:.2f} "
          f"| {result['loss_rel_gap']:.1e} | {result['grad_max_gap']:.1e} |")
