"""Export: DCP checkpoint → consolidated torch/safetensors files and a Hugging Face Llama directory.

Real checkpoints come from ``train()`` in this process (no process group, so DCP saves with
``no_dist``). The HF export is checked against ``transformers.LlamaForCausalLM`` logit by logit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshtrain.checkpoint.export import ExportError, export_checkpoint
from meshtrain.checkpoint.reading import load_model_state, resolve_checkpoint
from meshtrain.checkpoint.storage import COMMIT_MARKER, CheckpointError, checkpoint_root
from meshtrain.config import ModelArgs
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan, prepare_data
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.llama import Transformer, build_model
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from s3server import moto_s3

REPO = Path(__file__).resolve().parents[1]
EXPORT_JOB = REPO / "jobs" / "export.py"

BASE_OVERRIDES = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128",
    "data.max_documents=8", "data.vocab_size=300", "data.seq_len=32",
    "train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2", "optim.warmup_steps=2",
    "scaling.num_workers=1", "checkpoint.interval=2", "checkpoint.mode=sync",
]
# rope_theta differs from LlamaConfig's default in one variant, so a config.json that lost it fails.
VARIANTS = {
    "untied-gqa": ["model.n_kv_heads=2", "model.tie_embeddings=false", "model.rope_theta=500000"],
    "tied-gqa": ["model.n_kv_heads=2", "model.tie_embeddings=true"],
    "untied-mha": ["model.n_kv_heads=4", "model.tie_embeddings=false"],
}


@dataclass(frozen=True)
class Run:
    cfg: MeshtrainConfig
    corpus: DataPlan
    root: Path  # the checkpoint root

    @property
    def run_dir(self) -> Path:
        return self.root.parent

    def step(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"


def config(storage: Path, variant: str) -> MeshtrainConfig:
    overrides = [*BASE_OVERRIDES, *VARIANTS[variant], f"run.storage_path={storage}", f"run.name={variant}"]
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> DataPlan:
    data = config(tmp_path_factory.mktemp("corpus"), "untied-gqa").data
    return prepare_data(data, str(tmp_path_factory.mktemp("stores")), data.seq_len, use_ray=False, log=lambda _: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: DataPlan) -> dict[str, Run]:
    """One trained run per variant, each with committed checkpoints at steps 2 and 4."""
    storage = tmp_path_factory.mktemp("runs")
    result = {}
    for variant in VARIANTS:
        cfg = config(storage, variant)
        train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
        run = Run(cfg, corpus, Path(checkpoint_root(cfg.checkpoint, cfg.run)))
        (run.run_dir / "tokenizer.json").write_text(corpus.tokenizer_json)  # as the launcher does
        result[variant] = run
    return result


def consolidated_model(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint via DCP's own full consolidation (optimizer included)."""
    out = tmp_path / "dcp_to_torch_save.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)["train"]["model"]


def meshtrain_model(state: dict[str, torch.Tensor], args: ModelArgs) -> Transformer:
    model = build_model(args, "cpu")  # built on CPU, so the RoPE tables are computed
    model.load_state_dict(state)
    return model.eval()


def run_export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXPORT_JOB), *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["untied-gqa", "tied-gqa"])
def test_load_model_state_reads_only_model_tensors(
    runs: dict[str, Run], variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = runs[variant]
    requested: list[str] = []
    read_data = dcp.FileSystemReader.read_data

    def spy(self: dcp.FileSystemReader, plan, planner):  # noqa: ANN001 - DCP's own types
        requested.extend(item.storage_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", spy)
    state, args, manifest = load_model_state(str(run.step(4)))

    assert requested and all(fqn.startswith("train.model.") for fqn in requested)
    assert args == model_args(run.cfg.model, run.corpus.vocab_size)
    assert manifest["step"] == 4
    reference = consolidated_model(run.step(4), tmp_path)
    assert state.keys() == reference.keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert torch.equal(tensor, reference[name]), name
    if args.tie_embeddings:
        assert state["output.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()


@pytest.mark.parametrize("variant", ["untied-gqa", "tied-gqa"])
def test_torch_and_safetensors_exports_are_bitwise_equal(
    runs: dict[str, Run], variant: str, tmp_path: Path
) -> None:
    run = runs[variant]
    loaded, args, _ = load_model_state(str(run.step(4)))
    reference = consolidated_model(run.step(4), tmp_path)

    result = export_checkpoint(str(run.step(4)), "torch", tmp_path / "model.pt")
    assert (result.step, result.parameters) == (4, sum(p.numel() for p in build_model(args).parameters()))
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]) and torch.equal(tensor, loaded[name]), name
    meshtrain_model(exported, args)  # strict load into the model

    export_checkpoint(str(run.step(4)), "safetensors", tmp_path / "model.safetensors")
    flat = load_file(tmp_path / "model.safetensors")
    tied_alias = {"output.weight"} if args.tie_embeddings else set()
    assert flat.keys() == reference.keys() - tied_alias
    for name, tensor in flat.items():
        assert torch.equal(tensor, reference[name]) and torch.equal(tensor, loaded[name]), name
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        assert ModelArgs(**json.loads(handle.metadata()["model_args"])) == args
    model = build_model(args, "cpu")
    load_model(model, tmp_path / "model.safetensors")  # restores the tie that the file leaves out
    assert torch.equal(model.output.weight, reference["output.weight"])
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_embeddings


# --- Hugging Face -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_export_matches_meshtrain_logits(runs: dict[str, Run], variant: str, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    run = runs[variant]
    out = tmp_path / "hf"
    export_checkpoint(str(run.step(4)), "hf", out)
    state, args, _ = load_model_state(str(run.step(4)))

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == args.tie_embeddings
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (args.n_heads, args.n_kv_heads)
    hf, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.config.rope_parameters["rope_theta"] == args.rope_theta
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == args.tie_embeddings
    hf.eval()

    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = meshtrain_model(state, args)(tokens)
        actual = hf(tokens).logits
    assert actual.dtype == expected.dtype == torch.float32
    difference = (actual - expected).abs().max().item()
    print(f"\n[export] {variant}: max |logit difference| = {difference:.3e}")
    assert difference <= 1e-4


def test_hf_export_carries_the_run_tokenizer(runs: dict[str, Run], tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    run = runs["untied-gqa"]
    export_checkpoint(str(run.step(4)), "hf", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == run.corpus.tokenizer_json
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == run.corpus.eos_id
    text = "def export(path):\n    return path  # done\n"
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_str(run.corpus.tokenizer_json).encode(text).ids
    assert hf_tokenizer.eos_token_id == run.corpus.eos_id


def test_hf_config_needs_no_transformers(runs: dict[str, Run], tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from meshtrain.checkpoint.export import export_checkpoint\n"
        f"export_checkpoint({str(runs['tied-gqa'].step(4))!r}, 'hf', {str(tmp_path / 'hf')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"


# --- remote storage -----------------------------------------------------------------------------


def test_exports_from_s3(runs: dict[str, Run], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    with moto_s3(monkeypatch, "exports") as options:
        fs = s3fs.S3FileSystem(**options)
        fs.put(str(runs["tied-gqa"].root), "exports/tied", recursive=True)
        fs.invalidate_cache()

        newest = resolve_checkpoint("s3://exports/tied", options)
        assert newest == "s3://exports/tied/step-00000004"
        remote, args, manifest = load_model_state(newest, options)
        local, _, _ = load_model_state(str(runs["tied-gqa"].step(4)))
        assert manifest["step"] == 4 and args.tie_embeddings
        assert remote.keys() == local.keys()
        assert all(torch.equal(remote[name], local[name]) for name in local)

        endpoint = f"client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}"
        out = tmp_path / "model.safetensors"
        result = run_export("s3://exports/tied", "--format", "safetensors", str(out), f"--storage-option={endpoint}")
        assert result.returncode == 0, result.stderr
        assert "step 4" in result.stdout
        assert all(torch.equal(tensor, local[name]) for name, tensor in load_file(out).items())


# --- refusals -----------------------------------------------------------------------------------


def test_uncommitted_and_missing_checkpoints_are_refused(runs: dict[str, Run], tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints" / "step-00000004"
    shutil.copytree(runs["untied-gqa"].step(4), copy)
    (copy / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{copy} is not a committed checkpoint")):
        export_checkpoint(str(copy), "torch", tmp_path / "out.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"no committed checkpoint under {copy.parent}")):
        resolve_checkpoint(str(copy.parent))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_state(str(tmp_path / "nowhere"))
    assert not (tmp_path / "out.pt").exists()


def test_existing_outputs_are_never_overwritten(runs: dict[str, Run], tmp_path: Path) -> None:
    checkpoint = str(runs["untied-gqa"].step(4))
    kept = tmp_path / "kept.pt"
    kept.write_bytes(b"precious")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=re.escape(f"output {kept} already exists")):
        export_checkpoint(checkpoint, "torch", kept)
    with pytest.raises(ExportError, match=re.escape(f"output {hf_dir} already exists and is not empty")):
        export_checkpoint(checkpoint, "hf", hf_dir)
    with pytest.raises(ExportError, match="is a directory"):
        export_checkpoint(checkpoint, "safetensors", hf_dir)
    assert kept.read_bytes() == b"precious" and (hf_dir / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "kept.pt"]  # no staging leftovers

    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(checkpoint, "hf", empty)  # an empty directory is fine to fill
    assert {"config.json", "model.safetensors"} <= {p.name for p in empty.iterdir()}


# --- command line -------------------------------------------------------------------------------


def test_cli_rejects_bad_input_with_one_line(runs: dict[str, Run], tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = run_export(str(missing), "--format", "torch", str(tmp_path / "a.pt"))
    assert_one_line_error(result, str(missing), "does not exist")

    uncommitted = tmp_path / "step-00000004"
    shutil.copytree(runs["untied-gqa"].step(4), uncommitted)
    (uncommitted / COMMIT_MARKER).unlink()
    result = run_export(str(uncommitted), "--format", "hf", str(tmp_path / "hf"))
    assert_one_line_error(result, str(uncommitted), "not a committed checkpoint")

    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"x")
    result = run_export(str(runs["untied-gqa"].root), "--format", "safetensors", str(existing))
    assert_one_line_error(result, str(existing), "already exists", "choose another path")
    assert existing.read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.safetensors", "step-00000004"]


def test_cli_exports_newest_step_of_a_root(runs: dict[str, Run], tmp_path: Path) -> None:
    run = runs["untied-gqa"]
    assert sorted(p.name for p in run.root.iterdir()) == ["step-00000002", "step-00000004"]
    out = tmp_path / "hf"
    result = run_export(str(run.root), "--format", "hf", str(out))
    assert result.returncode == 0, result.stderr
    assert "step 4" in result.stdout and str(out) in result.stdout
    newest, args, _ = load_model_state(str(run.step(4)))
    assert f"{sum(p.numel() for p in build_model(args).parameters()):,} parameters" in result.stdout
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], newest["tok_embeddings.weight"])
    assert torch.equal(weights["lm_head.weight"], newest["output.weight"])
    assert os.path.isfile(out / "tokenizer.json")


@pytest.mark.parametrize("variant", ["untied-gqa", "tied-gqa"])
def test_the_mean_of_the_newest_checkpoints_exports_in_every_format(
    runs: dict[str, Run], variant: str, tmp_path: Path
) -> None:
    """The mean of steps 2 and 4: the torch file holds it exactly, the safetensors file and the hf directory
    (streamed one tensor at a time) hold the same tensors, and a tied embedding stays one tensor."""
    run = runs[variant]
    two, _, _ = load_model_state(str(run.step(2)))
    four, args, _ = load_model_state(str(run.step(4)))
    expected = {name: (four[name].float() + two[name].float()) / 2 for name in four}
    for fmt in ("torch", "safetensors", "hf"):
        result = export_checkpoint(str(run.root), fmt, tmp_path / fmt, average=2)
        assert (result.step, result.averaged_steps) == (4, [2, 4])
    averaged = torch.load(tmp_path / "torch", weights_only=True)
    assert averaged.keys() == expected.keys()
    assert all(torch.equal(averaged[name], expected[name]) for name in expected)
    assert not torch.equal(averaged["tok_embeddings.weight"], four["tok_embeddings.weight"])
    model = build_model(args, "cpu")
    load_model(model, str(tmp_path / "safetensors"))
    assert all(torch.equal(model.state_dict()[name], expected[name]) for name in expected)
    with safe_open(str(tmp_path / "safetensors"), "pt") as handle:
        assert json.loads(handle.metadata()["averaged_steps"]) == [2, 4]
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["model.embed_tokens.weight"], expected["tok_embeddings.weight"])
    assert ("lm_head.weight" in hf) is not args.tie_embeddings


def test_an_average_over_more_checkpoints_than_the_run_holds_is_one_line(runs: dict[str, Run], tmp_path: Path) -> None:
    run = runs["untied-gqa"]
    result = run_export(str(run.root), "--format", "torch", str(tmp_path / "avg.pt"), "--average", "3")
    assert_one_line_error(result, "--average 3:", "holds 2 loadable committed checkpoints (steps 4, 2)", "average fewer")
    result = run_export(str(run.root), "--format", "torch", str(tmp_path / "avg.pt"), "--average", "2")
    assert result.returncode == 0 and "exported the mean of steps 2, 4 of" in result.stdout, result.stderr


# --- untrusted storage ----------------------------------------------------------------------------


@pytest.mark.parametrize("reseal_it", [False, True], ids=["checksum stale", "checksum edited to match"])
def test_export_refuses_a_crafted_metadata_without_running_it(
    runs: dict[str, Run], tmp_path: Path, reseal_it: bool
) -> None:
    from test_checkpoint_trust import plant_metadata_payload

    copy = tmp_path / "checkpoints" / "step-00000004"
    shutil.copytree(runs["untied-gqa"].step(4), copy)
    proof = tmp_path / "payload-ran"
    plant_metadata_payload(copy, proof, reseal_it=reseal_it)
    detail = ".metadata refers to posix.system, which DCP metadata never holds" if reseal_it else ".metadata ends at byte"

    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {copy}: {detail}")):
        export_checkpoint(str(copy), "torch", tmp_path / "model.pt")
    result = run_export(str(copy), "--format", "hf", str(tmp_path / "hf"))
    assert_one_line_error(result, f"checkpoint {copy}: {detail}")
    assert not proof.exists()
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "hf").exists()


def test_export_verifies_every_byte_even_those_it_does_not_export(runs: dict[str, Run], tmp_path: Path) -> None:
    from test_checkpoint_trust import dcp_metadata

    copy = tmp_path / "step-00000004"
    shutil.copytree(runs["untied-gqa"].step(4), copy)
    info = next(i for index, i in dcp_metadata(copy).storage_data.items() if index.fqn.endswith(".exp_avg_sq"))
    shard = copy / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x04
    shard.write_bytes(bytes(data))

    result = run_export(str(copy), "--format", "safetensors", str(tmp_path / "model.safetensors"))
    assert_one_line_error(result, f"checkpoint {copy}: {info.relative_path} at offset {info.offset} ", "does not match its checksum")
    assert not (tmp_path / "model.safetensors").exists()


def test_a_checkpoint_from_before_checksums_exports_with_a_note_and_damage_is_one_line(
    runs: dict[str, Run], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from test_checkpoint_trust import dcp_metadata, strip_checksums

    copy = tmp_path / "step-00000004"
    shutil.copytree(runs["untied-gqa"].step(4), copy)
    strip_checksums(copy)
    export_checkpoint(str(copy), "torch", tmp_path / "model.pt")
    assert f"checkpoint {copy} has no checksums (written before meshtrain recorded them)" in capfd.readouterr().err

    info = next(i for index, i in dcp_metadata(copy).storage_data.items() if index.fqn == "train.model.norm.weight")
    shard = copy / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + 4] = b"\0\0\0\0"  # the item's zip header: torch.load fails on it
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"^checkpoint {re.escape(str(copy))}: [^\n]+$"):
        export_checkpoint(str(copy), "torch", tmp_path / "damaged.pt")


# --- every failure of the command line is one line -------------------------------------------------


def _export(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of export's main in this process; no traceback on stderr."""
    from meshtrain.cli.export import main as export_main

    try:
        code = export_main(arguments)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


def test_an_output_in_an_unwritable_place_is_refused_before_the_checkpoint_is_read(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import meshtrain.checkpoint.reading as reading

    monkeypatch.setattr(reading, "resolve_checkpoint", lambda *_: pytest.fail("the checkpoint was read"))
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "hf"
    code, lines = _export([str(runs["tied-gqa"].root), "--format", "hf", str(out)], capsys)
    assert code == 2 and lines == [
        f"export: error: output {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder; give an output "
        "path in a writable folder"
    ]


def test_a_run_folder_exports_its_newest_step_as_generate_and_evaluate_read_it(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshtrain.checkpoint.reading import checkpoint_in

    run = runs["untied-gqa"]
    assert checkpoint_in(str(run.run_dir)) == str(run.step(4))
    assert checkpoint_in(str(run.run_dir), average=2) == str(run.root)
    code, lines = _export([str(run.run_dir), "--format", "torch", str(tmp_path / "model.pt")], capsys)
    assert code == 0 and lines == []
    assert torch.load(tmp_path / "model.pt", weights_only=True).keys() == load_model_state(str(run.step(4)))[0].keys()


def test_a_run_folder_whose_newest_marker_was_edited_exports_the_previous_step_saying_so(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_checkpoint_trust import _edit_step

    copy = tmp_path / "run"
    shutil.copytree(runs["untied-gqa"].run_dir, copy)
    marker = copy / "checkpoints" / "step-00000004" / COMMIT_MARKER
    marker.write_text(_edit_step(json.loads(marker.read_text())))
    code, lines = _export([str(copy), "--format", "torch", str(tmp_path / "model.pt")], capsys)
    assert code == 0 and len(lines) == 1, lines
    assert lines[0].startswith(f"[meshtrain] checkpoint {marker.parent} skipped: it is bad (its {COMMIT_MARKER} does "
                               "not match its marker_sha256")
    exported, step_2 = torch.load(tmp_path / "model.pt", weights_only=True), load_model_state(str(copy / "checkpoints" / "step-00000002"))[0]
    assert all(torch.equal(exported[name], step_2[name]) for name in step_2)
    code, lines = _export([str(marker.parent), "--format", "torch", str(tmp_path / "named.pt")], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"export: error: checkpoint {marker.parent}: ")
    assert not (tmp_path / "named.pt").exists()


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (PermissionError("Forbidden"), 2, "export: error: PermissionError: Forbidden; check the path's permissions, "
                                          "or the storage credentials (environment, instance role or storage options)"),
        (MemoryError(), 1, "export: error: MemoryError"),
    ],
    ids=["forbidden", "out-of-memory"],
)
def test_any_other_export_failure_is_one_line(
    runs: dict[str, Run], tmp_path: Path, error: Exception, code: int, message: str,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import meshtrain.checkpoint.export as export

    def failing(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(export, "export_checkpoint", failing)
    arguments = [str(runs["tied-gqa"].root), "--format", "torch", str(tmp_path / "model.pt")]
    assert _export(arguments, capsys) == (code, [message])


def test_a_crafted_model_shape_in_committed_is_refused_in_one_line(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """model_args with no attention heads (once a ZeroDivisionError): bounded as model.init_from's config.json is."""
    from meshtrain.checkpoint.checksums import MARKER_CHECKSUM, seal_marker

    copy = Path(shutil.copytree(runs["tied-gqa"].step(4), tmp_path / "step-00000004"))
    manifest = json.loads((copy / COMMIT_MARKER).read_text())
    del manifest[MARKER_CHECKSUM]
    manifest["model_args"]["n_heads"] = 0
    (copy / COMMIT_MARKER).write_text(json.dumps(seal_marker(manifest)))
    code, lines = _export([str(copy), "--format", "torch", str(tmp_path / "model.pt")], capsys)
    assert code == 2
    assert lines == [f"export: error: checkpoint {copy}: bad model_args (model.n_heads=0 must be positive)"]
