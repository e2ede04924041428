"""The training loss: next-token cross entropy summed in fp32, one chunk of the vocabulary-wide logits at a time.

Each chunk's work is a few functions over the chunk (its loss and log-sum-exp, its vocabulary-slice
statistics, its gradient). On CUDA they run compiled: inductor fuses each into one or two kernels that
read the chunk's logits in their own dtype and never write an fp32 copy (eager, the upcast, the
log-sum-exp and each step of the gradient is a pass of its own over an fp32 copy of the chunk).
Elsewhere they run eagerly by default: inductor's C++ backend works on CPU (4.6-9x faster at 4096 x
32k here), but compiling costs 10-20 s per process, more than most CPU runs and tests spend in the
loss; ``compiled=True`` asks for it anyway (``jobs/bench_loss.py`` compares both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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
# next chunk allocates its own (a loop variable would keep the previous chunk alive meanwhile). Their
# in-place ops keep the eager path at one fp32 chunk; compiled, inductor fuses the same chains of
# pointwise ops into single kernels.
def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed fp32 cross entropy and its per-token fp32 log-sum-exp."""
    upcast = logits.float()
    lse = torch.logsumexp(upcast, dim=-1)
    valid = targets != _IGNORE_INDEX
    target_logit = upcast.gather(-1, targets.where(valid, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse - target_logit, 0.0).sum(), lse


def _chunk_vocab_slice_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                             row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk of a vocabulary slice: each token's ``sum(exp(logit - row_max))`` over the slice,
    and its target's logit where the slice holds the target (0 elsewhere)."""
    column, owned = _owned_columns(targets, vocab_start, logits.shape[-1])
    target_logit = logits.gather(-1, column.unsqueeze(-1)).squeeze(-1).float().where(owned, 0.0)
    # copy=True: fp32 logits would otherwise alias the input and be overwritten in place.
    sum_exp = logits.to(torch.float32, copy=True).sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    return sum_exp, target_logit


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                grad_total: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Write ``(softmax - onehot) * grad_total`` for one chunk of a vocabulary slice into ``grad_out``
    (which may be ``logits`` itself), computed in fp32 (``lse`` is over the whole vocabulary; the
    whole vocabulary is the slice at 0)."""
    # copy=True: fp32 logits would otherwise alias the input and be overwritten in place.
    probs = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    column, owned = _owned_columns(targets, vocab_start, probs.shape[-1])
    probs.scatter_add_(-1, column.unsqueeze(-1), owned.to(torch.float32).neg_().unsqueeze(-1))
    probs.mul_(torch.where(targets != _IGNORE_INDEX, grad_total, 0.0).unsqueeze(-1))
    grad_out.copy_(probs)


def _fused_chunk_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                      grad_total: torch.Tensor, grad_out: torch.Tensor) -> None:
    """:func:`_chunk_grad` written to be compiled: the target's -1 comes from comparing each column
    with the target's instead of a scatter, so inductor makes the whole chunk one kernel that reads
    the logits and writes the gradient once. (Eager, that comparison costs more than the scatter.)"""
    column, owned = _owned_columns(targets, vocab_start, logits.shape[-1])
    onehot = (torch.arange(logits.shape[-1], device=logits.device) == column.unsqueeze(-1)) & owned.unsqueeze(-1)
    scale = torch.where(targets != _IGNORE_INDEX, grad_total, 0.0).unsqueeze(-1)
    grad_out.copy_(((logits.float() - lse.unsqueeze(-1)).exp() - onehot.float()) * scale)


@dataclass(frozen=True)
class _ChunkKernels:
    loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    vocab_slice_stats: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    grad: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


_EAGER = _ChunkKernels(_chunk_loss, _chunk_vocab_slice_stats, _chunk_grad)


@cache
def _compiled_kernels() -> _ChunkKernels:
    # Default dynamic shapes: the first chunk size compiles static, a second (the last, shorter chunk)
    # recompiles once with the row count symbolic; the vocabulary stays a constant.
    return _ChunkKernels(*(torch.compile(fn) for fn in (_chunk_loss, _chunk_vocab_slice_stats, _fused_chunk_grad)))


def _kernels(device: torch.device, compiled: bool | None) -> _ChunkKernels:
    """The chunk functions: compiled when asked, else (None) on CUDA only."""
    return _compiled_kernels() if (device.type == "cuda" if compiled is None else compiled) else _EAGER


def _chunked_cross_entropy(flat_logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                           kernels: _ChunkKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 cross entropy and each token's fp32 log-sum-exp, upcasting one chunk at a time."""
    total = torch.zeros((), dtype=torch.float32, device=flat_logits.device)
    lse = torch.empty(flat_logits.shape[0], dtype=torch.float32, device=flat_logits.device)
    for rows in _row_chunks(flat_logits.shape[0], chunk_tokens):
        chunk_total, lse[rows] = kernels.loss(flat_logits[rows], targets[rows])
        total += chunk_total
    return total, lse


def _vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                  group: dist.ProcessGroup, chunk_tokens: int,
                                  kernels: _ChunkKernels) -> tuple[torch.Tensor, torch.Tensor]:
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
        stats[0, rows], stats[1, rows] = kernels.vocab_slice_stats(local_logits[rows], targets[rows], vocab_start,
                                                                   row_max[rows])
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
                group: dist.ProcessGroup | None, kernels: _ChunkKernels) -> torch.Tensor:
        if group is None:
            total, lse = _chunked_cross_entropy(flat_logits, targets, chunk_tokens, kernels)
        else:
            total, lse = _vocab_parallel_cross_entropy(flat_logits, targets, vocab_start, group, chunk_tokens, kernels)
        ctx.save_for_backward(flat_logits, targets, lse)
        ctx.chunk_tokens, ctx.reuse_logits, ctx.vocab_start = chunk_tokens, reuse_logits, vocab_start
        ctx.kernels = kernels
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        flat_logits, targets, lse = ctx.saved_tensors
        # Logits computed by the model are overwritten by their gradient, chunk by chunk (each chunk is
        # read into fp32 before its rows are written): no second logits-sized buffer, 2 GB less at
        # 8192 x 128,256 in bf16. Nothing reads them after the loss (the head's matmul saved its
        # inputs, not its output), and the write bumps their version, so a second backward through
        # this graph fails loudly instead of reading gradients as logits. A leaf (a caller's own
        # tensor) is never overwritten.
        grad = flat_logits if ctx.reuse_logits else torch.empty_like(flat_logits)
        for rows in _row_chunks(flat_logits.shape[0], ctx.chunk_tokens):
            chunk = flat_logits[rows]
            # The same view object as input and output when overwriting: compiled, two views of one
            # buffer would be traced as aliased inputs.
            ctx.kernels.grad(chunk, targets[rows], ctx.vocab_start, lse[rows], grad_total,
                             chunk if ctx.reuse_logits else grad[rows])
        return grad, None, None, None, None, None, None


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None,
                            compiled: bool | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy in fp32, so callers can normalize globally.

    Computed over chunks of ``chunk_tokens`` tokens (default: ~256 MiB of fp32 logits per chunk), so
    only one chunk is ever upcast to fp32; the gradient w.r.t. ``logits`` has the logits' dtype.
    Logits that an operation computed (not a leaf) are overwritten by their gradient in backward:
    read them before ``backward()`` if you need them. ``compiled``: whether the chunk functions run
    compiled (None: on CUDA only, see the module's docstring).
    """
    flat_logits, flat_targets = logits.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens or loss_chunk_tokens(flat_logits.shape[-1])
    kernels = _kernels(logits.device, compiled)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk, not logits.is_leaf, 0, None, kernels)
    return _chunked_cross_entropy(flat_logits, flat_targets, chunk, kernels)[0]


def vocab_parallel_cross_entropy_sum(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                     group: dist.ProcessGroup, chunk_tokens: int | None = None,
                                     compiled: bool | None = None) -> torch.Tensor:
    """``token_cross_entropy_sum`` of logits split over ``group`` by vocabulary ("loss parallel").

    ``local_logits`` (batch, seq, V_local) are this rank's columns ``[vocab_start, vocab_start +
    V_local)`` of the full logits; ``targets`` (batch, seq) are global token ids, the same on every
    rank, -100 ignored. Returns the same fp32 sum on every rank of ``group``; every rank must call
    it. Chunks of ``chunk_tokens`` tokens (default from the local vocabulary) as in
    ``token_cross_entropy_sum``, and the same in-place gradient for non-leaf logits and choice of
    ``compiled``. A target that no rank holds counts as a logit of 0: targets are range-checked
    where they are read.
    """
    flat_logits, flat_targets = local_logits.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens or loss_chunk_tokens(flat_logits.shape[-1])
    kernels = _kernels(local_logits.device, compiled)
    if torch.is_grad_enabled() and local_logits.requires_grad:
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk, not local_logits.is_leaf,
                                             vocab_start, group, kernels)
    return _vocab_parallel_cross_entropy(flat_logits, flat_targets, vocab_start, group, chunk, kernels)[0]


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Summed fp32 cross entropy of ``logits`` (of the windows ``rows`` selects, when given): plain
    ones, or the vocabulary-sharded DTensor that a tensor-parallel output head returns (then computed
    on each rank's columns, see ``vocab_parallel_cross_entropy_sum``; the same sum on every rank of
    the TP group)."""
    if not isinstance(logits, DTensor):
        return token_cross_entropy_sum(logits if rows is None else logits[rows], targets)
    mesh = logits.device_mesh
    local = logits.to_local()
    vocab_start = local.shape[-1] * mesh.get_local_rank()
    return vocab_parallel_cross_entropy_sum(local if rows is None else local[rows], targets, vocab_start,
                                            mesh.get_group())
