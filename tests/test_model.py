"""The Llama decoder on its own: shapes, causality, attention against explicit references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import ModelArgs, RopeScaling
from meshtrain.model.init import init_weights
from meshtrain.model.llama import (
    Attention,
    apply_rope,
    build_model,
    count_parameters,
    materialize,
    rope_frequencies,
    rope_tables,
)


def tiny_args(**overrides: object) -> ModelArgs:
    values = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=97, max_seq_len=64,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02,
    )
    values.update(overrides)
    return ModelArgs(**values)


def initialized_model(args: ModelArgs, seed: int = 0, **built_with: object) -> torch.nn.Module:
    """The model of ``args`` initialized from ``seed`` on the CPU; ``built_with``: :class:`Transformer`'s
    keywords (document_eos, recompute): models of one seed hold the same weights whatever they are."""
    model = materialize(build_model(args, "meta", **built_with), "cpu")
    init_weights(model, seed)
    return model


def test_logits_shape_and_meta_build_allocates_nothing() -> None:
    args = tiny_args()
    meta = build_model(args, "meta")
    assert all(p.is_meta for p in meta.parameters())
    model = initialized_model(args)
    tokens = torch.randint(0, args.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, args.vocab_size)


def test_changing_a_later_token_leaves_earlier_logits_unchanged() -> None:
    model = initialized_model(tiny_args())
    tokens = torch.randint(0, 97, (2, 24))
    t = 10
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 97
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t + 1 :], before[:, t + 1 :])


def reference_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Textbook multi-head attention with an explicit causal mask (kv heads repeated by hand)."""
    batch, seq, _ = x.shape
    group = attn.n_heads // attn.n_kv_heads
    q = apply_rope(attn.wq(x).view(batch, seq, attn.n_heads, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(batch, seq, attn.n_kv_heads, -1), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(batch, seq, attn.n_kv_heads, -1).transpose(1, 2)
    k = torch.stack([k[:, h // group] for h in range(attn.n_heads)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(attn.n_heads)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return attn.wo((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_explicit_masked_softmax(n_kv_heads: int) -> None:
    torch.manual_seed(0)
    args = tiny_args(n_kv_heads=n_kv_heads)
    attn = Attention(args)
    cos, sin = rope_tables(args.head_dim, 16, args.rope_theta)
    x = torch.randn(2, 16, args.dim)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-6)


def test_gqa_with_all_kv_heads_is_multi_head_attention() -> None:
    """kv heads = heads is plain MHA: equal to torch's own MultiheadAttention (RoPE disabled)."""
    torch.manual_seed(0)
    args = tiny_args(n_kv_heads=4)
    attn = Attention(args)
    mha = torch.nn.MultiheadAttention(args.dim, args.n_heads, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]))
        mha.out_proj.weight.copy_(attn.wo.weight)
        seq = 12
        x = torch.randn(2, seq, args.dim)
        identity_cos, zero_sin = torch.ones(seq, args.head_dim), torch.zeros(seq, args.head_dim)
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        expected, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
        torch.testing.assert_close(attn(x, identity_cos, zero_sin), expected, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_equals_mha_with_shared_kv_weights() -> None:
    """GQA with 2 kv heads = MHA whose k/v projections repeat each kv head for its query group."""
    torch.manual_seed(0)
    gqa = Attention(tiny_args(n_kv_heads=2))
    mha = Attention(tiny_args(n_kv_heads=4))
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            heads = getattr(gqa, name).weight.view(2, gqa.head_dim, -1)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(2, dim=0).reshape(-1, heads.shape[-1]))
        cos, sin = rope_tables(gqa.head_dim, 10, 10000.0)
        x = torch.randn(2, 10, 64)
        torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    head_dim = 16
    cos, sin = rope_tables(head_dim, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, head_dim), torch.randn(1, 1, 1, head_dim)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q.expand(1, 32, 1, head_dim), cos, sin)[0, i, 0]
        kj = apply_rope(k.expand(1, 32, 1, head_dim), cos, sin)[0, j, 0]
        return qi @ kj

    torch.testing.assert_close(score(5, 2), score(20, 17), rtol=1e-4, atol=1e-5)


LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_llama3_rope_scaling_equals_transformers_tables() -> None:
    """Llama 3.1's scaled RoPE (head_dim 128, base 500000, 8192 original positions) against transformers'
    LlamaRotaryEmbedding over 3x the original context, in a model's tables as built and as rebuilt."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, positions = 128, 500000.0, 3 * 8192
    original = LLAMA31_SCALING.original_max_position_embeddings
    wavelengths = 2 * math.pi / rope_frequencies(head_dim, theta)
    kept, stretched = wavelengths < original / 4, wavelengths > original
    assert kept.any() and stretched.any() and not (kept | stretched).all()  # and some are blended  # kept, blended and stretched frequencies are all compared
    config = LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=positions,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, **LLAMA31_SCALING.model_dump()},
    )
    expected_cos, expected_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(positions)[None])
    args = tiny_args(
        dim=2 * head_dim, n_heads=2, n_kv_heads=2, max_seq_len=positions, rope_theta=theta,
        rope_scaling=LLAMA31_SCALING,
    )
    built = build_model(args, "cpu")
    rebuilt = initialized_model(args)  # materialized from meta: reset_rope fills the tables
    for cos, sin in [rope_tables(head_dim, positions, theta, scaling=LLAMA31_SCALING),
                     (built.rope_cos, built.rope_sin), (rebuilt.rope_cos, rebuilt.rope_sin)]:
        torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=1e-6)
    plain_cos, _ = rope_tables(head_dim, positions, theta)
    assert (plain_cos - expected_cos[0]).abs().max() > 0.5  # the scaling changes the tables


def test_tied_embeddings_share_one_parameter() -> None:
    untied = build_model(tiny_args(), "meta")
    tied = build_model(tiny_args(tie_embeddings=True), "meta")
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count_parameters(untied) - count_parameters(tied) == 97 * 64


def test_init_is_seeded_and_depth_scaled() -> None:
    args = tiny_args(n_layers=8, dim=256, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=512)
    a, b, c = initialized_model(args, 0), initialized_model(args, 0), initialized_model(args, 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.layers["0"].attention_norm.weight, torch.ones(256))
    std_q = a.layers["0"].attention.wq.weight.std().item()
    std_o = a.layers["0"].attention.wo.weight.std().item()
    assert std_q == pytest.approx(0.02, rel=0.05)
    assert std_o == pytest.approx(std_q / math.sqrt(2 * 8), rel=0.05)


def test_selective_and_full_recompute_match_plain_gradients() -> None:
    args = tiny_args()
    tokens = torch.randint(0, 97, (2, 16))
    grads = {}
    for mode in ("none", "full", "selective"):
        model = initialized_model(args, recompute=mode)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("full", "selective"):
        for g_plain, g_mode in zip(grads["none"], grads[mode]):
            torch.testing.assert_close(g_mode, g_plain, rtol=1e-5, atol=1e-7)


def test_materialized_tied_model_stays_tied() -> None:
    model = initialized_model(tiny_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_recompute_modes_keep_the_activations_the_plan_expects() -> None:
    """Activation bytes alive after forward, tracked by PyTorch's MemTracker: selective recompute
    (matmul and attention outputs kept) sits between none and full, and the plan's per-layer
    estimate holds within 10% where it is the whole story (none, selective)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from meshtrain.distributed.plan import activation_bytes

    args = tiny_args(n_layers=4, max_seq_len=128)
    tokens = torch.randint(0, args.vocab_size, (4, 128))
    logits = tokens.numel() * args.vocab_size * 4
    kept: dict[str, int] = {}
    for mode in ("none", "selective", "full"):
        model = initialized_model(args, recompute=mode)
        tracker = MemTracker()
        tracker.track_external(model, tokens)
        with tracker:
            out = model(tokens)
            kept[mode] = tracker.get_tracker_snapshot("current")[torch.device("cpu")][_MemRefType.ACT] - logits
            F.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
    assert kept["none"] > 1.5 * kept["selective"] > 1.5 * kept["full"] > 0, kept
    for mode in ("none", "selective"):
        planned = activation_bytes(args, mode, tokens.numel(), 4)
        assert abs(planned / kept[mode] - 1) < 0.10, (mode, planned, kept[mode])
