"""float8 training (parallel.float8) on CPU, through torchao's emulation of its float8 matrix multiplies.

Emulation performs the same casts to float8 (tensorwise: e4m3 weights and inputs, e5m2 gradients,
one dynamic scale per tensor; rowwise: e4m3 throughout, one power-of-two scale per row) as the GPU
kernels and multiplies the dequantized values, so what is proven here is the numerics and the
plumbing: which layers convert, float8 FSDP all-gathers (sent as bytes over gloo) with their
per-step scale precompute, checkpoints and export. Speed needs a GPU (bench_gpu.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model

from meshtrain.checkpoint.export import export_checkpoint
from meshtrain.checkpoint.reading import load_model_state
from meshtrain.cluster.preflight import preflight
from meshtrain.config import ConfigError, ModelArgs
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.distributed.float8 import (
    Float8Unavailable,
    accelerator_lacks_float8,
    check_float8_device,
    convert_to_float8,
)
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.torch_support import torch_release
from meshtrain.model.args import model_args
from meshtrain.model.llama import build_model
from meshtrain.observe.run_folder import CheckpointLoadRecord, Record, TrainRecord
from meshtrain.train.optim import build_optimizer
from meshtrain.train.setup import fill_model, sharded_meta_model
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks

STEPS = 8
# Largest relative loss difference of float8 from the same run without it, over STEPS steps.
# Measured 7.8e-4 (fp32 base) and 1.3e-3 (bf16 base) on this corpus and shape, two ranks; rowwise
# 5.7e-4 (fp32 base, one process).
FLOAT8_LOSS_RTOL = 5e-3
ROWWISE = ("parallel.float8=true", "parallel.float8_recipe=rowwise")


@pytest.fixture(scope="module")
def corpus(unsplit_corpus: DataPlan) -> DataPlan:
    return unsplit_corpus


def config(storage: Path, name: str, *overrides: str) -> MeshtrainConfig:
    return load_config(
        None,
        [
            f"train.steps={STEPS}", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
            "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=3",
            "optim.lr=0.003", "scaling.num_workers=2", "checkpoint.interval=4", "checkpoint.keep=10",
            "eval.interval=null", f"run.storage_path={storage}", f"run.name={name}", *overrides,
        ],
    )


def _train_rank(rank: int, world: int, cfg: MeshtrainConfig, corpus: DataPlan) -> list[Record]:
    events: list[Record] = []
    train(worker_plan(cfg, corpus), WorkerLayout(rank, world, rank, world, 0), torch.device("cpu"), events.append)
    return events


def run(cfg: MeshtrainConfig, corpus: DataPlan) -> list[Record]:
    if cfg.scaling.num_workers == 1:
        return _train_rank(0, 1, cfg, corpus)
    return run_on_ranks(_train_rank, cfg.scaling.num_workers, cfg, corpus)[0]


def curve(events: list[Record], key: str = "loss") -> dict[int, float]:
    return {e.step: getattr(e, key) for e in events if isinstance(e, TrainRecord)}


def largest_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys() and a
    return max(abs(a[step] - b[step]) / abs(b[step]) for step in a)


def test_only_the_blocks_aligned_linears_become_float8() -> None:
    from torchao.float8.float8_linear import Float8Linear

    args = ModelArgs(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02,
    )
    model = build_model(args, "meta")
    assert convert_to_float8(model, emulate=True, fsdp_all_gather=False) == 2 * 7  # q, k, v, o, w1, w2, w3
    assert not isinstance(model.output, Float8Linear)
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)
    # torch._scaled_mm takes dimensions that are multiples of 16: a 40-wide feed-forward stays as it is.
    unaligned = build_model(args.model_copy(update={"ffn_dim": 40}), "meta")
    assert convert_to_float8(unaligned, emulate=True, fsdp_all_gather=False) == 2 * 4
    assert not isinstance(unaligned.layers["0"].feed_forward.w1, Float8Linear)
    # Under TP=2 each rank multiplies half of k and v's 16 outputs: those two stay too.
    split = build_model(args, "meta")
    assert convert_to_float8(split, emulate=True, fsdp_all_gather=False, tensor=2) == 2 * 5
    assert not isinstance(split.layers["0"].attention.wk, Float8Linear)
    # Rowwise converts the same linears. torchao all-gathers only tensorwise weights in float8 (as
    # its weight wrapper): rowwise weights stay plain, so nothing is gathered as bytes or precomputed.
    gathered = build_model(args, "meta")
    convert_to_float8(gathered, emulate=True, fsdp_all_gather=True)
    assert type(gathered.layers["0"].attention.wq.weight) is not torch.nn.Parameter
    rowwise = build_model(args, "meta")
    assert convert_to_float8(rowwise, emulate=True, fsdp_all_gather=True, recipe="rowwise") == 2 * 7
    assert rowwise.layers["0"].attention.wq.config.round_scales_to_power_of_2
    assert all(type(p) is torch.nn.Parameter for p in rowwise.parameters())


@pytest.mark.skipif(torch_release(torch.__version__) < (2, 13),
                    reason="torch's CPU _scaled_mm takes rowwise scales from 2.13 on: nothing to compare with")
def test_rowwise_emulation_equals_torchaos_scaled_mm_path_on_cpu() -> None:
    """torch's CPU ``_scaled_mm`` takes rowwise scales, so on CPU torchao's unemulated path (the one
    a GPU takes, but for the kernel) runs too. With bf16 operands (a GPU's default) emulation gives
    exactly its output and gradients. With fp32 ones it does not: torchao asks rowwise ``_scaled_mm``
    for bf16 and converts, so a rowwise linear's fp32 output is rounded through bf16 (measured 3.0e-3)."""
    torch.manual_seed(0)
    x, upstream = torch.randn(4, 16, 64), torch.randn(4, 16, 128)
    for dtype in (torch.bfloat16, torch.float32):
        results = []
        for emulate in (True, False):
            torch.manual_seed(1)
            model = torch.nn.Module()
            model.layers = torch.nn.ModuleList([torch.nn.Linear(64, 128, bias=False, dtype=dtype)])
            assert convert_to_float8(model, emulate=emulate, fsdp_all_gather=False, recipe="rowwise") == 1
            inputs = x.to(dtype).requires_grad_()
            output = model.layers[0](inputs)
            (output.float() * upstream).sum().backward()
            results.append([output.detach(), inputs.grad, model.layers[0].weight.grad])
        differences = [float((e - k).abs().max() / k.abs().max()) for e, k in zip(*results)]
        if dtype == torch.bfloat16:
            assert differences == [0.0] * 3
        else:
            assert 0 < differences[0] < 1e-2 and max(differences) < 1e-2


def test_float8_is_refused_before_ray_without_torchao_or_on_gpus_older_than_sm89(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [accelerator_lacks_float8(t) for t in ("A100", "A100-80G", "A10G", "V100", "T4")] == [True] * 5
    assert [accelerator_lacks_float8(t) for t in ("H100", "H200", "L4", "L40S", "B200", "GH200")] == [False] * 6
    gpu = ["parallel.float8=true", "scaling.use_gpu=true"]
    with pytest.raises(ConfigError, match=r"^parallel.float8=true needs compute capability 8.9\+ .*"
                       r"scaling.accelerator_type=A100-80G is older: set parallel.float8=false$"):
        preflight(config(tmp_path, "a100", *gpu, "scaling.accelerator_type=A100-80G"))
    preflight(config(tmp_path, "h100", *gpu, "scaling.accelerator_type=H100"))
    import importlib.util

    with monkeypatch.context() as patched:
        find_spec = importlib.util.find_spec
        patched.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
        with pytest.raises(ConfigError, match=r"needs torchao: pip install -e '.\[float8\]', or set parallel.float8=false"):
            preflight(config(tmp_path, "no-torchao", "parallel.float8=true"))
    preflight(config(tmp_path, "off", "parallel.float8=false"))

    # A worker on a GPU whose type the config did not name checks its device before building the model;
    # with a local Ray (no RAY_ADDRESS) the launch asks this machine's GPUs before Ray starts.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(Float8Unavailable, match=r"this worker's NVIDIA A100-SXM4-80GB is 8.0: set parallel.float8=false$"):
        check_float8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"this machine's NVIDIA A100-SXM4-80GB is 8.0: set parallel.float8=false$"):
        preflight(config(tmp_path, "local-a100", *gpu))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster's GPUs are checked by its workers
    preflight(config(tmp_path, "remote", *gpu))
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(torch.device("cuda", 0))

    # Rowwise needs what tensorwise needs (torch builds its rowwise kernel for sm_89 too), and float8 itself.
    with pytest.raises(ConfigError, match=r"^parallel.float8=true with parallel.float8_recipe=rowwise needs compute "
                       r"capability 8.9\+ .*scaling.accelerator_type=A10G is older: set parallel.float8=false$"):
        preflight(config(tmp_path, "a10g-rowwise", *gpu, *ROWWISE, "scaling.accelerator_type=A10G"))
    preflight(config(tmp_path, "l4-rowwise", *gpu, *ROWWISE, "scaling.accelerator_type=L4"))
    with pytest.raises(ConfigError, match=r"^parallel.float8_recipe=rowwise needs parallel.float8=true; set it, or "
                       r"drop parallel.float8_recipe$"):
        config(tmp_path, "rowwise-alone", "parallel.float8_recipe=rowwise")


def _train_steps(cfg: MeshtrainConfig, plan: MeshPlan, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """A model on ``plan`` (sharded when distributed) and its losses over ``steps`` optimizer steps,
    every rank on the same tokens."""
    model, _ = sharded_meta_model(model_args(cfg.model, 512), cfg.parallel, plan, torch.device("cpu"))
    fill_model(model, torch.device("cpu"), cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def _sharded_steps(
    rank: int, world: int, tensorwise: MeshtrainConfig, rowwise: MeshtrainConfig
) -> tuple[int, list[tuple[float, float]], list[float]]:
    """The block count and (precomputed scale, e4m3 max / global amax) of every tensorwise float8
    weight after two optimizer steps; the losses of three rowwise steps."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    plan = MeshPlan(1, world, True)
    model, _ = _train_steps(tensorwise, plan, 2)
    pairs = []
    for param in model.parameters():
        weight = param._local_tensor  # what FSDP all-gathers (to_local() returns a new wrapper)
        if isinstance(weight, WeightWithDynamicFloat8CastTensor):
            amax = weight._tensor.abs().max()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            expected = torch.finfo(torch.float8_e4m3fn).max / amax
            pairs.append((float(weight._precomputed_scale), float(expected)))
    return len(model.layers), pairs, _train_steps(rowwise, plan, 3)[1]


def test_float8_all_gather_scales_are_precomputed_and_sharded_rowwise_steps_equal_one_process(tmp_path: Path) -> None:
    rowwise = config(tmp_path, "rowwise", *ROWWISE)
    blocks, pairs, sharded_rowwise = run_on_ranks(
        _sharded_steps, 2, config(tmp_path, "scales", "parallel.float8=true"), rowwise
    )[0]
    assert len(pairs) == blocks * 7
    for got, expected in pairs:
        assert got == pytest.approx(expected, rel=1e-6)
    # Rowwise weights are all-gathered in fp32 and cast after, as one process casts them; with the
    # same tokens on both ranks the averaged gradient is one process's too, so every step is equal.
    assert sharded_rowwise == _train_steps(rowwise, MeshPlan(1, 1, True), 3)[1]


@pytest.fixture(scope="module")
def sharded_float8(corpus: DataPlan, tmp_path_factory: pytest.TempPathFactory) -> list[Record]:
    """Two ranks, fp32 base, float8 linears with float8 all-gathers, eager."""
    storage = tmp_path_factory.mktemp("runs")
    return run(config(storage, "float8-sharded", "parallel.float8=true", "checkpoint.enabled=false"), corpus)


def test_float8_tracks_high_precision_and_sharded_and_tensor_parallel_float8_equal_single_process(
    corpus: DataPlan, tmp_path: Path, sharded_float8: list[Record]
) -> None:
    bf16_base = ["parallel.mixed_precision=bf16", "checkpoint.enabled=false"]
    bf16 = run(config(tmp_path, "bf16", *bf16_base), corpus)
    float8_bf16 = run(config(tmp_path, "float8-bf16", *bf16_base, "parallel.float8=true"), corpus)
    difference = largest_relative_difference(curve(float8_bf16), curve(bf16))
    print(f"float8 vs bf16: largest relative loss difference over {STEPS} steps = {difference:.2e}")
    assert 0 < difference <= FLOAT8_LOSS_RTOL

    # Two ranks all-gather float8 shards cast with the precomputed global scale; one process casts
    # the whole weight. The first step's casts are the same, so its loss and gradient norm are too;
    # later steps differ only by fp32 rounding passed through the float8 casts.
    sharded = sharded_float8
    single = run(
        config(tmp_path, "float8-single", "parallel.float8=true", "scaling.num_workers=1", "checkpoint.enabled=false"),
        corpus,
    )
    for key in ("loss", "grad_norm"):
        assert curve(sharded, key)[1] == pytest.approx(curve(single, key)[1], rel=1e-6), key
    assert largest_relative_difference(curve(sharded), curve(single)) <= FLOAT8_LOSS_RTOL

    # TP=2: every cast's scale is over the whole tensor, so the first forward casts what one process
    # casts (with a scale per TP slice the loss differed by 9e-5). Backward sums the row-parallel
    # halves in another order, and a last-bit change can move a value across a float8 rounding
    # boundary: the gradient norm differs by about 1e-4 (measured 1.2e-4).
    tensor_parallel = run(
        config(tmp_path, "float8-tp", "parallel.float8=true", "parallel.tensor=2", "checkpoint.enabled=false"), corpus
    )
    assert curve(tensor_parallel)[1] == pytest.approx(curve(single)[1], rel=1e-6)
    assert curve(tensor_parallel, "grad_norm")[1] == pytest.approx(curve(single, "grad_norm")[1], rel=1e-3)
    assert largest_relative_difference(curve(tensor_parallel), curve(single)) <= FLOAT8_LOSS_RTOL

    # Rowwise, fp32 base, one process (two ranks equal one process: the scales test).
    rowwise = run(config(tmp_path, "rowwise", *ROWWISE, "scaling.num_workers=1", "checkpoint.enabled=false"), corpus)
    fp32 = run(config(tmp_path, "fp32", "scaling.num_workers=1", "checkpoint.enabled=false"), corpus)
    difference = largest_relative_difference(curve(rowwise), curve(fp32))
    print(f"rowwise float8 vs fp32: largest relative loss difference over {STEPS} steps = {difference:.2e}")
    assert 0 < difference <= FLOAT8_LOSS_RTOL


def test_float8_on_a_2x2_hsdp_mesh_equals_1x2(corpus: DataPlan, tmp_path: Path, sharded_float8: list[Record]) -> None:
    """The scale precompute reduces each weight's amax over the shard dim of a 2D mesh; replicas
    hold the same weights, so HSDP gives what one shard group gives (measured: 8e-8)."""
    hsdp = run(
        config(tmp_path, "float8-2x2", "parallel.float8=true", "scaling.num_workers=4", "parallel.shard=2",
               "checkpoint.enabled=false"),
        corpus,
    )
    assert largest_relative_difference(curve(hsdp), curve(sharded_float8)) <= 1e-6


def test_compiled_float8_blocks_with_selective_recompute_track_eager_float8(
    corpus: DataPlan, tmp_path: Path, sharded_float8: list[Record]
) -> None:
    """What the GPU runs (compiled blocks, float8 casts inside their graphs, selective recompute
    saving the float8 matmuls' outputs), on inductor's CPU backend."""
    compiled = run(
        config(tmp_path, "float8-compiled", "parallel.float8=true", "parallel.compile=true",
               "parallel.activation_checkpointing=selective", "checkpoint.enabled=false"),
        corpus,
    )
    for key in ("loss", "grad_norm"):  # inductor reorders fp32 arithmetic: measured 2e-5 at step 1
        assert curve(compiled, key)[1] == pytest.approx(curve(sharded_float8, key)[1], rel=1e-4), key
    assert largest_relative_difference(curve(compiled), curve(sharded_float8)) <= FLOAT8_LOSS_RTOL


def test_float8_checkpoints_resume_exactly_load_into_high_precision_and_export_plain_weights(
    corpus: DataPlan, tmp_path: Path
) -> None:
    unbroken = run(config(tmp_path, "unbroken", "parallel.float8=true"), corpus)
    step4 = tmp_path / "unbroken" / "checkpoints" / "step-00000004"
    for name in ("resumed", "high-precision"):
        shutil.copytree(step4, tmp_path / name / "checkpoints" / step4.name)

    resumed = run(config(tmp_path, "resumed", "parallel.float8=true"), corpus)
    assert [e.step for e in resumed if isinstance(e, CheckpointLoadRecord)] == [4]
    assert curve(resumed) == {step: loss for step, loss in curve(unbroken).items() if step > 4}  # exact

    plain = run(config(tmp_path, "high-precision", "parallel.float8=false"), corpus)
    assert [e.step for e in plain if isinstance(e, CheckpointLoadRecord)] == [4]
    after_load = curve(plain)
    assert after_load.keys() == set(range(5, STEPS + 1))
    # The same weights without float8 casts: the next loss is close to float8's, not a restart's.
    assert after_load[5] == pytest.approx(curve(unbroken)[5], rel=FLOAT8_LOSS_RTOL)
    assert after_load[5] < curve(unbroken)[1] - 0.3

    step8 = tmp_path / "unbroken" / "checkpoints" / f"step-{STEPS:08d}"
    state, args, _ = load_model_state(str(step8))
    export_checkpoint(str(step8), "safetensors", tmp_path / "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    assert weights.keys() == build_model(args, "meta").state_dict().keys()
    for name, tensor in weights.items():
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
        assert torch.equal(tensor, state[name]), name
    load_model(build_model(args, "cpu"), tmp_path / "model.safetensors")  # strict, into a plain model
