"""Context parallelism: each rank attends its load-balanced share of a window over the gathered keys and
values, and gets exactly the outputs and gradients of single-process attention over the whole window."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from meshtrain.model.context_parallel import (
    ContextParallel,
    allowed_keys,
    context_block_mask,
    context_mask_mod,
    load_balanced_positions,
    sdpa_mask,
)
from meshtrain.model.documents import document_ids, find_documents
from ranks import run_on_ranks

EOS = 0
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def packed_tokens(seq: int) -> torch.Tensor:
    """Two windows of several documents; with seq 16 and cp 2 (chunks of 4) documents cross chunk
    boundaries, and the second window opens inside a document."""
    tokens = torch.randint(1, 50, (BATCH, seq), generator=torch.Generator().manual_seed(7))
    tokens[0, [0, 3, 9, seq - 2]] = EOS
    tokens[1, [6, 7, 13]] = EOS
    return tokens


def window_inputs(seq: int) -> tuple[torch.Tensor, ...]:
    """q, k, v for the whole window and a fixed weighting of the output, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=generator) for _ in range(2))
    weights = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator)
    return q, k, v, weights


def full_attention(seq: int, documents: bool) -> list[torch.Tensor]:
    """Single-process attention over the whole window: output and q/k/v gradients."""
    q, k, v, weights = (t.requires_grad_() for t in window_inputs(seq))
    if documents:
        mask = find_documents(packed_tokens(seq), EOS, kernel="sdpa").mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * weights.detach()).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def context_parallel_attention(rank: int, world_size: int, seq: int, documents: bool) -> list[torch.Tensor]:
    """This rank's output and q/k/v gradients, its share of the window only."""
    cp = ContextParallel.of(dist.group.WORLD)
    q, k, v, weights = (cp.shard(t, dim=2) for t in window_inputs(seq))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ids = document_ids(packed_tokens(seq), EOS) if documents else None
    mask = cp.mask(ids, seq, q.dtype, q.device)
    out = cp.attention(q, k, v, mask, enable_gqa=True)
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize(
    ("cp_size", "seq", "documents"), [(2, 16, True), (2, 16, False), (2, 32, True), (4, 16, True)]
)
def test_each_rank_gets_the_outputs_and_gradients_of_attention_over_the_whole_window(
    cp_size: int, seq: int, documents: bool
) -> None:
    full = full_attention(seq, documents)
    per_rank = run_on_ranks(context_parallel_attention, cp_size, seq, documents)
    for rank, local in enumerate(per_rank):
        positions = load_balanced_positions(seq, cp_size, rank)
        for name, got, whole in zip(("output", "q.grad", "k.grad", "v.grad"), local, full, strict=True):
            torch.testing.assert_close(got, whole[:, :, positions], rtol=0, atol=1e-5, msg=f"rank {rank} {name}")


def test_the_document_mask_matters_across_chunks() -> None:
    """The document case differs from plain causal on every rank's rows: the test above can fail."""
    causal, documents = full_attention(16, documents=False)[0], full_attention(16, documents=True)[0]
    for rank in range(2):
        positions = load_balanced_positions(16, 2, rank)
        assert (causal[:, :, positions] - documents[:, :, positions]).abs().max() > 1e-2


def gather_round_trip(rank: int, world_size: int) -> list[torch.Tensor]:
    cp = ContextParallel.of(dist.group.WORLD)
    window = torch.arange(2 * 24 * 3, dtype=torch.float32).view(2, 24, 3)
    share = cp.shard(window, dim=1).requires_grad_()
    gathered = cp.gather(share, dim=1)
    (gathered * window).sum().backward()  # every rank weights the window the same way
    return [gathered.detach(), share.grad]


def test_gather_is_the_inverse_of_shard_and_its_backward_sums_every_ranks_gradient() -> None:
    window = torch.arange(2 * 24 * 3, dtype=torch.float32).view(2, 24, 3)
    for rank, (gathered, grad) in enumerate(run_on_ranks(gather_round_trip, 2)):
        assert torch.equal(gathered, window)
        assert torch.equal(grad, 2 * window[:, load_balanced_positions(24, 2, rank)])


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_positions_partition_the_window_with_equal_causal_work(cp_size: int) -> None:
    seq = 48
    shares = [load_balanced_positions(seq, cp_size, rank) for rank in range(cp_size)]
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(seq))
    for share in shares:
        assert share.dtype == torch.int64 and len(share) == seq // cp_size
        chunk = seq // (2 * cp_size)
        assert all((torch.diff(half) == 1).all() for half in share.split(chunk))
    # Query at position p reads p + 1 keys under the causal mask: every rank reads as many.
    assert len({int((share + 1).sum()) for share in shares}) == 1
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_positions(16, 4, 0).tolist() == [0, 1, 14, 15]


def test_a_window_that_does_not_split_in_two_chunks_per_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of 2 x the context-parallel size \\(8\\).*data.seq_len"):
        load_balanced_positions(20, 4, 0)
    with pytest.raises(ValueError, match="outside a group of 2"):
        load_balanced_positions(16, 2, 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [True, False])
def test_the_flex_mask_mod_and_block_mask_are_the_sdpa_mask(documents: bool) -> None:
    """The GPU path checked on CPU: the mask_mod element by element, and flex attention (eager, forward
    only on CPU) with the uncompiled BlockMask against SDPA with the additive mask."""
    seq, cp_size = 32, 2
    ids = document_ids(packed_tokens(seq), EOS) if documents else None
    q, k, v, _ = window_inputs(seq)
    for rank in range(cp_size):
        positions = load_balanced_positions(seq, cp_size, rank)
        expected = allowed_keys(positions, ids, seq)
        mod = context_mask_mod(positions, ids)
        b, qi, kv = torch.meshgrid(
            torch.arange(expected.shape[0]), torch.arange(len(positions)), torch.arange(seq), indexing="ij"
        )
        assert torch.equal(mod(b, torch.zeros_like(b), qi, kv), expected)
        local_q = q[:, :, positions]
        sdpa = F.scaled_dot_product_attention(
            local_q, k, v, attn_mask=sdpa_mask(positions, ids, seq, q.dtype), enable_gqa=True
        )
        block_mask = context_block_mask(positions, ids, seq, compile=False)
        assert block_mask.shape[-2:] == (len(positions), seq)
        flex = flex_attention(local_q, k, v, block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


def test_the_mask_kernel_follows_the_device() -> None:
    cp = ContextParallel(group=None, size=2, rank=1)  # no collective involved
    ids = document_ids(packed_tokens(16), EOS)
    mask = cp.mask(ids, 16, torch.bfloat16, "cpu")
    assert mask.shape == (BATCH, 1, 8, 16) and mask.dtype == torch.bfloat16
    assert cp.mask(None, 16, torch.float32, "cpu").shape == (1, 1, 8, 16)
