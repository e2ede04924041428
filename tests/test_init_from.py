"""Continued pretraining from Hugging Face weights: ``model.init_from`` and the sharded hf export.

A tiny run is trained here, exported to a sharded Hugging Face directory, and loaded back through
``model.init_from`` in one process and on a 2x2 gloo mesh. Logits are compared with the original
model's and with ``transformers.LlamaForCausalLM`` on the exported directory. Tiny Llama 3.1- and
3.2-style checkpoints written by ``transformers`` itself (RoPE scaling, tied or not, bf16) are trained
on the mesh, exported, and compared with their originals in ``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

import meshtrain.checkpoint.dcp_files as dcp_files
import meshtrain.cluster.launcher
from corpora import short_documents_plan
from meshtrain.checkpoint.export import export_checkpoint
from meshtrain.checkpoint.reading import load_model_state
from meshtrain.checkpoint.storage import checkpoint_root
from meshtrain.cli.pretrain import main
from meshtrain.cluster.preflight import preflight
from meshtrain.config import ModelArgs, ModelConfig, RopeScaling
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import (
    DataParallelBatches,
    DataPlan,
    open_data,
    prepare_data,
    tokenizer_vocab_size,
)
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.hf_llama import hf_config, hf_name, llama_shape
from meshtrain.model.init import init_weights
from meshtrain.model.llama import Transformer, build_model
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.observe.run_folder import TrainRecord
from trainers import sharded_model
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
EXPORT_JOB = REPO / "jobs" / "export.py"
DATA = ["data.max_documents=8", "data.seq_len=32"]
RUN = [
    *DATA, "data.vocab_size=300", "train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2",
    "optim.warmup_steps=2", "scaling.num_workers=1", "checkpoint.interval=4", "checkpoint.mode=sync",
    "train.log_every=1",
]
# rope_theta differs from LlamaConfig's default, so a shape that lost it shows in the logits.
SHAPE = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.tie_embeddings=false", "model.rope_theta=500000",
]
SHARD_BYTES = 100_000  # the tiny model is ~450 kB in fp32: several files
TIED_VOCAB = 321  # odd: the 2x2 mesh shards the embedding unevenly
# Llama 3.x-style checkpoints: RoPE scaled past 48 original positions, read over windows of 128. Head
# size 16 at base 500000 has a frequency in each band of the scaling (kept, blended, stretched).
ORIGINAL_CONTEXT = 48
LONG = 128
LLAMA3_STYLES = {"llama3.2": (32.0, True), "llama3.1": (8.0, False)}  # rope scaling factor, tied embeddings
LLAMA3_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Trained:
    corpus: DataPlan
    step: Path  # the committed checkpoint
    args: ModelArgs
    state: dict[str, torch.Tensor]  # its weights
    hf: Path  # its sharded fp32 hf export
    tied: Path  # a tied-embedding hf directory without lm_head.weight or tokenizer.json


def write_tied_dir(path: Path) -> None:
    """A one-file hf directory written straight from an initialized tied model."""
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=TIED_VOCAB, max_seq_len=64,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True, init_std=0.02,
    )
    model = build_model(args, "cpu")
    init_weights(model, seed=3)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(args)))
    save_file({hf_name(name): p.detach() for name, p in model.named_parameters()}, path / "model.safetensors")


def llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT,
    }


def write_transformers_llama3(
    path: Path, vocab_size: int, factor: float, tied: bool, tokenizer: Path
) -> None:
    """A Llama 3.x-style directory as ``transformers`` writes it: bf16 weights in several files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_parameters=llama3_rope(factor),
        initializer_range=0.1,  # logits that move by ~1 where RoPE is wrong (at 0.02: by ~4e-3)
    )
    with torch.random.fork_rng():
        torch.manual_seed(int(factor))
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="40KB")
    shutil.copy(tokenizer, path / "tokenizer.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    storage = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, [*SHAPE, *RUN, f"run.storage_path={storage}", "run.name=base"])
    corpus = prepare_data(
        cfg.data, str(tmp_path_factory.mktemp("stores")), cfg.data.seq_len, use_ray=False, log=lambda _: None
    )
    train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
    root = Path(checkpoint_root(cfg.checkpoint, cfg.run))
    (root.parent / "tokenizer.json").write_text(corpus.tokenizer_json)  # as the launcher does
    step = root / "step-00000004"
    state, args, _ = load_model_state(str(step))
    hf = tmp_path_factory.mktemp("export") / "hf"
    export_checkpoint(str(step), "hf", hf, max_shard_bytes=SHARD_BYTES)
    tied = tmp_path_factory.mktemp("tied") / "hf"
    write_tied_dir(tied)
    return Trained(corpus, step, args, state, hf, tied)


@pytest.fixture(scope="module")
def llama3_dirs(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama3")
    for style, (factor, tied) in LLAMA3_STYLES.items():
        tokenizer = trained.hf / "tokenizer.json"
        write_transformers_llama3(root / style, trained.args.vocab_size, factor, tied, tokenizer)
    return {style: root / style for style in LLAMA3_STYLES}


def transformers_llama(directory: Path) -> Any:
    """``LlamaForCausalLM`` from ``directory`` in fp32, checked to have loaded every tensor."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def long_tokens(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, LONG), generator=torch.Generator().manual_seed(seed))


def init_from_config(directory: Path, *overrides: str) -> MeshtrainConfig:
    """As a run sees it: loaded, then checked against (and completed from) the init_from directory."""
    return preflight(load_config(None, [f"model.init_from={directory}", *DATA, *overrides]))


def load_in_one_process(cfg: MeshtrainConfig, vocab: int) -> Transformer:
    model, layout = sharded_model(cfg, vocab, WorkerLayout(), torch.device("cpu"))
    assert layout.plan.shape == (1, 1)
    return model.eval()


def original_model(trained: Trained) -> Transformer:
    model = build_model(trained.args, "cpu")
    model.load_state_dict(trained.state)
    return model.eval()


# --- one process --------------------------------------------------------------------------------


def test_the_export_is_sharded_with_an_index(trained: Trained) -> None:
    files = sorted(p.name for p in trained.hf.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((trained.hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert all((trained.hf / name).stat().st_size <= SHARD_BYTES + 4096 for name in files)  # + header


def test_init_from_loads_the_exported_weights_and_logits(trained: Trained) -> None:
    from transformers import LlamaForCausalLM

    cfg = init_from_config(trained.hf)
    assert cfg.data.tokenizer == str(trained.hf / "tokenizer.json")  # data.tokenizer=train → the weights'
    vocab = tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size)
    assert vocab == trained.corpus.vocab_size
    assert model_args(cfg.model, vocab) == trained.args  # the shape came from config.json
    loaded = load_in_one_process(cfg, vocab)
    state = loaded.state_dict()
    assert state.keys() == trained.state.keys()
    for name, tensor in trained.state.items():
        assert torch.equal(state[name], tensor), name

    hf, info = LlamaForCausalLM.from_pretrained(trained.hf, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = torch.randint(0, trained.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        actual = loaded(tokens)
        original = original_model(trained)(tokens)
        exported = hf.eval()(tokens).logits
    to_original = (actual - original).abs().max().item()
    to_exported = (actual - exported).abs().max().item()
    print(
        f"\n[init_from] max |logit difference|: loaded vs original {to_original:.3e}, "
        f"loaded vs transformers on the export {to_exported:.3e}"
    )
    assert to_original <= 1e-6 and to_exported <= 1e-6


def test_tied_weights_load_without_lm_head(trained: Trained) -> None:
    cfg = init_from_config(trained.tied, f"data.tokenizer={trained.hf / 'tokenizer.json'}")
    model = load_in_one_process(cfg, trained.corpus.vocab_size)
    assert model.args.tie_embeddings and model.args.vocab_size == TIED_VOCAB
    assert model.output.weight is model.tok_embeddings.weight
    with safe_open(trained.tied / "model.safetensors", "pt") as handle:
        assert "lm_head.weight" not in handle.keys()
        for name, param in model.named_parameters():
            assert torch.equal(param, handle.get_tensor(hf_name(name))), name


@pytest.mark.parametrize("style", list(LLAMA3_STYLES))
def test_transformers_llama3_checkpoints_load_with_their_rope_scaling(
    trained: Trained, llama3_dirs: dict[str, Path], style: str
) -> None:
    """One process: meshtrain's logits are transformers' on a Llama 3.x-style checkpoint past the
    original context, across whole windows (document mask off) and per packed document (on)."""
    directory = llama3_dirs[style]
    factor, tied = LLAMA3_STYLES[style]
    assert len(list(directory.glob("*.safetensors"))) >= 3
    cfg = init_from_config(directory)
    vocab = trained.corpus.vocab_size
    args = model_args(cfg.model, vocab)
    assert args.rope_scaling == RopeScaling(
        factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
    )
    assert args.tie_embeddings is tied and args.max_seq_len == LONG and args.rope_theta == 500000.0
    model = load_in_one_process(cfg, vocab)
    original = transformers_llama(directory)
    eos = trained.corpus.eos_id
    tokens = long_tokens(vocab)
    tokens[tokens == eos] = (eos + 1) % vocab  # no document boundary but the one placed below
    packed = tokens.clone()
    packed[:, 20] = eos  # a short document, then one of 108 tokens: past the original context
    plain = build_model(args.model_copy(update={"rope_scaling": None}), "cpu").eval()
    plain.load_state_dict(model.state_dict())
    masked = build_model(args, "cpu", document_eos=eos).eval()  # the same weights, attending within documents
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = original(tokens).logits
        whole = (model(tokens) - expected).abs()
        unscaled = (plain(tokens) - expected).abs()
        per_document = torch.cat([original(packed[:, :20]).logits, original(packed[:, 20:]).logits], dim=1)
        documents = (masked(packed) - per_document).abs()
    print(
        f"\n[{style}] max |logit difference| to transformers past position {ORIGINAL_CONTEXT}: "
        f"{whole[:, ORIGINAL_CONTEXT:].max():.2e} (all {whole.max():.2e}), document-masked "
        f"{documents[:, 20 + ORIGINAL_CONTEXT:].max():.2e} (all {documents.max():.2e}); without the rope "
        f"scaling {unscaled[:, ORIGINAL_CONTEXT:].max():.2e}"
    )
    assert whole.max() <= 1e-4 and documents.max() <= 1e-4
    assert unscaled[:, ORIGINAL_CONTEXT:].max() > 100 * LLAMA3_TOLERANCE  # the comparison can tell


# The shape keys of Meta's config.json files on the Hugging Face Hub (meta-llama/Llama-3.2-1B,
# Llama-3.2-3B, Llama-3.1-8B).
_META_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "torch_dtype": "bfloat16",
}
_META_ROPE = {
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"
}
PUBLISHED = {
    "llama3.2_1b": {
        **_META_COMMON, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "head_dim": 64, "num_key_value_heads": 8, "intermediate_size": 8192, "tie_word_embeddings": True,
        "rope_scaling": {**_META_ROPE, "factor": 32.0},
    },
    "llama3.2_3b": {
        **_META_COMMON, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
        "head_dim": 128, "num_key_value_heads": 8, "intermediate_size": 8192, "tie_word_embeddings": True,
        "rope_scaling": {**_META_ROPE, "factor": 32.0},
    },
    "llama3.1_8b": {
        **_META_COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False,
        "rope_scaling": {**_META_ROPE, "factor": 8.0},
    },
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_llama3_presets_are_the_published_configs(preset: str, tmp_path: Path) -> None:
    """A preset has the shape model.init_from reads from Meta's config.json, and exports back to it."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[preset]))
    (tmp_path / "model.safetensors").touch()  # only the names of weight files are checked here
    args = ModelConfig(preset=preset).resolved(None)
    assert ModelArgs(**llama_shape(str(tmp_path)), init_std=args.init_std) == args
    exported = hf_config(args)
    for key, value in PUBLISHED[preset].items():
        if key not in ("torch_dtype", "pretraining_tp"):
            assert exported[key] == value, key


def test_continued_training_starts_from_the_weights(trained: Trained, tmp_path: Path) -> None:
    """The first step's loss is the exported model's loss on that step's batch (same seed, same data)."""
    cfg = init_from_config(
        trained.hf, *RUN, "train.steps=1", "optim.warmup_steps=0", "checkpoint.enabled=false",
        "eval.interval=null",
        f"run.storage_path={tmp_path}", "run.name=continued",
    )
    result = train(worker_plan(cfg, trained.corpus), WorkerLayout(), torch.device("cpu"))
    data = open_data(trained.corpus, cfg.data.seq_len, cfg.train.seed)
    batches = DataParallelBatches(data.train, 4, 2, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    model = original_model(trained)
    with torch.no_grad():
        micro_batches = list(batches.next_step())
        loss_sum = sum(token_cross_entropy_sum(model(inputs), targets) for inputs, targets in micro_batches)
    expected = loss_sum.item() / sum(targets.numel() for _, targets in micro_batches)
    assert result.records[0].loss == pytest.approx(expected, rel=1e-6)


def test_a_resumed_run_reads_its_checkpoint_not_the_hf_weights(trained: Trained, tmp_path: Path) -> None:
    """Once a checkpoint is committed the run resumes from it: the Hugging Face weights, which the
    checkpoint replaces anyway, are not read again (here they are no longer safetensors)."""
    hf = Path(shutil.copytree(trained.hf, tmp_path / "hf"))
    settings = [*RUN, "checkpoint.interval=2", "optim.schedule_steps=4", "eval.interval=null", f"run.storage_path={tmp_path}", "run.name=resumed"]
    first = train(worker_plan(init_from_config(hf, *settings, "train.steps=2"), trained.corpus), WorkerLayout(), torch.device("cpu"))
    for weights in hf.glob("*.safetensors"):
        weights.write_bytes(b"overwritten")
    resumed = train(worker_plan(init_from_config(hf, *settings), trained.corpus), WorkerLayout(), torch.device("cpu"))
    assert [r.step for r in first.records if isinstance(r, TrainRecord)] == [1, 2]
    assert [r.step for r in resumed.records if isinstance(r, TrainRecord)] == [3, 4]


# --- a 2x2 mesh ---------------------------------------------------------------------------------


def _load_on_rank(rank: int, world: int, configs: list[tuple[MeshtrainConfig, int]]) -> list[dict[str, Any]]:
    elements_read = [0]
    read_request = HuggingFaceStorageReader._process_read_request

    def counting(self: HuggingFaceStorageReader, file: Any, request: Any, planner: Any) -> None:
        elements_read[0] += math.prod(request.lengths)
        read_request(self, file, request, planner)

    HuggingFaceStorageReader._process_read_request = counting  # this process only
    results = []
    for cfg, vocab in configs:
        elements_read[0] = 0
        layout = WorkerLayout(rank, world, rank % 2, 2, rank // 2)
        model, layout = sharded_model(cfg, vocab, layout, torch.device("cpu"))
        results.append({
            "mesh": layout.plan.shape,
            "read": elements_read[0],
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "full": {name: p.full_tensor() for name, p in model.named_parameters()},
        })
    return results


def _on_rank(
    rank: int,
    world: int,
    loads: list[tuple[MeshtrainConfig, int]],
    runs: dict[tuple[str, bool], MeshtrainConfig],
    corpus: DataPlan,
) -> dict[str, Any]:
    trained = {}
    for key, cfg in runs.items():
        result = train(worker_plan(cfg, corpus), WorkerLayout(rank, world, rank % 2, 2, rank // 2), torch.device("cpu"))
        trained[key] = {"mesh": result.mesh_shape, "losses": {r.step: r.loss for r in result.records}}
    return {"loaded": _load_on_rank(rank, world, loads), "trained": trained}


MESH = ["scaling.num_workers=4", "parallel.shard=2", "train.global_batch_size=8", "train.micro_batch_size=2"]


@dataclass(frozen=True)
class MeshRun:
    """What each of 4 gloo ranks (a 2x2 HSDP mesh) did in one run: models loaded, and short trainings."""

    loads: list[tuple[MeshtrainConfig, int]]
    meshes: list[tuple[int, ...]]
    runs: dict[tuple[str, bool], MeshtrainConfig]  # (Llama 3.x style, document mask) → a 2-step run from it
    ranks: list[dict[str, Any]]


@pytest.fixture(scope="module")
def on_a_2x2_mesh(
    trained: Trained, llama3_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> MeshRun:
    tokenizer = f"data.tokenizer={trained.hf / 'tokenizer.json'}"
    vocab = trained.corpus.vocab_size
    loads = [
        (init_from_config(trained.hf, *MESH), vocab),
        (init_from_config(trained.tied, tokenizer, *MESH), vocab),
        (init_from_config(llama3_dirs["llama3.2"], *MESH), vocab),  # bf16, tied, as transformers wrote it
        # Replicated twice x tensor parallel 2: column and row shards of every block, the vocabulary split.
        (init_from_config(trained.hf, *MESH, "parallel.tensor=2", "parallel.shard=1"), vocab),
    ]
    meshes = [(2, 2), (2, 2), (2, 2), (2, 1, 2)]  # two workers per node: one TP group each
    storage = tmp_path_factory.mktemp("llama3-runs")
    runs = {
        # Windows of 128 tokens, past the original 48; each style with the document mask on and off.
        (style, mask): init_from_config(
            directory, *RUN, *MESH, f"data.seq_len={LONG}", "train.steps=2", "optim.lr=1e-9",
            "optim.warmup_steps=0", "checkpoint.interval=2", "eval.interval=null",
            f"model.document_mask={str(mask).lower()}", f"run.storage_path={storage}",
            f"run.name={style}-{'mask' if mask else 'nomask'}",
        )
        for style, directory in llama3_dirs.items()
        for mask in (True, False)
    }
    # Documents of tens of tokens, several to a window, in the weights' own tokenizer: the mask matters.
    short = short_documents_plan(tmp_path_factory.mktemp("short-documents"), 400, seq_len=LONG,
                                 tokenizer=str(trained.hf / "tokenizer.json"))
    return MeshRun(loads, meshes, runs, run_on_ranks(_on_rank, 4, loads, runs, short))


def test_a_2x2_mesh_loads_the_same_weights_each_rank_reading_its_shards(on_a_2x2_mesh: MeshRun) -> None:
    loads = on_a_2x2_mesh.loads
    expected = [dict(load_in_one_process(cfg, vocab).named_parameters()) for cfg, vocab in loads]
    for rank in on_a_2x2_mesh.ranks:
        for result, reference, mesh_shape in zip(rank["loaded"], expected, on_a_2x2_mesh.meshes, strict=True):
            assert result["mesh"] == mesh_shape
            assert result["full"].keys() == reference.keys()
            for name, tensor in result["full"].items():
                assert torch.equal(tensor, reference[name]), name
            # Every element of this rank's shards was read once, and nothing else: about half the model.
            total = sum(t.numel() for t in reference.values())
            assert result["read"] == result["local"] < 0.6 * total


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "nomask"])
@pytest.mark.parametrize("style", list(LLAMA3_STYLES))
def test_transformers_llama3_checkpoints_train_on_a_2x2_mesh_and_export_the_same_logits(
    on_a_2x2_mesh: MeshRun, llama3_dirs: dict[str, Path], style: str, mask: bool, tmp_path: Path
) -> None:
    """The issue's proof: loaded with model.init_from on a 2x2 HSDP mesh, trained 2 steps at lr 1e-9
    with the document mask on or off, exported, and read back by transformers: the original's logits
    past the original context."""
    factor, tied = LLAMA3_STYLES[style]
    for rank in on_a_2x2_mesh.ranks:
        run = rank["trained"][style, mask]
        assert run["mesh"] == (2, 2) and list(run["losses"]) == [1, 2]
        assert all(math.isfinite(loss) for loss in run["losses"].values())
    # The mask changes what the 2 steps computed (several documents share each window).
    losses = {m: on_a_2x2_mesh.ranks[0]["trained"][style, m]["losses"][1] for m in (True, False)}
    assert losses[True] != losses[False]
    trained = on_a_2x2_mesh.runs[style, mask]
    step = Path(checkpoint_root(trained.checkpoint, trained.run)) / "step-00000002"
    dtype = "bfloat16" if tied else "float32"  # either export dtype
    export_checkpoint(str(step), "hf", tmp_path / "hf", max_shard_bytes=SHARD_BYTES, dtype=dtype)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"] == llama3_rope(factor) and config["tie_word_embeddings"] is tied
    exported, original = transformers_llama(tmp_path / "hf"), transformers_llama(llama3_dirs[style])
    assert exported.config.rope_parameters == original.config.rope_parameters
    tokens = long_tokens(exported.config.vocab_size, seed=1)
    with torch.no_grad():
        difference = (exported(tokens).logits - original(tokens).logits).abs()
    beyond = difference[:, ORIGINAL_CONTEXT:].max().item()
    print(
        f"\n[{style}, document mask {'on' if mask else 'off'}] 2x2 mesh, 2 steps, {dtype} export: "
        f"max |logit difference| to the original {difference.max():.2e}, past position {ORIGINAL_CONTEXT}: "
        f"{beyond:.2e}"
    )
    assert difference.max() <= LLAMA3_TOLERANCE


# --- one-line errors ----------------------------------------------------------------------------


def run_dry_run(
    overrides: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    monkeypatch.setattr(meshtrain.cluster.launcher, "launch", lambda cfg: pytest.fail("the CLI tried to launch"))
    code = main(["--dry-run", *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_shows_the_shape_of_config_json(
    trained: Trained, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = [f"model.init_from={trained.hf}", *DATA, "model.dim=64"]  # equal to config.json's: fine
    code, out, err = run_dry_run(overrides, capsys, monkeypatch)
    assert code == 0, err
    assert "model: dim=64 layers=2 heads=4 kv_heads=2 ffn=128 vocab=320 tied=False" in out


def _non_llama(trained: Trained, tmp_path: Path) -> list[str]:
    copy = tmp_path / "mistral"
    shutil.copytree(trained.hf, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (copy / "config.json").write_text(json.dumps(config))
    return [f"model.init_from={copy}"]


def _no_weights(trained: Trained, tmp_path: Path) -> list[str]:
    (tmp_path / "config-only").mkdir()
    shutil.copy(trained.hf / "config.json", tmp_path / "config-only")
    return [f"model.init_from={tmp_path / 'config-only'}"]


def _with_config(**entries: Any) -> Callable[[Trained, Path], list[str]]:
    """A copy of the export whose config.json has ``entries`` set."""

    def overrides(trained: Trained, tmp_path: Path) -> list[str]:
        copy = tmp_path / "edited"
        shutil.copytree(trained.hf, copy)
        config = json.loads((copy / "config.json").read_text())
        config.update(entries)
        (copy / "config.json").write_text(json.dumps(config))
        return [f"model.init_from={copy}"]

    return overrides


def _with_rope(key: str, rope: dict[str, Any]) -> Callable[[Trained, Path], list[str]]:
    """A copy of the export whose config.json has ``key`` (rope_parameters or rope_scaling) = ``rope``."""
    return _with_config(**{key: rope})


def _rope_override(trained: Trained, tmp_path: Path) -> list[str]:
    llama31 = _with_rope("rope_parameters", llama3_rope(8.0))
    return [*llama31(trained, tmp_path), "model.rope_scaling.factor=4"]


def _larger_tokenizer(trained: Trained, tmp_path: Path) -> list[str]:
    tokenizer = Tokenizer.from_str(trained.corpus.tokenizer_json)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(100)])
    tokenizer.save(str(tmp_path / "big.json"))
    return [f"model.init_from={trained.hf}", f"data.tokenizer={tmp_path / 'big.json'}"]


ERRORS = {
    "non-llama": (_non_llama, ["model.init_from:", "model_type='mistral'", "not LlamaForCausalLM"]),
    "missing": (
        lambda trained, tmp_path: [f"model.init_from={tmp_path / 'nowhere'}"],
        ["model.init_from:", "nowhere' is not a directory"],
    ),
    "conflicting-dim": (
        lambda trained, tmp_path: [f"model.init_from={trained.hf}", "model.dim=128"],
        ["model.dim: 128 conflicts with hidden_size=64", "drop model.dim"],
    ),
    "no-weights": (_no_weights, ["model.init_from:", "has no model.safetensors or model.safetensors.index"]),
    "larger-tokenizer": (_larger_tokenizer, ["data.tokenizer:", "tokens do not fit the 320 embedding rows"]),
    "no-tokenizer": (
        lambda trained, tmp_path: [f"model.init_from={trained.tied}"],
        ["data.tokenizer:", "has no tokenizer.json", "set data.tokenizer"],
    ),
    # What Llama-architecture configs may set that meshtrain's model does not implement.
    "head-dim": (
        _with_config(head_dim=32),
        ["model.init_from:", "config.json has head_dim=32", "hidden_size / num_attention_heads = 16"],
    ),
    "attention-bias": (
        _with_config(attention_bias=True),
        ["model.init_from:", "attention_bias=True", "implements only attention_bias=False"],
    ),
    "mlp-bias": (_with_config(mlp_bias=True), ["model.init_from:", "mlp_bias=True", "implements only mlp_bias=False"]),
    "activation": (
        _with_config(hidden_act="gelu"),
        ["model.init_from:", "hidden_act='gelu'", "implements only hidden_act='silu'"],
    ),
    "rope-yarn": (
        _with_rope("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0}),
        ["model.init_from:", "config.json rope_parameters.rope_type='yarn'", "does not implement"],
    ),
    "rope-dynamic": (  # transformers 4.x's spelling
        _with_rope("rope_scaling", {"type": "dynamic", "factor": 2.0}),
        ["model.init_from:", "config.json rope_scaling.type='dynamic'"],
    ),
    "rope-linear": (
        _with_rope("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ["model.init_from:", "config.json rope_scaling.rope_type='linear'"],
    ),
    "rope-factor": (
        _with_rope("rope_parameters", {**llama3_rope(8.0), "factor": 0}),
        ["model.init_from:", "config.json rope_parameters.factor=0.0 must be a positive finite number"],
    ),
    "rope-bands": (
        _with_rope("rope_scaling", {**llama3_rope(8.0), "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
        ["model.init_from:", "config.json rope_scaling.low_freq_factor=4.0 must be below"],
    ),
    "rope-incomplete": (
        _with_rope("rope_parameters", {"rope_type": "llama3", "factor": 8.0}),
        ["model.init_from:", "config.json rope_parameters.low_freq_factor is missing"],
    ),
    "rope-unmodelled": (
        _with_rope("rope_parameters", {**llama3_rope(8.0), "partial_rotary_factor": 0.5}),
        ["model.init_from:", "rope_parameters.partial_rotary_factor=0.5 is set"],
    ),
    "rope-override": (
        _rope_override, ["model.rope_scaling.factor: 4.0 conflicts with rope_scaling.factor=8.0",
                         "drop model.rope_scaling.factor"]
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_one_line_errors(
    trained: Trained, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_overrides, fragments = ERRORS[case]
    code, out, err = run_dry_run([*make_overrides(trained, tmp_path), *DATA], capsys, monkeypatch)
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"meshtrain: config error: {fragments[0]}"), lines[0]
    for fragment in fragments[1:]:
        assert fragment in lines[0], lines[0]


# --- the export job -----------------------------------------------------------------------------


def test_bf16_export_lists_every_tensor_in_its_index(trained: Trained, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    result = subprocess.run(
        [sys.executable, str(EXPORT_JOB), str(trained.step), "--format", "hf", str(out),
         "--max-shard-size", "50KB", "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored: dict[str, str] = {}
    nbytes = 0
    for file in sorted(out.glob("model-*.safetensors")):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16, name
                stored[name] = file.name
                nbytes += tensor.numel() * tensor.element_size()
    expected = {hf_name(name) for name in trained.state}
    assert index["weight_map"] == stored and stored.keys() == expected
    assert index["metadata"]["total_size"] == nbytes
    with safe_open(out / stored["model.embed_tokens.weight"], "pt") as handle:
        embedding = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(embedding, trained.state["tok_embeddings.weight"].to(torch.bfloat16))


def test_hf_export_reads_one_tensor_at_a_time(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[set[str]] = []
    read_data = dcp.FileSystemReader.read_data

    def spy(self: dcp.FileSystemReader, plan: Any, planner: Any) -> Any:
        reads.append({item.storage_index.fqn for item in plan.items})
        return read_data(self, plan, planner)

    metadata_reads = []
    read_metadata = dcp_files.load_metadata  # meshtrain's reader unpickles .metadata itself, safely

    def count(data: bytes, where: str) -> Any:
        metadata_reads.append(where)
        return read_metadata(data, where)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", spy)
    monkeypatch.setattr(dcp_files, "load_metadata", count)
    export_checkpoint(str(trained.step), "hf", tmp_path / "hf", max_shard_bytes=SHARD_BYTES)
    assert sorted(fqn for fqns in reads for fqn in fqns) == sorted(f"train.model.{n}" for n in trained.state)
    assert all(len(fqns) == 1 for fqns in reads)
    assert len(metadata_reads) == 1  # not once per tensor


def _export_job() -> ModuleType:
    """What jobs/export.py runs."""
    return importlib.import_module("meshtrain.cli.export")


def test_export_job_sizes_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    job = _export_job()
    assert job.parse_size("5GB") == 5 * 10**9 and job.parse_size("2MiB") == 2 * 2**20
    assert job.parse_size("1000") == 1000 and job.parse_size("0.5kb") == 500
    for argv in (
        ["ckpt", "--format", "hf", "out", "--max-shard-size", "5XB"],
        ["ckpt", "--format", "torch", "out.pt", "--dtype", "bfloat16"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            job.parse_args(argv)
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --- an untrusted init_from folder: every value read is checked before Ray starts ----------------


def _shard_names(directory: Path) -> list[str]:
    return sorted(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _edited_shard(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Trained, Path], list[str]]:
    """A copy of the export whose first weight file is written again with ``edit`` applied to its tensors."""

    def overrides(trained: Trained, tmp_path: Path) -> list[str]:
        from safetensors.torch import load_file

        copy = Path(shutil.copytree(trained.hf, tmp_path / "edited"))
        first = copy / _shard_names(copy)[0]
        tensors = load_file(first)
        edit(tensors)
        save_file(tensors, first)
        return [f"model.init_from={copy}"]

    return overrides


def _truncated_shard(trained: Trained, tmp_path: Path) -> list[str]:
    """An interrupted download: the last weight file stops half way."""
    copy = Path(shutil.copytree(trained.hf, tmp_path / "partial"))
    last = copy / _shard_names(copy)[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    return [f"model.init_from={copy}"]


def _missing_shard(trained: Trained, tmp_path: Path) -> list[str]:
    copy = Path(shutil.copytree(trained.hf, tmp_path / "partial"))
    (copy / _shard_names(copy)[-1]).unlink()
    return [f"model.init_from={copy}"]


def _index_edit(value: Any) -> Callable[[Trained, Path], list[str]]:
    """A copy of the export whose index maps its first tensor to ``value``."""

    def overrides(trained: Trained, tmp_path: Path) -> list[str]:
        copy = Path(shutil.copytree(trained.hf, tmp_path / "edited"))
        index = json.loads((copy / "model.safetensors.index.json").read_text())
        index["weight_map"][next(iter(index["weight_map"]))] = value
        (copy / "model.safetensors.index.json").write_text(json.dumps(index))
        return [f"model.init_from={copy}"]

    return overrides


def _duplicated_tensor(trained: Trained, tmp_path: Path) -> list[str]:
    """The second weight file also holds a tensor of the first."""
    from safetensors.torch import load_file

    copy = Path(shutil.copytree(trained.hf, tmp_path / "edited"))
    first, second = (copy / name for name in _shard_names(copy)[:2])
    name, tensor = next(iter(load_file(first).items()))
    save_file({**load_file(second), name: tensor}, second)
    return [f"model.init_from={copy}"]


def _first_tensor_as_int(tensors: dict[str, torch.Tensor]) -> None:
    name = next(iter(tensors))
    tensors[name] = tensors[name].to(torch.int32)


def _drop_norm(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[next(name for name in tensors if name.endswith("norm.weight"))]


WHERE = "model.init_from: "
FIX = "; fix config.json or give other weights"
UNSOUND = {
    "negative-hidden-size": (_with_config(hidden_size=-64), "config.json: hidden_size=-64 must be positive" + FIX),
    "zero-heads": (_with_config(num_attention_heads=0), "config.json: num_attention_heads=0 must be positive" + FIX),
    "huge-vocab": (
        _with_config(vocab_size=2**33),
        "config.json: vocab_size=8589934592 is above 16,777,216, more than any Llama-family model has" + FIX,
    ),
    "huge-embedding": (
        _with_config(vocab_size=2**24, hidden_size=2**15, num_attention_heads=2**8, num_key_value_heads=2**7),
        "config.json: vocab_size=16777216 x hidden_size=32768 is an embedding of 549,755,813,888 elements, above "
        "274,877,906,944: training it alone takes 8 TiB (16 bytes an element), more than any machine holds" + FIX,
    ),
    "too-many-layers": (_with_config(num_hidden_layers=10**6), "config.json: num_hidden_layers=1000000 is above 4,096"),
    "string-size": (_with_config(hidden_size="64"), "config.json: hidden_size='64' is not an integer" + FIX),
    "float-size": (
        _with_config(intermediate_size=128.5), "config.json: intermediate_size=128.5 is not an integer" + FIX
    ),
    "bool-layers": (_with_config(num_hidden_layers=True), "config.json: num_hidden_layers=True is not an integer"),
    "null-vocab": (_with_config(vocab_size=None), "config.json: vocab_size=None is not an integer" + FIX),
    "string-eps": (
        _with_config(rms_norm_eps="1e-5"), "config.json: rms_norm_eps='1e-5' must be a positive finite number"
    ),
    "large-eps": (_with_config(rms_norm_eps=2.0), "config.json: rms_norm_eps=2.0 must be below 1"),
    "nan-theta": (
        _with_config(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
        "config.json: rope_parameters.rope_theta=nan must be a positive finite number" + FIX,
    ),
    "string-tied": (
        _with_config(tie_word_embeddings="no"), "config.json: tie_word_embeddings='no' must be true or false"
    ),
    "kv-heads": (
        _with_config(num_key_value_heads=3), "config.json: num_key_value_heads=3 must divide num_attention_heads=4"
    ),
    "head-dim-type": (_with_config(head_dim="16"), "config.json has head_dim='16', not a positive integer"),
    # The weights themselves: headers read, nothing loaded.
    "truncated-weights": (
        _truncated_shard,
        "is not a readable safetensors file (SafetensorError: Error while deserializing header: incomplete "
        "metadata, file not fully covered); an interrupted download leaves such a file: download it again",
    ),
    "missing-shard": (_missing_shard, "named by model.safetensors.index.json; complete the download"),
    "index-not-a-file-name": (
        _index_edit("../elsewhere/model.safetensors"),
        "model.safetensors.index.json maps 'model.embed_tokens.weight' to '../elsewhere/model.safetensors', not a "
        ".safetensors file name in the folder; fix or replace it",
    ),
    "index-not-a-string": (
        _index_edit(["a"]), "model.safetensors.index.json maps 'model.embed_tokens.weight' to ['a']"
    ),
    "kv-heads-unlike-the-weights": (  # null means as many as the query heads (4): the files hold 2
        _with_config(num_key_value_heads=None),
        "model.layers.0.self_attn.k_proj.weight in model-00002-of-00005.safetensors has shape (32, 64), config.json "
        "gives (64, 64); give the config.json written with these weights",
    ),
    "missing-tensor": (
        _edited_shard(_drop_norm), "the weights lack model.layers.0.input_layernorm.weight; they do not match"
    ),
    "quantized-tensor": (
        _edited_shard(_first_tensor_as_int),
        "model.embed_tokens.weight in model-00001-of-00005.safetensors is I32; meshtrain loads F32, BF16, F16, "
        "F64 weights",
    ),
    "duplicated-tensor": (
        _duplicated_tensor,
        "model.embed_tokens.weight is stored in both model-00001-of-00005.safetensors and "
        "model-00002-of-00005.safetensors",
    ),
}


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", list(UNSOUND))
def test_an_unsound_init_from_is_one_line_before_ray_starts(
    trained: Trained, case: str, dry_run: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each config.json value, the index and the safetensors headers are checked by preflight: exit 2 with one
    line naming the key (or the file) and the fix, and nothing launched, in a run as in its dry run."""
    make_overrides, fragment = UNSOUND[case]
    # A run's launch runs preflight first; what follows it (the run lease, Ray) must not be reached.
    monkeypatch.setattr(meshtrain.cluster.launcher, "_launch", lambda *_: pytest.fail("the run went past preflight"))
    storage = f"run.storage_path={tmp_path / 'runs'}"
    code = main([*(["--dry-run"] if dry_run else []), *make_overrides(trained, tmp_path), *DATA, storage])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"meshtrain: config error: {WHERE}"), lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err


def test_the_weights_checks_need_no_tensor_read(trained: Trained, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight reads headers only: no tensor of the weights is loaded (they may be hundreds of GB)."""
    import safetensors

    def no_tensors(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a tensor was loaded")

    monkeypatch.setattr(safetensors.torch, "load_file", no_tensors)
    monkeypatch.setattr(torch, "load", no_tensors)
    opened = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, path: str, framework: str) -> None:
            opened.append(Path(path).name)
            self.handle = original(path, framework=framework)

        def __enter__(self) -> Any:
            handle = self.handle.__enter__()
            return type("HeaderOnly", (), {
                "metadata": handle.metadata, "keys": handle.keys, "get_slice": handle.get_slice,
                "get_tensor": no_tensors,
            })()

        def __exit__(self, *exc: Any) -> None:
            self.handle.__exit__(*exc)

    import meshtrain.checkpoint.hf_weights as hf_weights

    monkeypatch.setattr(hf_weights, "safe_open", Spy)
    init_from_config(trained.hf)
    assert opened == _shard_names(trained.hf)


def test_a_worker_loading_a_truncated_file_stops_in_one_line_naming_it(trained: Trained, tmp_path: Path) -> None:
    """Weights damaged after preflight (or on another node's copy): the worker's load names the file too."""
    from meshtrain.checkpoint.hf_weights import load_hf_weights
    from meshtrain.config import ConfigError

    cfg = init_from_config(trained.hf)
    model = build_model(model_args(cfg.model, None), "cpu")
    directory = Path(_truncated_shard(trained, tmp_path)[0].split("=", 1)[1])
    with pytest.raises(ConfigError) as caught:
        load_hf_weights(model, str(directory))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.init_from: {str(directory)!r}: model-0000")
    assert "is not a readable safetensors file" in message


def test_a_resolved_shape_error_names_its_field() -> None:
    """ModelConfig.resolved keeps the field of a shape error (pydantic's own message has none)."""
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.ffn_dim='wide' is not an integer$"):
        ModelConfig().resolved(300, {"ffn_dim": "wide"})
    with pytest.raises(ConfigError, match=r"^model\.bogus=1: Extra inputs are not permitted$"):
        ModelConfig().resolved(300, {"bogus": 1})
