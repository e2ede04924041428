"""A Llama decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names follow Meta's Llama layout (``layers.N.attention.wq`` ...). Rotary embeddings use
the "rotate half" pairing, the same as Hugging Face's Llama, so weights export without permutation.
Attention is ``scaled_dot_product_attention(is_causal=True)``: no mask is ever materialized.

Construction allocates nothing when done under ``torch.device("meta")``; the weights are filled
later by :func:`meshtrain.init.init_weights`, which reads :meth:`Transformer.init_std_by_param`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtrain.config import ModelArgs

Recompute = Literal["none", "full", "selective"]


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim), each frequency repeated for both halves."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) ``x`` by position; cos/sin are (seq, head_dim).

    The rotation is computed in fp32 (with fp32 tables: bf16 tables would lose the angle at long
    positions) and returned in ``x``'s dtype, so q, k and v reach attention in one dtype.
    """
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    cos, sin = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    @staticmethod
    def native_gqa(q: torch.Tensor) -> bool:
        """Whether SDPA's fused kernels for ``q`` read the fewer K/V heads themselves (``enable_gqa``).

        In torch 2.13 the CPU flash kernel does in any float dtype; on CUDA only flash and cuDNN do,
        and both need fp16/bf16. fp32 CUDA with ``enable_gqa`` would fall to the math kernel, which
        builds the full (seq, seq) scores: repeating K/V for the memory-efficient kernel is cheaper.
        """
        return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        grouped = self.n_kv_heads != self.n_heads
        if grouped and not self.native_gqa(q):
            # Query head h reads key/value head h // group (Hugging Face's repeat_kv order);
            # enable_gqa below uses the same mapping without the copy.
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Outputs worth keeping under selective recomputation: the matmuls and attention, which cost the
# most to redo. Norms, RoPE and activations are cheap and get recomputed.
_SAVED_UNDER_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_UNDER_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> object:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.recompute: Recompute = "none"

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin)
        extra = {"context_fn": _selective_context} if self.recompute == "selective" else {}
        return checkpoint(self._forward, x, cos, sin, use_reentrant=False, **extra)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq)."""
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` left them uninitialized)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def init_std_by_param(self) -> dict[str, float | None]:
        """Std of the normal init for each parameter name; None = ones (norm weights).

        Residual-branch output projections (wo, w2) are scaled by 1/sqrt(2 * n_layers) so the residual
        stream's variance does not grow with depth.
        """
        std = self.args.init_std
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        plan: dict[str, float | None] = {}
        for name, _ in self.named_parameters():
            if name.endswith("norm.weight"):
                plan[name] = None
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                plan[name] = residual_std
            else:
                plan[name] = std
        return plan


def materialize(
    model: Transformer, device: torch.device | str, buffer_device: torch.device | str | None = None
) -> Transformer:
    """Allocate (uninitialized) storage for a meta-built model, keeping tied weights tied: parameters
    on ``device``, buffers (the RoPE tables) on ``buffer_device`` (default: ``device``).

    Under FSDP2 CPU offload the parameters live on the host, but FSDP moves only the root's inputs to
    the GPU: buffers read inside the blocks must already sit on the compute device.
    ``to_empty`` swaps in new parameter objects, which would silently untie a shared embedding.
    """
    model.to_empty(device=device)
    if buffer_device is not None and torch.device(buffer_device) != torch.device(device):
        _move_buffers_empty(model, torch.device(buffer_device))
    if model.args.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        model.output.weight = model.tok_embeddings.weight
    return model


def _move_buffers_empty(model: nn.Module, device: torch.device) -> None:
    """Replace every buffer with uninitialized storage on ``device`` (persistence unchanged)."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            # Module.__setattr__ on a registered buffer name rebinds the buffer in place.
            setattr(module, name, torch.empty_like(buffer, device=device))


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    """The model with storage on ``device`` (meta by default: shapes only, no memory)."""
    with torch.device(device):
        return Transformer(args)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


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
                chunk_tokens: int) -> torch.Tensor:
        total, lse = _chunked_cross_entropy(flat_logits, targets, chunk_tokens)
        ctx.save_for_backward(flat_logits, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        flat_logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            _chunk_grad(flat_logits[rows], targets[rows], lse[rows], grad_total, grad[rows])
        return grad, None, None


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy in fp32, so callers can normalize globally.

    Computed over chunks of ``chunk_tokens`` tokens (default: ~256 MiB of fp32 logits per chunk), so
    only one chunk is ever upcast to fp32; the gradient w.r.t. ``logits`` has the logits' dtype.
    """
    flat_logits, flat_targets = logits.flatten(0, 1), targets.flatten()
    chunk = chunk_tokens or loss_chunk_tokens(flat_logits.shape[-1])
    if torch.is_grad_enabled() and logits.requires_grad:
        return _ChunkedCrossEntropySum.apply(flat_logits, flat_targets, chunk)
    return _chunked_cross_entropy(flat_logits, flat_targets, chunk)[0]


__all__ = [
    "Attention",
    "FeedForward",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "materialize",
    "count_parameters",
    "loss_chunk_tokens",
    "rope_tables",
    "token_cross_entropy_sum",
]
