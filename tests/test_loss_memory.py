"""The chunked token cross entropy: same loss and gradient as the plain fp32 formula, less memory; its
compiled chunk functions (the CUDA default) give the eager ones' values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.model.loss import token_cross_entropy_sum, vocab_parallel_cross_entropy_sum


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The formula the chunked loss replaces: one fp32 copy of all logits."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def loss_and_grad(loss_fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_()
    loss = loss_fn(leaf, targets)
    loss.backward()
    return loss.detach(), leaf.grad


def random_case(batch: int, seq: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 4).to(dtype)
    return logits, torch.randint(0, vocab, (batch, seq), generator=gen)


# (batch, seq): 2x8 = 16 tokens is a multiple of the chunk of 4; 3x7 = 21 is not; chunk 64 > 21 is one chunk.
SHAPES = [((2, 8), 4), ((3, 7), 4), ((3, 7), 64), ((1, 5), 1)]


@pytest.mark.parametrize(("batch_seq", "chunk"), SHAPES)
def test_fp32_loss_and_gradient_match_the_plain_formula(batch_seq: tuple[int, int], chunk: int) -> None:
    logits, targets = random_case(*batch_seq, vocab=50, dtype=torch.float32)
    ref_loss, ref_grad = loss_and_grad(plain_loss, logits, targets)
    loss, grad = loss_and_grad(lambda x, t: token_cross_entropy_sum(x, t, chunk), logits, targets)
    # Not bit-exact: chunk sums are added in another order, and softmax is exp(x - lse).
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0.0)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, ref_grad, rtol=0.0, atol=1e-6)  # gradient entries lie in [-1, 1]


@pytest.mark.parametrize(("batch_seq", "chunk"), SHAPES)
def test_bf16_loss_and_gradient_match_the_plain_formula(batch_seq: tuple[int, int], chunk: int) -> None:
    logits, targets = random_case(*batch_seq, vocab=50, dtype=torch.bfloat16, seed=1)
    ref_loss, ref_grad = loss_and_grad(plain_loss, logits, targets)
    loss, grad = loss_and_grad(lambda x, t: token_cross_entropy_sum(x, t, chunk), logits, targets)
    # Both upcast the same bf16 values to fp32, so the losses differ only by fp32 rounding.
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0.0)
    # The gradient is rounded to bf16 once in both; allow one bf16 ulp near the largest entries.
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=0.0, atol=2**-8)


def test_gradient_scales_with_the_upstream_gradient_and_skips_ignored_targets() -> None:
    logits, targets = random_case(2, 6, vocab=33, dtype=torch.float32, seed=2)
    targets[0, 3] = -100  # F.cross_entropy's ignore_index
    scaled = lambda fn: lambda x, t: fn(x, t) * -2.5  # noqa: E731
    ref_loss, ref_grad = loss_and_grad(scaled(plain_loss), logits, targets)
    loss, grad = loss_and_grad(scaled(lambda x, t: token_cross_entropy_sum(x, t, 5)), logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(grad, ref_grad, rtol=0.0, atol=3e-6)
    assert not grad[0, 3].any()


def test_no_grad_returns_a_plain_fp32_sum() -> None:
    logits, targets = random_case(2, 8, vocab=40, dtype=torch.bfloat16, seed=3)
    logits.requires_grad_()
    with torch.no_grad():
        loss = token_cross_entropy_sum(logits, targets, 3)
    assert loss.dtype == torch.float32 and loss.grad_fn is None
    torch.testing.assert_close(loss, plain_loss(logits.detach(), targets), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_computed_logits_are_overwritten_by_their_gradient_not_copied(dtype: torch.dtype) -> None:
    """Logits an operation computed get their gradient written into their own buffer (no second
    logits-sized tensor), and the gradient that flows on is the plain formula's."""
    logits, targets = random_case(3, 7, vocab=50, dtype=dtype, seed=2)
    ref_loss, ref_grad = loss_and_grad(plain_loss, logits, targets)
    leaf = logits.detach().clone().requires_grad_()
    computed = leaf * 1.0  # a non-leaf, as the model's head output is
    seen: list[int] = []
    computed.register_hook(lambda grad: seen.append(grad.data_ptr()))
    loss = token_cross_entropy_sum(computed, targets, 4)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0.0)
    loss.backward()
    assert seen == [computed.data_ptr()]  # the gradient lives in the logits' own storage
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0.0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    untouched = logits.detach().clone().requires_grad_()  # a caller's leaf keeps its values
    token_cross_entropy_sum(untouched, targets, 4).backward()
    assert torch.equal(untouched.detach(), logits)


def computed_loss_and_grad(loss_fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_and_grad`` of logits an operation computed, which the loss overwrites with their gradient."""
    leaf = logits.detach().clone().requires_grad_()
    loss = loss_fn(leaf * 1.0, targets)
    loss.backward()
    return loss.detach(), leaf.grad


def test_compiled_chunks_give_the_eager_loss_and_gradient() -> None:
    """Compiled on CPU here (inductor's C++ backend; CUDA compiles by default), as training calls it:
    computed logits overwritten by their gradient, 21 tokens in chunks of 4 (the shorter last chunk
    makes a second, dynamic graph), an ignored target. fp32 only: a bf16 gradient is the same fp32
    value rounded once. jobs/bench_loss.py measures the speed."""
    logits, targets = random_case(3, 7, vocab=50, dtype=torch.float32, seed=4)
    targets[1, 2] = -100
    eager_loss, eager_grad = computed_loss_and_grad(lambda x, t: token_cross_entropy_sum(x, t, 4, compiled=False),
                                                    logits, targets)
    loss, grad = computed_loss_and_grad(lambda x, t: token_cross_entropy_sum(x, t, 4, compiled=True), logits, targets)
    # The same fp32 math, its sums in another order (inductor's vectorized reductions).
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(grad, eager_grad, rtol=0.0, atol=1e-6)  # entries lie in [-1, 1]
    assert not grad[1, 2].any()
    with torch.no_grad():
        torch.testing.assert_close(token_cross_entropy_sum(logits, targets, 4, compiled=True), eager_loss, rtol=1e-6, atol=0.0)


def test_chunk_functions_run_compiled_by_default_on_cuda_only() -> None:
    from meshtrain.model.loss import _EAGER, _compiled_kernels, _kernels

    assert _kernels(torch.device("cuda", 0), None) is _compiled_kernels() is not _EAGER
    assert _kernels(torch.device("cpu"), None) is _EAGER
    assert _kernels(torch.device("cpu"), True) is _compiled_kernels()
    assert _kernels(torch.device("cuda", 0), False) is _EAGER


def test_compiled_vocabulary_slice_chunks_give_the_eager_loss_and_gradient(single_rank_group: None) -> None:
    """The loss-parallel chunk functions compiled, on one rank holding the first 50 columns of a larger
    vocabulary: the targets from 50 up are another rank's, whose logit counts 0 here."""
    logits, targets = random_case(3, 7, vocab=50, dtype=torch.float32, seed=5)
    targets = targets + 10
    targets[0, 0] = -100
    assert (targets >= 50).any()

    def sliced(compiled: bool):
        return lambda x, t: vocab_parallel_cross_entropy_sum(x, t, 0, dist.group.WORLD, 4, compiled=compiled)

    eager_loss, eager_grad = computed_loss_and_grad(sliced(False), logits, targets)
    loss, grad = computed_loss_and_grad(sliced(True), logits, targets)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(grad, eager_grad, rtol=0.0, atol=1e-6)


# Runs in a fresh process. Each phase resets the kernel's peak-RSS mark (clear_refs 5), so VmHWM minus
# the RSS at the phase's start is that phase's peak extra memory. MALLOC_MMAP_THRESHOLD_ (set by the
# caller) makes glibc return every large block to the kernel on free, so phases do not hide each other.
PROBE = r"""
import json, sys, torch, torch.nn.functional as F
from meshtrain.model.loss import token_cross_entropy_sum

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

def peak_extra(run):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS:")
    run()
    return status("VmHWM:") - start

tokens, vocab, chunk = map(int, sys.argv[1:4])
logits = torch.empty(1, tokens, vocab, dtype=torch.bfloat16).uniform_(-4, 4).requires_grad_()
targets = torch.randint(0, vocab, (1, tokens))

def plain():
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").backward()
    logits.grad = None

def chunked():
    token_cross_entropy_sum(logits, targets, chunk).backward()
    logits.grad = None

def plain_eval():
    with torch.no_grad():
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

def chunked_eval():
    with torch.no_grad():
        token_cross_entropy_sum(logits, targets, chunk)

def chunked_compiled():
    token_cross_entropy_sum(logits, targets, chunk, compiled=True).backward()
    logits.grad = None

# Compiled once, on one chunk's shape, before anything is measured (inductor's own memory is not the loss's).
warm = logits.detach()[:, :chunk].clone().requires_grad_()
token_cross_entropy_sum(warm, targets[:, :chunk], chunk, compiled=True).backward()
del warm

print(json.dumps({name: peak_extra(fn) for name, fn in
                  [("plain", plain), ("chunked", chunked), ("plain_eval", plain_eval), ("chunked_eval", chunked_eval),
                   ("chunked_compiled", chunked_compiled)]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_chunked_loss_peak_memory_is_far_below_the_plain_formula() -> None:
    tokens, vocab, chunk = 256, 128_256, 64
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tokens), str(vocab), str(chunk)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout)
    per_element = {name: extra / (tokens * vocab) for name, extra in peaks.items()}
    print(f"\npeak extra memory over bf16 logits of {tokens}x{vocab}, chunk {chunk} tokens: "
          + ", ".join(f"{name} {extra / 2**20:.0f} MiB ({per_element[name]:.2f} B/token/vocab)"
                      for name, extra in peaks.items()))
    # Plain: fp32 log-softmax saved + two fp32 gradients in backward (~12 B per token per vocab entry).
    assert per_element["plain"] > 10
    # Chunked: the bf16 gradient (2 B) plus one chunk's fp32 buffers.
    assert peaks["chunked"] < 0.4 * peaks["plain"]
    assert peaks["chunked_eval"] < 0.4 * peaks["plain_eval"]
    # Compiled (the CUDA default), inductor's fused chunk kernels keep the same bound.
    assert peaks["chunked_compiled"] < 0.4 * peaks["plain"]
