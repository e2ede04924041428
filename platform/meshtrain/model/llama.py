"""A Llama decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names follow Meta's Llama layout (``layers.N.attention.wq`` ...). Rotary embeddings use
the "rotate half" pairing, the same as Hugging Face's Llama, so weights export without permutation.
Attention is ``scaled_dot_product_attention(is_causal=True)`` with no mask tensor. With
``model.document_mask`` (:mod:`meshtrain.model.documents`) each token attends only within its own
packed document instead (flex attention's block mask on GPU, a dense mask on CPU), and RoPE positions
restart at each document.

Construction allocates nothing when done under ``torch.device("meta")``; the weights are filled
later by :func:`meshtrain.model.init.init_weights`, which reads :meth:`Transformer.init_std_by_param`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtrain.config import ModelArgs, RopeScaling
from meshtrain.model.context_parallel import ContextParallel, WindowShare
from meshtrain.model.documents import (
    AttentionMask,
    Documents,
    document_ids,
    document_positions,
    find_documents,
    masked_attention,
)

if TYPE_CHECKING:
    from meshtrain.model.stages import ModelStage

Recompute = Literal["none", "full", "selective"]


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The angle per position of each of the head_dim / 2 rotated pairs (fp32).

    With Llama 3 scaling (Hugging Face's "llama3"), a pair whose wavelength is longer than the
    original context / low_freq_factor turns ``factor`` times slower, one shorter than original
    context / high_freq_factor is unchanged, and those between are blended linearly in original
    context / wavelength.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    # 0 at or beyond the low-frequency band's edge, 1 at or beyond the high-frequency band's.
    kept = (scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    kept = kept.clamp(0.0, 1.0)
    return (1 - kept) * inv_freq / scaling.factor + kept * inv_freq


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim), each frequency repeated for both halves."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) ``x`` by position; cos/sin are (seq, head_dim), or
    (batch, seq, head_dim) when positions differ per window (document masking).

    The rotation is computed in fp32 (with fp32 tables: bf16 tables would lose the angle at long
    positions) and returned in ``x``'s dtype, so q, k and v reach attention in one dtype.
    """
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    cos, sin = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | WindowShare = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads counted from the projections: under tensor parallel each rank holds 1/TP of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        grouped = k.shape[1] != q.shape[1]
        if isinstance(mask, WindowShare):  # context parallel: gathers the fewer K/V heads, never repeated
            out = mask.attend(q, k, v, grouped)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        if grouped and not self.native_gqa(q):
            # Query head h reads key/value head h // group (Hugging Face's repeat_kv order);
            # enable_gqa below uses the same mapping without the copy.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            grouped = False
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        else:
            out = masked_attention(q, k, v, mask, grouped)
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
# most to redo. Norms, RoPE and activations are cheap and get recomputed. Attention is one of three
# ops: SDPA's kernel; flex attention's op inside a compiled block; and, in an eager block, the
# separately compiled flex attention (documents.py), which reaches the policy as one
# inductor_compiled_code op since it is compiled with wrap_inductor_compiled_regions.
_SAVED_UNDER_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,  # float8 linears (parallel.float8)
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
    torch.ops.higher_order.inductor_compiled_code,
}


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_UNDER_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> object:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, recompute: Recompute = "none") -> None:
        """``recompute``: what backward recomputes of this block (parallel.activation_checkpointing)."""
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.recompute = recompute

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | WindowShare) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | WindowShare = None) -> torch.Tensor:
        """``mask``: None for causal attention over the window, else a document mask (see documents.py)."""
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin, mask)
        extra = {"context_fn": _selective_context} if self.recompute == "selective" else {}
        return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False, **extra)


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        *,
        document_eos: int | None = None,
        context_parallel: ContextParallel | None = None,
        recompute: Recompute = "none",
    ) -> None:
        """``document_eos``: attend within packed documents split at this token (model.document_mask),
        None = across the whole window; ``context_parallel``: this rank computes its load-balanced share
        of every window (parallel.context); ``recompute``: what each block recomputes in backward."""
        super().__init__()
        self.args = args
        # The ends are None on a pipeline stage that does not hold them (meshtrain.model.stages). Blocks are keyed
        # by their index in the whole model, so parameter names (and checkpoints) do not depend on the split.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(index): TransformerBlock(args, recompute) for index in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(
            args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.document_eos = document_eos
        self.context_parallel = context_parallel
        # Under pipeline parallel: the stages of this part that a pipeline schedule runs (meshtrain.model.stages).
        self.stages: tuple["ModelStage", ...] = ()

    def _may_span_documents(self, tokens: torch.Tensor) -> bool:
        """Whether a window holds a document boundary. On CPU, a batch without one (an end-of-document
        token at a window's start changes nothing) takes the causal kernel, which skips the upper
        triangle that a mask cannot; on GPU the block mask skips it anyway, and asking would sync."""
        return tokens.is_cuda or bool((tokens[:, 1:] == self.document_eos).any())

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq). ``documents``
        overrides the layout found from :attr:`document_eos` (tests pick the kernel this way)."""
        return self.run_blocks(self.embed(tokens), tokens, self.layers.values(), documents, head=True)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: this rank's share of the windows (context parallel) embedded."""
        assert self.tok_embeddings is not None, "a pipeline stage without the embedding embeds nothing"
        if self.context_parallel is not None:
            tokens = self.context_parallel.shard(tokens)
        h = self.tok_embeddings(tokens)
        # Under tensor parallel the embedding's sequence-sharded output is a view (of its reduce-scatter);
        # a compiled first block receiving a view loses the gradient to the embedding (measured: zero),
        # and FSDP's pre-backward hook may be dropped from it. A copy of 1/TP of the activations fixes both.
        return h.clone() if h._is_view() else h

    def run_blocks(self, h: torch.Tensor, tokens: torch.Tensor, blocks: Iterable[nn.Module],
                   documents: Documents | None = None, head: bool = False) -> torch.Tensor:
        """``blocks`` applied to ``h``, the residual stream of the windows ``tokens`` (whole windows: each
        block's RoPE positions and document mask are found from them), then the norm and the output head
        when ``head``: logits."""
        cos, sin, mask = self._attention_inputs(tokens, h.dtype, documents)
        for block in blocks:
            h = block(h, cos, sin, mask)
        if not head:
            return h
        assert self.norm is not None and self.output is not None, "a pipeline stage without the head has no logits"
        return self.output(self.norm(h))

    def _attention_inputs(self, tokens: torch.Tensor, dtype: torch.dtype, documents: Documents | None
                          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMask | WindowShare]:
        """The RoPE tables and the mask every block of a forward reads, from the whole windows ``tokens``."""
        seq = tokens.shape[1]
        context = self.context_parallel
        if context is not None:
            # Documents and RoPE positions are found on the whole window, which every rank of the group holds.
            if self.document_eos is None:
                ids, positions = None, context.positions(seq, tokens.device)
            else:
                ids = document_ids(tokens, self.document_eos)
                positions = context.shard(document_positions(tokens, self.document_eos))
            return self.rope_cos[positions], self.rope_sin[positions], WindowShare(
                context, context.mask(ids, seq, dtype, tokens.device))
        if documents is None and self.document_eos is not None and self._may_span_documents(tokens):
            documents = find_documents(tokens, self.document_eos, dtype=dtype)
        if documents is None:
            return self.rope_cos[:seq], self.rope_sin[:seq], None
        return self.rope_cos[documents.positions], self.rope_sin[documents.positions], documents.mask

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The targets of the positions :meth:`forward` returns logits for (this rank's share of each
        window under context parallel)."""
        return targets if self.context_parallel is None else self.context_parallel.shard(targets)

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` left them uninitialized)."""
        args = self.args
        cos, sin = rope_tables(
            args.head_dim, args.max_seq_len, args.rope_theta, self.rope_cos.device, args.rope_scaling
        )
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


def build_model(
    args: ModelArgs,
    device: torch.device | str = "meta",
    *,
    document_eos: int | None = None,
    context_parallel: ContextParallel | None = None,
    recompute: Recompute = "none",
) -> Transformer:
    """The model with storage on ``device`` (meta by default: shapes only, no memory); the keywords as
    :class:`Transformer` takes them."""
    with torch.device(device):
        return Transformer(args, document_eos=document_eos, context_parallel=context_parallel, recompute=recompute)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "Attention",
    "FeedForward",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "materialize",
    "count_parameters",
    "rope_frequencies",
    "rope_tables",
]
