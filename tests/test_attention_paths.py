"""Attention's fast paths: native GQA in SDPA, and fp32 RoPE tables under FSDP2 bf16 mixed precision."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import meshtrain.model.llama as model_module
from meshtrain.config import ModelArgs, ParallelConfig
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.parallelize import build_mesh, parallelize
from meshtrain.model.init import init_weights
from meshtrain.model.llama import (
    Attention,
    Transformer,
    apply_rope,
    build_model,
    materialize,
    rope_tables,
)
from test_model import tiny_args


def repeated_kv_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The previous implementation: K/V copied up to n_heads with repeat_interleave (HF repeat_kv order)."""
    batch, seq, _ = x.shape
    group = attn.n_heads // attn.n_kv_heads
    q = apply_rope(attn.wq(x).view(batch, seq, attn.n_heads, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(batch, seq, attn.n_kv_heads, -1), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(batch, seq, attn.n_kv_heads, -1).transpose(1, 2)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def forward_and_grads(fn: Any, attn: Attention, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_()
    attn.zero_grad()
    out = fn(x)
    out.float().square().sum().backward()
    return out.detach(), [x.grad] + [p.grad.clone() for p in attn.parameters()]


def record_sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    original = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append({"dtypes": (q.dtype, k.dtype, v.dtype), "kv_heads": k.shape[1], **kwargs})
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_native_gqa_equals_repeated_kv_bitwise(
    monkeypatch: pytest.MonkeyPatch, n_kv_heads: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    attn = Attention(tiny_args(n_kv_heads=n_kv_heads)).to(dtype)
    cos, sin = rope_tables(attn.head_dim, 24, 10000.0)
    x = torch.randn(2, 24, 64, dtype=dtype)

    expected, expected_grads = forward_and_grads(lambda t: repeated_kv_attention(attn, t, cos, sin), attn, x)
    calls = record_sdpa_calls(monkeypatch)
    actual, actual_grads = forward_and_grads(lambda t: attn(t, cos, sin), attn, x)

    # The fused kernel read the un-repeated K/V itself.
    assert [(c["kv_heads"], c["enable_gqa"]) for c in calls] == [(n_kv_heads, True)]
    assert actual.dtype == dtype
    assert torch.equal(actual, expected)
    for got, want in zip(actual_grads, expected_grads, strict=True):
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            # bf16 dK/dV: the group's per-head gradients are summed in another order (and rounding)
            # than repeat_interleave's backward; both stay within bf16 rounding of an fp64 reference.
            assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def test_repeat_fallback_matches_native_gqa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where native GQA is refused (fp32 on CUDA), the repeated-K/V branch gives the same result."""
    torch.manual_seed(0)
    attn = Attention(tiny_args(n_kv_heads=1))
    cos, sin = rope_tables(attn.head_dim, 16, 10000.0)
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        native = attn(x, cos, sin)
        calls = record_sdpa_calls(monkeypatch)
        monkeypatch.setattr(Attention, "native_gqa", staticmethod(lambda q: False))
        fallback = attn(x, cos, sin)
    assert [(c["kv_heads"], c["enable_gqa"]) for c in calls] == [(attn.n_heads, False)]
    torch.testing.assert_close(fallback, native, rtol=0, atol=1e-6)


def test_native_gqa_is_refused_only_for_fp32_off_cpu() -> None:
    assert Attention.native_gqa(torch.empty(1, dtype=torch.float32))
    assert Attention.native_gqa(torch.empty(1, dtype=torch.bfloat16, device="meta"))
    assert not Attention.native_gqa(torch.empty(1, dtype=torch.float32, device="meta"))


def bf16_sharded_model(args: ModelArgs, seed: int) -> Transformer:
    plan = MeshPlan(1, 1, True)
    model = build_model(args, "meta")
    parallelize(model, build_mesh(plan, "cpu"), plan, ParallelConfig(mixed_precision="bf16"))
    materialize(model, "cpu")
    init_weights(model, seed)
    return model


def bf16_reference(args: ModelArgs, seed: int, table_dtype: torch.dtype) -> Transformer:
    """The unsharded model with bf16 weights and RoPE tables of ``table_dtype``."""
    model = materialize(build_model(args, "meta"), "cpu")
    init_weights(model, seed)
    cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
    model.to(torch.bfloat16)  # casts the tables too: put them back in the chosen dtype
    model.rope_cos, model.rope_sin = cos.to(table_dtype), sin.to(table_dtype)
    return model


def test_bf16_fsdp_keeps_rope_tables_fp32(single_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    args = tiny_args(max_seq_len=256)
    model = bf16_sharded_model(args, seed=3)
    rope_seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def recording_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rope_seen.append((x.dtype, cos.dtype, sin.dtype))
        return apply_rope(x, cos, sin)

    monkeypatch.setattr(model_module, "apply_rope", recording_rope)
    sdpa_calls = record_sdpa_calls(monkeypatch)
    tokens = torch.randint(0, args.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)

    bf16, fp32 = torch.bfloat16, torch.float32
    assert rope_seen == [(bf16, fp32, fp32)] * (2 * args.n_layers)  # q and k of every block
    assert [c["dtypes"] for c in sdpa_calls] == [(bf16, bf16, bf16)] * args.n_layers
    assert logits.dtype == bf16

    with torch.no_grad():
        fp32_tables = bf16_reference(args, 3, fp32)(tokens)
        bf16_tables = bf16_reference(args, 3, bf16)(tokens)
    assert torch.equal(logits, fp32_tables)
    assert not torch.equal(logits, bf16_tables)  # the table dtype is visible in the output
