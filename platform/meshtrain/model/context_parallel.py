"""Context parallelism (``parallel.context``) that keeps the document mask: Llama 3's all-gather design.

Each rank of a context-parallel group holds a load-balanced share of every window: the window is cut
in ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so every rank has
the same causal work. A rank computes q/k/v for its own positions, all-gathers k and v over the group
(the backward reduce-scatters their gradients back to the ranks that own them), and attends its local
queries over the whole window under the mask restricted to its query rows. With grouped-query attention
k and v are a fraction of q, so gathering them costs less than ring attention's exchanges, and any mask
(documents of any length) stays exact.

Masks follow :mod:`meshtrain.model.documents`: on GPU a flex-attention ``BlockMask`` with
``Q_LEN = local_seq`` and ``KV_LEN = seq``; on CPU SDPA with an additive (batch or 1, 1, local_seq, seq)
mask in the compute dtype. Either is built once per forward and shared by every block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from meshtrain.model.documents import Kernel, masked_attention

# torch 2.13 gives the plain functional all-gather autograd and deprecates the _autograd twin that
# torch 2.11 and 2.12 need for it.
_all_gather_with_grad = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd

# What attention() receives: the mask of this rank's query rows over the whole window.
ContextMask = torch.Tensor | BlockMask
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _chunk_length(seq: int, cp_size: int) -> int:
    if seq % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq} is not a multiple of 2 x the context-parallel size ({2 * cp_size}): "
            f"set data.seq_len to a multiple of {2 * cp_size}"
        )
    return seq // (2 * cp_size)


def load_balanced_positions(
    seq: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 global positions held by ``cp_rank``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``
    of the window cut in ``2 * cp_size`` chunks."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is outside a group of {cp_size}")
    chunk = _chunk_length(seq, cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    index = torch.arange(chunk, device=device)
    return torch.cat((index + first, index + second))


def allowed_keys(query_positions: torch.Tensor, document_ids: torch.Tensor | None, seq: int) -> torch.Tensor:
    """Boolean (batch or 1, local_seq, seq): query row i may read key j when j is not after its global
    position and, under ``document_ids`` (batch, seq), lies in the same document."""
    keys = torch.arange(seq, device=query_positions.device)
    allowed = (keys[None, :] <= query_positions[:, None])[None]
    if document_ids is None:
        return allowed
    return allowed & (document_ids[:, query_positions, None] == document_ids[:, None, :])


def sdpa_mask(
    query_positions: torch.Tensor, document_ids: torch.Tensor | None, seq: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive SDPA mask (batch or 1, 1, local_seq, seq) in ``dtype`` of :func:`allowed_keys`."""
    allowed = allowed_keys(query_positions, document_ids, seq)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None]


def context_mask_mod(query_positions: torch.Tensor, document_ids: torch.Tensor | None) -> MaskMod:
    """Flex attention's mask_mod of :func:`allowed_keys`: the local query index maps through
    ``query_positions`` to its global position."""

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv <= query_positions[q]

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        position = query_positions[q]
        return (kv <= position) & (document_ids[b, position] == document_ids[b, kv])

    return causal if document_ids is None else same_document_causal


def context_block_mask(
    query_positions: torch.Tensor, document_ids: torch.Tensor | None, seq: int, compile: bool = True
) -> BlockMask:
    """A ``BlockMask`` of (local_seq, seq) for :func:`context_mask_mod`; compiled (as documents.py does)
    it is built block by block, never as a (local_seq, seq) tensor."""
    batch = None if document_ids is None else document_ids.shape[0]
    return create_block_mask(
        context_mask_mod(query_positions, document_ids),
        batch,
        None,
        query_positions.numel(),
        seq,
        device=query_positions.device,
        _compile=compile,
    )


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group: shards windows, builds the local mask, and attends over the window."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> ContextParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def positions(self, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
        """This rank's global positions in a window of ``seq`` tokens."""
        return load_balanced_positions(seq, self.size, self.rank, device)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of ``t`` along ``dim`` (tokens, targets, RoPE positions), in
        :meth:`positions` order."""
        chunk = _chunk_length(t.shape[dim], self.size)
        second = 2 * self.size - 1 - self.rank
        return torch.cat((t.narrow(dim, self.rank * chunk, chunk), t.narrow(dim, second * chunk, chunk)), dim)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole window along ``dim`` from every rank's share (the inverse of :meth:`shard`).
        Differentiable: the backward reduce-scatters, summing all ranks' gradients into each share."""
        if self.size == 1:
            return t
        # Functional collectives: autograd (backward = reduce_scatter_tensor, which gloo and NCCL both
        # run) and traceable inside compiled blocks.
        gathered = _all_gather_with_grad(t.movedim(dim, 0).contiguous(), 0, self.group)
        shares = gathered.unflatten(0, (self.size, 2, -1))
        # Rank r's first chunk is chunk r, its second chunk is chunk 2 * size - 1 - r.
        chunks = [shares[r, 0] for r in range(self.size)] + [shares[r, 1] for r in reversed(range(self.size))]
        return torch.cat(chunks).movedim(0, dim)

    def mask(
        self,
        document_ids: torch.Tensor | None,
        seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernel: Kernel | None = None,
    ) -> ContextMask:
        """This rank's query rows of the window's mask, built once per forward for every block:
        ``document_ids`` (batch, seq) over the whole window (:func:`documents.document_ids`) or None for
        causal attention. ``kernel`` defaults to flex on CUDA, SDPA (mask in ``dtype``) elsewhere."""
        device = torch.device(device)
        kernel = kernel or ("flex" if device.type == "cuda" else "sdpa")
        query_positions = self.positions(seq, device)
        if kernel == "sdpa":
            return sdpa_mask(query_positions, document_ids, seq, dtype)
        return context_block_mask(query_positions, document_ids, seq)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask, enable_gqa: bool
    ) -> torch.Tensor:
        """Attention of local q (batch, heads, local_seq, head_dim) over the whole window: local k/v
        (batch, kv_heads, local_seq, head_dim), un-repeated under GQA, are gathered in one collective."""
        k, v = self.gather(torch.stack((k, v)), dim=3).unbind(0)
        return masked_attention(q, k, v, mask, enable_gqa)


class WindowShare:
    """What each block's attention receives under context parallel: the group, and this rank's rows of
    the window's mask (built once per forward). A plain class, like ``documents.Documents``: FSDP's
    input hooks would rebuild a dataclass or a tuple, and a block mask must reach the blocks as it is."""

    def __init__(self, context: ContextParallel, mask: ContextMask) -> None:
        self.context, self.mask = context, mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        return self.context.attention(q, k, v, self.mask, enable_gqa)


__all__ = [
    "ContextMask",
    "ContextParallel",
    "WindowShare",
    "allowed_keys",
    "context_block_mask",
    "context_mask_mod",
    "load_balanced_positions",
    "sdpa_mask",
]
