"""Continued pretraining from Hugging Face weights: ``model.init_from`` and the sharded hf export.

A tiny run is trained here, exported to a sharded Hugging Face directory, and loaded back through
``model.init_from`` in one process and on a 2x2 gloo mesh. Logits are compared with the original
model's and with ``transformers.LlamaForCausalLM`` on the exported directory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
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
from meshtrain.checkpoint.export import export_checkpoint, load_model_state
from meshtrain.checkpoint.storage import checkpoint_root
from meshtrain.cli.pretrain import main
from meshtrain.cluster.preflight import preflight
from meshtrain.config import MeshtrainConfig, ModelArgs, load_config
from meshtrain.data import (
    DataParallelBatches,
    DataPlan,
    open_data,
    prepare_data,
    tokenizer_vocab_size,
)
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.hf_llama import hf_config, hf_name
from meshtrain.model.init import init_weights
from meshtrain.model.llama import Transformer, build_model
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.trainer import train
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    storage = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, [*SHAPE, *RUN, f"run.storage_path={storage}", "run.name=base"])
    corpus = prepare_data(
        cfg.data, str(tmp_path_factory.mktemp("stores")), cfg.data.seq_len, use_ray=False, log=lambda _: None
    )
    train(cfg, corpus, WorkerLayout(), torch.device("cpu"))
    root = Path(checkpoint_root(cfg))
    (root.parent / "tokenizer.json").write_text(corpus.tokenizer_json)  # as the launcher does
    step = root / "step-00000004"
    state, args, _ = load_model_state(str(step))
    hf = tmp_path_factory.mktemp("export") / "hf"
    export_checkpoint(str(step), "hf", hf, max_shard_bytes=SHARD_BYTES)
    tied = tmp_path_factory.mktemp("tied") / "hf"
    write_tied_dir(tied)
    return Trained(corpus, step, args, state, hf, tied)


def init_from_config(directory: Path, *overrides: str) -> MeshtrainConfig:
    """As a run sees it: loaded, then checked against (and completed from) the init_from directory."""
    return preflight(load_config(None, [f"model.init_from={directory}", *DATA, *overrides]))


def load_in_one_process(cfg: MeshtrainConfig, vocab: int) -> Transformer:
    model, layout = build_sharded_model(cfg, vocab, WorkerLayout(), torch.device("cpu"))
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
    assert model_args(cfg, vocab) == trained.args  # the shape came from config.json
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


def test_continued_training_starts_from_the_weights(trained: Trained, tmp_path: Path) -> None:
    """The first step's loss is the exported model's loss on that step's batch (same seed, same data)."""
    cfg = init_from_config(
        trained.hf, *RUN, "train.steps=1", "optim.warmup_steps=0", "checkpoint.enabled=false",
        "eval.interval=null",
        f"run.storage_path={tmp_path}", "run.name=continued",
    )
    result = train(cfg, trained.corpus, WorkerLayout(), torch.device("cpu"))
    data = open_data(trained.corpus, cfg.data.seq_len, cfg.train.seed)
    batches = DataParallelBatches(data.train, 4, 2, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    model = original_model(trained)
    with torch.no_grad():
        micro_batches = list(batches.next_step())
        loss_sum = sum(token_cross_entropy_sum(model(inputs), targets) for inputs, targets in micro_batches)
    expected = loss_sum.item() / sum(targets.numel() for _, targets in micro_batches)
    assert result.records[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_a_resumed_run_reads_its_checkpoint_not_the_hf_weights(trained: Trained, tmp_path: Path) -> None:
    """Once a checkpoint is committed the run resumes from it: the Hugging Face weights, which the
    checkpoint replaces anyway, are not read again (here they are no longer safetensors)."""
    hf = Path(shutil.copytree(trained.hf, tmp_path / "hf"))
    settings = [*RUN, "checkpoint.interval=2", "optim.schedule_steps=4", "eval.interval=null", f"run.storage_path={tmp_path}", "run.name=resumed"]
    first = train(init_from_config(hf, *settings, "train.steps=2"), trained.corpus, WorkerLayout(), torch.device("cpu"))
    for weights in hf.glob("*.safetensors"):
        weights.write_bytes(b"overwritten")
    resumed = train(init_from_config(hf, *settings), trained.corpus, WorkerLayout(), torch.device("cpu"))
    assert [r["step"] for r in first.records if r["event"] == "train"] == [1, 2]
    assert [r["step"] for r in resumed.records if r["event"] == "train"] == [3, 4]


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
        model, layout = build_sharded_model(cfg, vocab, layout, torch.device("cpu"))
        results.append({
            "mesh": layout.plan.shape,
            "read": elements_read[0],
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "full": {name: p.full_tensor() for name, p in model.named_parameters()},
        })
    return results


@pytest.mark.distributed
def test_a_2x2_mesh_loads_the_same_weights_each_rank_reading_its_shards(trained: Trained) -> None:
    mesh = [
        "scaling.num_workers=4", "parallel.shard=2", "train.global_batch_size=8", "train.micro_batch_size=2"
    ]
    tokenizer = f"data.tokenizer={trained.hf / 'tokenizer.json'}"
    configs = [
        (init_from_config(trained.hf, *mesh), trained.corpus.vocab_size),
        (init_from_config(trained.tied, tokenizer, *mesh), trained.corpus.vocab_size),
        # Replicated twice x tensor parallel 2: column and row shards of every block, the vocabulary split.
        (init_from_config(trained.hf, *mesh, "parallel.tensor=2", "parallel.shard=1"), trained.corpus.vocab_size),
    ]
    meshes = [(2, 2), (2, 2), (2, 1, 2)]  # two workers per node: one TP group each
    expected = [dict(load_in_one_process(cfg, vocab).named_parameters()) for cfg, vocab in configs]
    for rank_results in run_on_ranks(_load_on_rank, 4, configs):
        for result, reference, mesh_shape in zip(rank_results, expected, meshes):
            assert result["mesh"] == mesh_shape
            assert result["full"].keys() == reference.keys()
            for name, tensor in result["full"].items():
                assert torch.equal(tensor, reference[name]), name
            # Every element of this rank's shards was read once, and nothing else: about half the model.
            total = sum(t.numel() for t in reference.values())
            assert result["read"] == result["local"] < 0.6 * total


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


def _rope_scaling(trained: Trained, tmp_path: Path) -> list[str]:
    copy = tmp_path / "llama31"
    shutil.copytree(trained.hf, copy)
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (copy / "config.json").write_text(json.dumps(config))
    return [f"model.init_from={copy}"]


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
    "rope-scaling": (_rope_scaling, ["model.init_from:", "rope scaling 'llama3'"]),
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
