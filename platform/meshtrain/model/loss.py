"""The training loss: next-token cross entropy summed in fp32, one chunk of the vocabulary-wide logits at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

_LOSS_CHUNK_FP32_BYTES = 256 * 2**20  # one chunk's fp32 logits: ~520 tokens at a 128K vocabulary
_IGNORE_INDEX = -100  # F.cross_entropy's default, kept so a -100 target still contributes nothing


def loss_chunk_tokens(vocab_size: int) -> int:
    return max(1, _LOSS_CHUNK_FP32_BYTES // (4 * vocab_size))


def _row_chunks(tokens: int, chunk_tokens: int) -> Iterator[slice]:
    for start in range(0, tokens, chunk_tokens):
        yield slice(start, start + chunk_tokens)


def _owned_columns(targets: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column in the slice ``[vocab_start, vocab_start + vocab_local)`` of the vocabulary
    (0 where the slice does not hold it) and whether the slice holds it; -100 is never held."""
    column = targets - vocab_start
    owned = (column >= 0) & (column < vocab_local)
    return column.where(owned, 0), owned


# The per-chunk work lives in functions so each chunk's fp32 buffers are freed on return, before the
# next chunk allocates its own (a loop variable would keep the previous chunk alive meanwhile).
def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, lse_out: torch.Tensor) -> torch.Tensor:
    """One chunk's summed fp32 cross entropy; writes its per-token log-sum-exp into ``lse_out``."""
    upcast = logits.float()
    torch.logsumexp(upcast, dim=-1, out=lse_out)
    valid = targets != _IGNORE_INDEX
    target_logit = upcast.gather(-1, targets.where(valid, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse_out - target_logit, 0.0).sum()


def _chunk_vocab_slice_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, row_max: torch.Tensor,
                             sum_exp_out: torch.Tensor, target_logit_out: torch.Tensor) -> None:
    """For one chunk of a vocabulary slice: each token's ``sum(exp(logit - row_max))`` over the slice,
    and its target's logit where the slice holds the target (0 elsewhere)."""
    column, owned = _owned_columns(targets, vocab_start, logits.shape[-1])
    target_logit_out.copy_(logits.gather(-1, column.unsqueeze(-1)).squeeze(-1).float().where(owned, 0.0))
    # copy=True: fp32 logits would otherwise alias the input and be overwritten in place.
    torch.sum(logits.to(torch.float32, copy=True).sub_(row_max.unsqueeze(-1)).exp_(), dim=-1, out=sum_exp_out)


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                grad_total: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Write ``(softmax - onehot) * grad_total`` for one chunk of a vocabulary slice into ``grad_out``,
    computed in fp32 (``lse`` is over the whole vocabulary; the whole vocabulary is the slice at 0)."""
    # copy=True: fp32 logits would otherwise alias the saved input and be overwritten in place.
    probs = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    column, owned = _owned_columns(targets, vocab_start, probs.shape[-1])
    probs.scatter_add_(-1, column.unsqueeze(-1), owned.to(torch.float32).neg_().unsqueeze(-1))
    probs.mul_(torch.where(targets != _IGNORE_INDEX, grad_total, 0.0).unsqueeze(-1))
    grad_out.copy_(probs)


def _chunked_cross_entropy(flat_logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 cross entropy and each token's fp32 log-sum-exp, upcasting one chunk at a time."""
    total = torch.zeros((), dtype=torch.float32, device=flat_logits.device)
    lse = torch.empty(flat_logits.shape[0], dtype=torch.float32, device=flat_logits.device)
    for rows in _row_chunks(flat_logits.shape[0], chunk_tokens):
        total += _chunk_loss(flat_logits[rows], targets[rows], lse[rows])
    return total, lse


def _vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                  group: dist.ProcessGroup, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_chunked_cross_entropy`` of the logits whose vocabulary is split over ``group``, this rank
    holding the columns from ``vocab_start``; the same result on every rank.

    Two all-reduces of per-token fp32 statistics, however many chunks: the max logit, then the sum
    of exponentials next to the target's logit (which exactly one rank holds, the others add 0).
    """
    # The max is exact in the logits' own dtype: no fp32 copy, no chunks needed.
    row_max = local_logits.amax(dim=-1).float()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    stats = torch.empty(2, local_logits.shape[0], dtype=torch.float32, device=local_logits.device)
    for rows in _row_chunks(local_logits.shape[0], chunk_tokens):
        _chunk_vocab_slice_stats(local_logits[rows], targets[rows], vocab_start, row_max[rows],
                                 stats[0, rows], stats[1, rows])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    sum_exp, target_logit = stats
    lse = sum_exp.log_().add_(row_max)
    return torch.where(targets != _IGNORE_INDEX, lse - target_logit, 0.0).sum(), lse


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Summed cross entropy whose backward writes ``(softmax - onehot) * grad`` chunk by chunk.

    Only the input logits (in their own dtype) and an fp32 log-sum-exp per token are kept for
    backward; no full-size fp32 tensor ever exists. With a ``group``, the logits are this rank's
    slice of the vocabulary from ``vocab_start``; backward needs no collective, as the log-sum-exp
    saved is already the whole vocabulary's and the incoming gradient is the same on every rank.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, flat_logits: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int, reuse_logits: bool, vocab_start: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        if group is None:
            total, lse = _chunked_cross_entropy(flat_logits, targets, chunk_tokens)
        else:
            total, lse = _vocab_parallel_cross_entropy(flat_logits, targets, vocab_start, group, chunk_tokens)
        ctx.save_for_backward(flat_logits, targets, lse)
        ctx.chunk_tokens, ctx.reuse_logits, ctx.vocab_start = chunk_tokens, reuse_logits, vocab_start
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        flat_logits, targets, lse = ctx.saved_tensors
        # Logits computed by the model are overwritten by their gradient, chunk by chunk (each chunk is
        # read into fp32 before its rows are written): no second logits-sized buffer, 2 GB less at
        # 8192 x 128,256 in bf16. Nothing reads them after the loss (the head's matmul saved its
        # inputs, not its output), and the write bumps their version, so a second backward through
        # this graph fails loudly instead of reading gradients as logits. A leaf (a caller's own
        # tensor) is never overwritten.
        grad = flat_logits if ctx.reuse_logits else torch.empty_like(flat_logits)
        for rows in _row_chunks(flat_logits.shape[0], ctx.chunk_tokens):
            _chunk_grad(flat_logits[rows], targets[rows], ctx.vocab_start, lse[rows], grad_total, grad[rows])
        return grad, None, None, None, None, None


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
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk, not logits.is_leaf, 0, None)
    return _chunked_cross_entropy(flat_logits, flat_targets, chunk)[0]


def vocab_parallel_cross_entropy_sum(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                     group: dist.ProcessGroup, chunk_tokens: int | None = None) -> torch.Tensor:
    """``token_cross_entropy_sum`` of logits split over ``group`` by vocabulary ("loss parallel").

    ``local_logits`` (batch, seq, V_local) are this rank's columns ``[vocab_start, vocab_start +
    V_local)`` of the full logits; ``targets`` (batch, seq) are global token ids, the same on every
    rank, -100 ignored. Returns the same fp32 sum on every rank of ``group``; every rank must call
    it. Chunks of ``chunk_tokens`` tokens (default from the local vocabulary) as in
    ``token_cross_entropy_sum``, and the same in-place gradient for non-leaf logits. A target
    that no rank holds counts as a logit of 0: targets are range-checked where they are read.
    """
    flat_logits, flat_targets = local_logits.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens or loss_chunk_tokens(flat_logits.shape[-1])
    if torch.is_grad_enabled() and local_logits.requires_grad:
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk, not local_logits.is_leaf,
                                             vocab_start, group)
    return _vocab_parallel_cross_entropy(flat_logits, flat_targets, vocab_start, group, chunk)[0]
