"""The vocabulary-parallel loss on gloo ranks: the loss and the gradient of each rank's slice of the
vocabulary are those of token_cross_entropy_sum on the full logits, with two all-reduces a forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from meshtrain.model.loss import token_cross_entropy_sum, vocab_parallel_cross_entropy_sum
from ranks import run_on_ranks


# name: (batch, seq, vocab, dtype, chunk, seed); vocab is divisible by every world size used.
CASES: dict[str, tuple[int, int, int, torch.dtype, int | None, int]] = {
    "fp32_chunks": (3, 7, 48, torch.float32, 4, 0),  # 21 tokens: 5 chunks of 4 and one of 1
    "fp32_one_chunk": (2, 5, 48, torch.float32, None, 1),  # default chunk: all 10 tokens at once
    "bf16_chunks": (2, 8, 48, torch.bfloat16, 3, 2),
}
UPSTREAM = -2.5  # the loss is scaled before backward, so the gradient must carry the incoming one
IGNORED = [(0, 0), (1, 3), (1, 4)]  # (batch, seq) positions whose target is -100


def full_case(batch: int, seq: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    for position in IGNORED:
        targets[position] = -100
    return logits, targets


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_cross_entropy_sum on the full logits in this process: the loss and the full gradient."""
    leaf = logits.clone().requires_grad_()
    loss = token_cross_entropy_sum(leaf, targets)
    (loss * UPSTREAM).backward()
    return loss.detach(), leaf.grad


def _count_all_reduces(calls: list[str]) -> Any:
    """Replace dist.all_reduce in this rank's process by a wrapper that records each call."""
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"{tuple(tensor.shape)}")
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    return original


def _losses_on_a_rank(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank: loss and slice gradient (leaf logits), the all-reduces of each
    phase, the no-grad loss, and what backward does to non-leaf logits."""
    results: dict[str, Any] = {}
    calls: list[str] = []
    original = _count_all_reduces(calls)
    try:
        for name, (batch, seq, vocab, dtype, chunk, seed) in CASES.items():
            logits, targets = full_case(batch, seq, vocab, dtype, seed)
            width = vocab // world
            start = rank * width
            local = logits[..., start:start + width].clone().requires_grad_()
            calls.clear()
            loss = vocab_parallel_cross_entropy_sum(local, targets, start, dist.group.WORLD, chunk)
            forward_calls = list(calls)
            calls.clear()
            (loss * UPSTREAM).backward()
            backward_calls = list(calls)
            with torch.no_grad():
                no_grad_loss = vocab_parallel_cross_entropy_sum(local, targets, start, dist.group.WORLD, chunk)

            computed = local.detach().clone().requires_grad_() * 1.0  # a non-leaf, as a model's head output is
            seen: list[int] = []
            computed.register_hook(lambda grad, seen=seen: seen.append(grad.data_ptr()))
            (vocab_parallel_cross_entropy_sum(computed, targets, start, dist.group.WORLD, chunk) * UPSTREAM).backward()
            results[name] = {
                "loss": loss.detach(), "grad": local.grad, "start": start, "width": width,
                "forward_calls": forward_calls, "backward_calls": backward_calls, "no_grad_loss": no_grad_loss,
                "no_grad_has_graph": no_grad_loss.grad_fn is not None,
                "leaf_untouched": torch.equal(local.detach(), logits[..., start:start + width]),
                "reused_storage": seen == [computed.data_ptr()], "computed_after": computed.detach().clone(),
            }
    finally:
        dist.all_reduce = original
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """All cases, run once per world size (spawning ranks costs seconds, the cases milliseconds)."""
    return run_on_ranks(_losses_on_a_rank, request.param)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(loss rtol, gradient atol). bf16: both sides upcast the same bf16 values, so the losses differ
    by fp32 rounding only, and each gradient is rounded to bf16 once (one ulp of 2.5 is 2**-6)."""
    return (1e-6, 1e-6 * abs(UPSTREAM)) if dtype == torch.float32 else (2e-6, 2**-6)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_is_the_full_vocabulary_loss_on_every_rank(ranks: list[dict[str, Any]], name: str) -> None:
    batch, seq, vocab, dtype, _, seed = CASES[name]
    ref_loss, _ = reference(*full_case(batch, seq, vocab, dtype, seed))
    rtol, _ = tolerances(dtype)
    for result in ranks:
        assert result[name]["loss"].dtype == torch.float32 and result[name]["loss"].shape == ()
        torch.testing.assert_close(result[name]["loss"], ref_loss, rtol=rtol, atol=0.0)
        assert torch.equal(result[name]["loss"], ranks[0][name]["loss"])  # bitwise the same on every rank
        assert torch.equal(result[name]["no_grad_loss"], result[name]["loss"])
        assert not result[name]["no_grad_has_graph"]


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_is_the_slice_of_the_full_gradient(ranks: list[dict[str, Any]], name: str) -> None:
    batch, seq, vocab, dtype, _, seed = CASES[name]
    _, ref_grad = reference(*full_case(batch, seq, vocab, dtype, seed))
    _, atol = tolerances(dtype)
    for result in ranks:
        start, width, grad = result[name]["start"], result[name]["width"], result[name]["grad"]
        assert grad.dtype == dtype and grad.shape == (batch, seq, width)
        torch.testing.assert_close(grad.float(), ref_grad[..., start:start + width].float(), rtol=0.0, atol=atol)
        for position in IGNORED:
            assert not grad[position].any()
    # Independent of the reference (which shares the gradient code): softmax - onehot sums to 0 over
    # the whole vocabulary, so the slices' row sums add up to 0 for every token.
    row_sums = sum(result[name]["grad"].double().sum(-1) for result in ranks)
    torch.testing.assert_close(row_sums, torch.zeros_like(row_sums), rtol=0.0, atol=vocab * atol)


@pytest.mark.parametrize("name", list(CASES))
def test_two_all_reduces_per_forward_and_none_in_backward(ranks: list[dict[str, Any]], name: str) -> None:
    batch, seq = CASES[name][:2]
    for result in ranks:
        # One MAX of the per-token max, one SUM of (sum-exp, target logit): never one per chunk.
        assert result[name]["forward_calls"] == [f"({batch * seq},)", f"(2, {batch * seq})"]
        assert result[name]["backward_calls"] == []


@pytest.mark.parametrize("name", list(CASES))
def test_computed_logits_are_overwritten_by_their_gradient_and_leaves_are_not(
        ranks: list[dict[str, Any]], name: str) -> None:
    dtype = CASES[name][3]
    for result in ranks:
        assert result[name]["reused_storage"]  # the hook saw the logits' own storage
        assert torch.equal(result[name]["computed_after"], result[name]["grad"])  # it now holds the gradient
        assert result[name]["leaf_untouched"]
        assert result[name]["computed_after"].dtype == dtype
