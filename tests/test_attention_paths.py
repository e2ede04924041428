"""Attention's fast paths: native GQA in SDPA, fp32 RoPE tables under FSDP2 bf16 mixed precision, and
selective recompute keeping attention's output on every kernel path."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._python_dispatch import TorchDispatchMode

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


# --- Selective recompute keeps attention's output: one attention forward per block and micro-batch ---

_ATTENTION_KERNELS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
}


class AttentionKernelRuns(TorchDispatchMode):
    """Counts SDPA kernels that run. Entered before the step, it sits below the checkpoint's own
    modes: an output that selective recompute serves from its cache never reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.runs += func in _ATTENTION_KERNELS
        return func(*args, **(kwargs or {}))


_FLEX_RUNS = [0]


@torch.library.custom_op("meshtrain_test::count_attention_run", mutates_args=())
def _count_attention_run(allowed: torch.Tensor) -> torch.Tensor:
    _FLEX_RUNS[0] += 1
    return allowed.clone()


@_count_attention_run.register_fake
def _(allowed: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(allowed)


def flex_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                  enable_gqa: bool = False) -> torch.Tensor:
    """Flex attention's contract with a backward on CPU (torch 2.13's CPU flex has none): attention under
    ``block_mask``'s mask_mod from ops that inductor turns into kernels of its own, as it does flex
    attention, so nothing inside is visible to the checkpoint policy. Each run calls a counting op."""
    if enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    batch, seq = q.shape[0], q.shape[2]
    positions = torch.arange(seq, device=q.device)
    allowed = block_mask.mask_mod(torch.arange(batch, device=q.device)[:, None, None, None], None,
                                  positions[:, None], positions[None, :])
    allowed = _count_attention_run(allowed)
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights[..., None] * v[:, :, None, :, :]).sum(-2)


RECOMPUTE_MICRO_BATCHES = 2


def one_step(model: Transformer, seed: int) -> list[torch.Tensor]:
    """``train_step`` over RECOMPUTE_MICRO_BATCHES micro-batches of packed documents; the gradients
    the optimizer saw."""
    from meshtrain.distributed.layout import RankLayout, WorkerLayout
    from meshtrain.train.guard import SpikeRules, StepGuard
    from meshtrain.train.step import train_step

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(RECOMPUTE_MICRO_BATCHES):
        tokens = torch.randint(1, model.args.vocab_size, (2, 33), generator=generator)
        tokens[:, 5::11] = 0  # end-of-document tokens: several documents per window
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda *_: grads.extend(p.grad.full_tensor() for p in model.parameters()))
    guard = StepGuard(optimizer, torch.device("cpu"), SpikeRules(window=4))
    train_step(model, guard, batches, RankLayout(WorkerLayout(0, 1), MeshPlan(1, 1, True)), grad_clip=0.0)
    return grads


def recompute_model(recompute: str, seed: int = 0, document_eos: int | None = 0) -> Transformer:
    args = tiny_args()
    model = build_model(args, "meta", document_eos=document_eos, recompute=recompute)
    parallelize(model, build_mesh(MeshPlan(1, 1, True), "cpu"), MeshPlan(1, 1, True),
                ParallelConfig(activation_checkpointing=recompute))
    materialize(model, "cpu")
    init_weights(model, seed)
    return model


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Documents take the flex path (the GPU's) with :func:`flex_stand_in` compiled in flex attention's place."""
    import meshtrain.model.documents as documents

    monkeypatch.setattr(documents, "flex_attention", flex_stand_in)
    monkeypatch.setattr(model_module, "find_documents", functools.partial(documents.find_documents, kernel="flex"))
    documents._compiled_flex_attention.cache_clear()
    yield
    documents._compiled_flex_attention.cache_clear()


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_selective_recompute_runs_sdpa_once_per_block_and_micro_batch(single_rank_group: None, documents: bool) -> None:
    runs = {}
    for recompute in ("selective", "full"):
        model = recompute_model(recompute, document_eos=0 if documents else None)
        with AttentionKernelRuns() as counter:
            one_step(model, seed=1)
        runs[recompute] = counter.runs
    forwards = model.args.n_layers * RECOMPUTE_MICRO_BATCHES
    assert runs == {"selective": forwards, "full": 2 * forwards}  # full recompute runs each one again


def test_selective_recompute_keeps_the_separately_compiled_flex_attentions_output(
    single_rank_group: None, flex_on_cpu: None
) -> None:
    """Uncompiled blocks call flex attention through its own compiled function, a region the
    checkpoint policy sees only as one wrapped op: its forward runs once per block and micro-batch,
    and the step's gradients are those of no recompute."""
    runs, grads = {}, {}
    for recompute in ("selective", "full", "none"):
        model = recompute_model(recompute)
        _FLEX_RUNS[0] = 0
        grads[recompute] = one_step(model, seed=2)
        runs[recompute] = _FLEX_RUNS[0]
    forwards = model.args.n_layers * RECOMPUTE_MICRO_BATCHES
    assert runs == {"selective": forwards, "full": 2 * forwards, "none": forwards}
    assert len(grads["selective"]) == len(grads["none"]) > 0
    for selective, plain in zip(grads["selective"], grads["none"]):
        torch.testing.assert_close(selective, plain, rtol=1e-5, atol=1e-7)


def test_selective_recompute_keeps_flex_attention_inside_compiled_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """parallel.compile: the checkpoint is traced into each block's graph and the partitioner follows
    the policy. Flex attention's forward must sit in the forward graph only (full recompute would put
    it in the backward graph too). torch 2.13 refuses a CPU flex backward at trace time; the graphs
    are only built here, never run backward."""
    import torch.nn.attention.flex_attention as flex_module
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from meshtrain.model.documents import find_documents
    from test_model import initialized_model

    graphs: list[tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = []

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        graphs.append((forward, backward))
        return forward, backward

    def keep(graph: torch.fx.GraphModule, _: Any) -> Any:
        return make_boxed_func(graph)

    monkeypatch.setattr(flex_module, "_validate_device", lambda *_: None)
    model = initialized_model(tiny_args(), recompute="selective")
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition)
    for block in model.layers.values():
        block.compile(fullgraph=True, backend=backend)
    tokens = torch.randint(1, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[:, 5::11] = 0
    model(tokens, find_documents(tokens, 0, "flex"))

    def flex_forwards(graph: torch.fx.GraphModule) -> int:
        return sum(node.target is torch.ops.higher_order.flex_attention for node in graph.graph.nodes)

    assert len(graphs) == 1  # one graph for every block
    forward, backward = graphs[0]
    assert (flex_forwards(forward), flex_forwards(backward)) == (1, 0)
