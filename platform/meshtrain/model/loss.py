"""The training loss: next-token cross entropy summed in fp32, one chunk of the vocabulary-wide logits at a time."""

from __future__ import annotations

import torch

_LOSS_CHUNK_FP32_BYTES = 256 * 2**20  # one chunk's fp32 logits: ~520 tokens at a 128K vocabulary
_IGNORE_INDEX = -100  # F.cross_entropy's default, kept so a -100 target still contributes nothing


def loss_chunk_tokens(vocab_size: int) -> int:
    return max(1, _LOSS_CHUNK_FP32_BYTES // (4 * vocab_size))


# The per-chunk work lives in functions so each chunk's fp32 buffers are freed on return, before the
# next chunk allocates its own (a loop variable would keep the previous chunk alive meanwhile).
def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, lse_out: torch.Tensor) -> torch.Tensor:
    """One chunk's summed fp32 cross entropy; writes its per-token log-sum-exp into ``lse_out``."""
    upcast = logits.float()
    torch.logsumexp(upcast, dim=-1, out=lse_out)
    valid = targets != _IGNORE_INDEX
    target_logit = upcast.gather(-1, targets.where(valid, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse_out - target_logit, 0.0).sum()


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_total: torch.Tensor,
                grad_out: torch.Tensor) -> None:
    """Write ``(softmax - onehot) * grad_total`` for one chunk into ``grad_out``, computed in fp32."""
    # copy=True: fp32 logits would otherwise alias the saved input and be overwritten in place.
    probs = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    valid = targets != _IGNORE_INDEX
    probs.scatter_add_(-1, targets.where(valid, 0).unsqueeze(-1), probs.new_full((probs.shape[0], 1), -1.0))
    probs.mul_(torch.where(valid, grad_total, 0.0).unsqueeze(-1))
    grad_out.copy_(probs)


def _chunked_cross_entropy(flat_logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 cross entropy and each token's fp32 log-sum-exp, upcasting one chunk at a time."""
    total = torch.zeros((), dtype=torch.float32, device=flat_logits.device)
    lse = torch.empty(flat_logits.shape[0], dtype=torch.float32, device=flat_logits.device)
    for start in range(0, flat_logits.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total += _chunk_loss(flat_logits[rows], targets[rows], lse[rows])
    return total, lse


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Summed cross entropy whose backward writes ``(softmax - onehot) * grad`` chunk by chunk.

    Only the input logits (in their own dtype) and an fp32 log-sum-exp per token are kept for
    backward; no full-size fp32 tensor ever exists.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, flat_logits: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, reuse_logits: bool) -> torch.Tensor:
        total, lse = _chunked_cross_entropy(flat_logits, targets, chunk_tokens)
        ctx.save_for_backward(flat_logits, targets, lse)
        ctx.chunk_tokens, ctx.reuse_logits = chunk_tokens, reuse_logits
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        flat_logits, targets, lse = ctx.saved_tensors
        # Logits computed by the model are overwritten by their gradient, chunk by chunk (each chunk is
        # read into fp32 before its rows are written): no second logits-sized buffer, 2 GB less at
        # 8192 x 128,256 in bf16. Nothing reads them after the loss (the head's matmul saved its
        # inputs, not its output), and the write bumps their version, so a second backward through
        # this graph fails loudly instead of reading gradients as logits. A leaf (a caller's own
        # tensor) is never overwritten.
        grad = flat_logits if ctx.reuse_logits else torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            _chunk_grad(flat_logits[rows], targets[rows], lse[rows], grad_total, grad[rows])
        return grad, None, None, None


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy in fp32, so callers can normalize globally.

    Computed over chunks of ``chunk_tokens`` tokens (default: ~256 MiB of fp32 logits per chunk), so
    only one chunk is ever upcast to fp32; the gradient w.r.t. ``logits`` has the logits' dtype.
    Logits that an operation computed (not a leaf) are overwritten by their gradient in backward:
    read them before ``backward()`` if you need them.
    """
    flat_logits, flat_targets = logits.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens or loss_chunk_tokens(flat_logits.shape[-1])
    if torch.is_grad_enabled() and logits.requires_grad:
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk, not logits.is_leaf)
    return _chunked_cross_entropy(flat_logits, flat_targets, chunk)[0]
