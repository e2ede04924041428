"""Model FLOPs per token and accelerator peaks: what MFU (model FLOPs utilization) is made of."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshtrain.config import ModelArgs

if TYPE_CHECKING:
    from meshtrain.model.context_parallel import ContextParallel


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs (forward + backward) per token: the matrix multiplies, which every token pays
    alike, plus attention, which costs ``per_key`` for each key a query attends to.

    Each weight of a matrix multiply costs 2 FLOPs per token forward and 4 backward, so 6 per
    weight. Attention's QK^T and AV cost 2 * 2 * dim FLOPs per (query, key) pair and layer forward,
    so 12 * layers * dim with backward. The input embedding is a lookup and costs nothing, unless it
    is tied to the output head, which is a matrix multiply.
    """

    matmul: float
    per_key: float

    @classmethod
    def of(cls, args: ModelArgs) -> ModelFlops:
        kv_dim = args.n_kv_heads * args.head_dim
        attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim
        feed_forward = 3 * args.dim * args.ffn_dim
        head = args.vocab_size * args.dim
        matmul_weights = args.n_layers * (attention + feed_forward) + head
        return cls(6.0 * matmul_weights, 12.0 * args.n_layers * args.dim)

    def per_token(self, keys_per_query: float) -> float:
        """FLOPs per token when each query attends to ``keys_per_query`` keys on average."""
        return self.matmul + self.per_key * keys_per_query


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token with attention counted over the whole window: every query against all
    ``seq_len`` keys, no discount for the causal mask nor the document mask. This is the PaLM /
    torchtitan convention, so this figure compares with theirs; the FLOPs a step actually computes
    (:class:`AttentionWork`) are fewer, near half of the attention term with the causal mask alone."""
    return ModelFlops.of(args).per_token(seq_len)


class AttentionWork:
    """The (query, key) pairs that training forwards attended (counted by the training step, from the
    tokens, outside the model), summed until read: the attention FLOPs
    a step actually needs under its mask. Pairs are counted exactly (each query attends its position
    within its document + 1 keys), not by the kernel's blocks: flex attention on a GPU also computes
    the masked-out parts of the 128 x 128 blocks a document boundary crosses, which are not model FLOPs.

    Counting keeps a sum on the device (no sync per forward); :meth:`take` reads it.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pairs: torch.Tensor | None = None  # from position tensors, on their device
        self._causal_pairs = 0  # from windows without a document mask, known from shapes
        self._queries = 0
        self._window = 0

    def count(self, positions: torch.Tensor, window: int) -> None:
        """Queries at ``positions`` (batch, queries) within their documents, of windows of ``window`` tokens."""
        pairs = positions.sum() + positions.numel()
        self._pairs = pairs if self._pairs is None else self._pairs + pairs
        self._queries += positions.numel()
        self._window = window

    def count_tokens(self, tokens: torch.Tensor, document_eos: int | None, context: ContextParallel | None) -> None:
        """The queries a training forward over ``tokens`` (batch, window) computes: every position under the
        causal mask alone, or its position within its document under ``document_eos``; under ``context``
        parallel only this rank's share of each window."""
        from meshtrain.model.documents import document_positions

        batch, window = tokens.shape
        if context is None and document_eos is None:
            self.count_causal(batch, window)
            return
        positions = (document_positions(tokens, document_eos) if document_eos is not None
                     else torch.arange(window, device=tokens.device).expand(batch, -1))
        self.count(positions if context is None else context.shard(positions), window)

    def count_causal(self, batch: int, window: int) -> None:
        """``batch`` whole windows of ``window`` tokens under the causal mask alone."""
        self._causal_pairs += batch * window * (window + 1) // 2
        self._queries += batch * window
        self._window = window

    def take(self) -> tuple[float, int] | None:
        """(keys per query on average, window length) since the last take, or None if nothing was
        counted; starts counting afresh. Reads the device sum (a sync)."""
        if self._queries == 0:
            return None
        pairs = self._causal_pairs + (int(self._pairs.item()) if self._pairs is not None else 0)
        result = (pairs / self._queries, self._window)
        self._reset()
        return result


# Dense (no sparsity) peak FLOP/s from the vendors' data sheets: (bf16, tf32, fp32). The first
# pattern that matches torch.cuda.get_device_name() wins, so more specific names come first.
GPU_PEAK_FLOPS: list[tuple[str, float, float, float]] = [
    (r"GH200|H200|H800|H100.*(SXM|HBM3)", 989.4e12, 494.7e12, 66.9e12),
    (r"H100.*NVL", 835.0e12, 417.5e12, 60.0e12),
    (r"H100", 756.0e12, 378.0e12, 51.2e12),  # PCIe
    (r"B200", 2250.0e12, 1100.0e12, 80.0e12),
    (r"A100|A800", 312.0e12, 156.0e12, 19.5e12),
    (r"L40S", 362.0e12, 183.0e12, 91.6e12),
    (r"\bL4\b", 121.0e12, 60.0e12, 30.3e12),
    (r"\bA10\b", 125.0e12, 62.5e12, 31.2e12),
    (r"MI300X", 1307.4e12, 653.7e12, 163.4e12),
]


def gpu_peak_flops(device_name: str, compute_dtype: torch.dtype, tf32: bool = True) -> float | None:
    """Peak FLOP/s of a GPU model for what its matrix multiplies run in (bf16/fp16; fp32 as TF32 or
    as full fp32), or None if unknown."""
    for pattern, bf16, tf32_peak, fp32 in GPU_PEAK_FLOPS:
        if re.search(pattern, device_name):
            if compute_dtype in (torch.bfloat16, torch.float16):
                return bf16
            return tf32_peak if tf32 else fp32
    return None


def highest_peak_flops(accelerator_type: str) -> float | None:
    """The highest bf16 peak of any GPU model a Ray accelerator type (``H100``, ``A100-80G``) may be,
    or None if unknown: what bounds a step's time from below."""
    family = accelerator_type.split("-")[0].upper()
    peaks = [bf16 for pattern, bf16, _, _ in GPU_PEAK_FLOPS if family in pattern.upper()]
    return max(peaks) if peaks else None


def device_peak_flops(
    device: torch.device, compute_dtype: torch.dtype, override: float | None, cpu_peak: float, tf32: bool = True
) -> float | None:
    """The peak MFU divides by: the user's override, else the GPU table, else the CPU setting."""
    if override is not None:
        return override
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), compute_dtype, tf32)
    return cpu_peak
