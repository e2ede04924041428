"""Document masking for packed windows (``model.document_mask``).

A training window packs several documents end to end, each followed by the end-of-document token.
Under the document mask a token attends only to earlier tokens of its own document, and RoPE
positions restart at each document, so a document's logits do not depend on what was packed
before it.

Where a document starts: the end-of-document token *opens* the next document. It attends only to
itself at position 0, like a beginning-of-sequence token, so its target (the next document's first
token) is learnt as "how documents begin" rather than guessed from an unrelated document; the last
token of a document still predicts the end-of-document token from its own document. Every target
stays in the loss, so its normalisation (global target count from shapes) is unchanged. A window
that begins inside a document treats that part as a document starting at position 0.

Two kernels: on GPU, flex attention with a ``BlockMask`` built once per micro-batch (its memory is
per 128x128 block, never (seq, seq)); on CPU, SDPA with an explicit additive mask of (seq, seq) per
sample in the compute dtype, built once per forward and shared by every block (a boolean mask would
be converted, and kept for backward, in each block).
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Kernel = Literal["flex", "sdpa"]
# What a block's attention receives: None (causal over the window) or a document mask of either kernel.
AttentionMask = torch.Tensor | BlockMask | None


class Documents:
    """The document layout of a batch of windows: RoPE positions (batch, seq) and the attention mask.

    Deliberately neither a dataclass nor a tuple: FSDP's input hooks rebuild those, and a block mask
    must reach the blocks as it is.
    """

    def __init__(self, positions: torch.Tensor, mask: torch.Tensor | BlockMask) -> None:
        self.positions = positions
        self.mask = mask


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) index of each token's document within its window; an end-of-document token
    opens the next one."""
    return torch.cumsum(tokens == eos_id, dim=1)


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) position of each token within its document: 0 at each end-of-document token
    and at the window's start."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.where(tokens == eos_id, index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=1).values


def find_documents(
    tokens: torch.Tensor, eos_id: int, kernel: Kernel | None = None, dtype: torch.dtype = torch.float32
) -> Documents:
    """The layout of ``tokens`` (batch, seq); ``kernel`` defaults to flex on CUDA, SDPA elsewhere,
    whose mask is in ``dtype`` (the attention's)."""
    kernel = kernel or ("flex" if tokens.is_cuda else "sdpa")
    ids = document_ids(tokens, eos_id)
    positions = document_positions(tokens, eos_id)
    if kernel == "sdpa":
        seq = tokens.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
        allowed = (ids[:, :, None] == ids[:, None, :]) & causal
        mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill_(~allowed, float("-inf"))
        return Documents(positions, mask[:, None])

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (ids[b, q] == ids[b, kv]) & (q >= kv)

    batch, seq = tokens.shape
    # Compiled so the mask is built block by block, never as a (seq, seq) tensor.
    block_mask = create_block_mask(same_document_causal, batch, None, seq, seq, device=tokens.device, _compile=True)
    return Documents(positions, block_mask)


@cache
def _compiled_flex_attention() -> object:
    # Flex attention is only fast compiled: outside a compiled block it runs through this wrapper.
    # Wrapped as one inductor_compiled_code op, so selective recompute can save its output
    # (torch's checkpoint policy cannot see into a compiled region otherwise and reruns it).
    return torch.compile(flex_attention, dynamic=False, options={"wrap_inductor_compiled_regions": True})


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask, enable_gqa: bool
) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q/k/v under a document mask from :func:`find_documents`."""
    if isinstance(mask, BlockMask):
        # Inside a compiled block (parallel.compile) the block's graph compiles it.
        attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
        return attend(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


__all__ = ["AttentionMask", "Documents", "document_ids", "document_positions", "find_documents", "masked_attention"]
