"""Turn a committed DCP checkpoint into consolidated weights: one file, or a Hugging Face directory.

Only the model tensors are read (never the optimizer state), in this one process, into full fp32
tensors on CPU. The checkpoint may live on a local path or an fsspec URL (``s3://bucket/prefix``).

Formats:

* ``torch``: ``torch.save`` of the model state dict, meshtrain names (a tied output weight is the
  same tensor as the embedding, so ``Transformer.load_state_dict`` takes it as is).
* ``safetensors``: one file, meshtrain names; a tied ``output.weight`` is left out (safetensors
  refuses shared tensors) and ``safetensors.torch.load_model`` restores the tie.
* ``hf``: a ``LlamaForCausalLM`` directory: ``config.json``, ``model.safetensors`` and, when the run
  has one, ``tokenizer.json``. The model's RoPE already uses Hugging Face's rotate-half pairing, so
  the weights map by name only, without permuting q/k.

Outputs are written next to their destination under a temporary name and moved into place at the
end, so a failed export leaves nothing half-written, and an existing non-empty output is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from safetensors.torch import save_file

from meshtrain.checkpoint import COMMIT_MARKER, CheckpointError, CheckpointStorage, CommittedCheckpoint
from meshtrain.config import ConfigError, ModelArgs
from meshtrain.model import build_model, materialize

FORMATS = ("torch", "safetensors", "hf")
_STATE_PREFIX = "train.model."  # dcp.save({"train": TrainState}) → TrainState's "model" entry
_TIED_ALIAS, _TIED_SOURCE = "output.weight", "tok_embeddings.weight"

# meshtrain name inside a block → Hugging Face name inside ``model.layers.N``.
_HF_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ExportError(ValueError):
    """An output that cannot be written (e.g. it already exists); the message names it and the fix."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    step: int
    parameters: int
    files: list[str]


# --- reading ------------------------------------------------------------------------------------


def resolve_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """``path`` itself if it is a committed checkpoint, else the newest committed step under it (a root)."""
    storage = CheckpointStorage(path, storage_options)
    if storage.fs.exists(f"{storage.root.rstrip('/')}/{COMMIT_MARKER}"):
        return path
    committed = storage.committed()
    if committed:
        return storage.display(committed[0].path)
    interrupted = storage.uncommitted()
    if interrupted:
        raise CheckpointError(
            f"no committed checkpoint under {storage.display(storage.root)} (step {interrupted[0][0]} has no "
            f"{COMMIT_MARKER} marker: an interrupted save); wait for a save to commit or give another run"
        )
    _read_committed(storage)  # raises the error that says what is wrong with ``path``
    return path


def _read_committed(storage: CheckpointStorage) -> CommittedCheckpoint:
    path = storage.root.rstrip("/")
    shown = storage.display(path)
    if not storage.fs.exists(path):
        raise CheckpointError(
            f"checkpoint {shown} does not exist; give a step-XXXXXXXX directory or a checkpoint root"
        )
    manifest = storage.read_marker(path)
    if manifest is None:
        raise CheckpointError(
            f"{shown} is not a committed checkpoint (no {COMMIT_MARKER} marker: an interrupted save or "
            "another directory); give a committed step-XXXXXXXX directory or the run's checkpoint root"
        )
    if "model_args" not in manifest:
        raise CheckpointError(
            f"checkpoint {shown}: {COMMIT_MARKER} has no model_args; it was not written by meshtrain"
        )
    checkpoint = CommittedCheckpoint(path, int(manifest.get("step", -1)), manifest)
    storage.validate(checkpoint)
    return checkpoint


def _state_to_load(
    model_state: dict[str, torch.Tensor], stored: dict[str, Any], args: ModelArgs, shown: str
) -> dict[str, torch.Tensor]:
    """The model tensors to request from DCP, checked against the checkpoint's metadata.

    A tied embedding is one tensor under two names; meshtrain checkpoints store both, and one is
    enough (loading it fills the other). Either name is accepted in case only one was stored.
    """
    wanted = dict(model_state)
    if args.tie_embeddings:
        drop = _TIED_ALIAS if _STATE_PREFIX + _TIED_SOURCE in stored else _TIED_SOURCE
        del wanted[drop]
    missing = [name for name in wanted if _STATE_PREFIX + name not in stored]
    if missing:
        raise CheckpointError(
            f"checkpoint {shown} lacks model tensors {', '.join(missing[:5])}; "
            "it does not match its model_args"
        )
    for name, tensor in wanted.items():
        size = tuple(stored[_STATE_PREFIX + name].size)
        if size != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {shown}: {name} has shape {size}, model_args give {tuple(tensor.shape)}"
            )
    return wanted


def load_model_state(
    checkpoint: str, storage_options: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
    """The model's full fp32 state dict (meshtrain names, CPU), its ModelArgs and the checkpoint's manifest.

    ``checkpoint`` is a committed ``step-XXXXXXXX`` directory (local path or fsspec URL). With tied
    embeddings, ``output.weight`` and ``tok_embeddings.weight`` are the same tensor.
    """
    storage = CheckpointStorage(checkpoint, storage_options)
    committed = _read_committed(storage)
    try:
        args = ModelArgs(**committed.manifest["model_args"])
    except ValidationError as exc:
        shown = storage.display(committed.path)
        raise CheckpointError(f"checkpoint {shown}: bad model_args ({exc.errors()[0]['msg']})") from None
    model = materialize(build_model(args, "meta"), "cpu")
    reader = storage.reader(committed.path)
    stored = reader.read_metadata().state_dict_metadata
    wanted = _state_to_load(model.state_dict(), stored, args, storage.display(committed.path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"train": {"model": wanted}}, storage_reader=reader, no_dist=True)
    return model.state_dict(), args, committed.manifest


# --- Hugging Face layout ------------------------------------------------------------------------


def hf_state_dict(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Meshtrain names → ``LlamaForCausalLM`` names (``lm_head.weight`` left out when tied)."""
    converted = {}
    for name, tensor in state.items():
        if args.tie_embeddings and name == _TIED_ALIAS:
            continue
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            converted[f"model.layers.{index}.{_HF_LAYER_NAMES[rest]}"] = tensor
        else:
            converted[_HF_TOP_NAMES[name]] = tensor
    return converted


def hf_config(args: ModelArgs, eos_token_id: int | None = None) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with this shape (plain JSON, no transformers needed)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers < 5 reads rope_theta; 5.x reads rope_parameters (and would fold rope_theta in).
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        # LlamaConfig's defaults (bos 1, eos 2) belong to Meta's tokenizer, not to this run's.
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def _run_tokenizer(
    checkpoint: str, manifest: dict[str, Any], storage_options: dict[str, Any] | None
) -> str | None:
    """The run's ``tokenizer.json`` text, if the run directory has one."""
    config = manifest.get("config", {})
    run = config.get("run", {})
    candidates = []
    storage = CheckpointStorage(checkpoint, storage_options)
    parts = storage.root.rstrip("/").rsplit("/", 2)
    if not config.get("checkpoint", {}).get("path") and len(parts) == 3 and parts[1] == "checkpoints":
        # Default layout {run dir}/checkpoints/step-N: found even when run.storage_path was relative.
        candidates.append((storage.fs, f"{parts[0]}/tokenizer.json"))
    if run.get("storage_path") and run.get("name"):
        fs, path = fsspec.core.url_to_fs(f"{run['storage_path'].rstrip('/')}/{run['name']}/tokenizer.json")
        candidates.append((fs, path))
    for fs, path in candidates:
        if fs.exists(path):
            with fs.open(path, "r", encoding="utf-8") as handle:
                return handle.read()
    return None


def _tokenizer_files(tokenizer_json: str, max_length: int) -> tuple[dict[str, str], int | None]:
    """Files for the HF directory and the end-of-document token id (None if it has none)."""
    from tokenizers import Tokenizer

    from meshtrain.data import eos_token_id

    tokenizer = Tokenizer.from_str(tokenizer_json)
    try:
        eos_id: int | None = eos_token_id(tokenizer)
    except ConfigError:
        eos_id = None
    # Names the generic class, so AutoTokenizer loads tokenizer.json as it is rather than a
    # Llama-specific class picked by model_type, and tells it which token ends a document.
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
    }
    if eos_id is not None:
        tokenizer_config["eos_token"] = tokenizer.id_to_token(eos_id)
    config_text = json.dumps(tokenizer_config, indent=2) + "\n"
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config_text}, eos_id


# --- writing ------------------------------------------------------------------------------------


def _check_output_free(out: Path, fmt: str) -> None:
    fix = "choose another path or remove it first"
    if out.is_dir():
        if fmt != "hf":
            raise ExportError(
                f"output {out} is a directory; --format {fmt} writes one file, give a file path"
            )
        if any(out.iterdir()):
            raise ExportError(f"output {out} already exists and is not empty; {fix}")
    elif out.exists():
        if fmt == "hf":
            raise ExportError(f"output {out} is an existing file; --format hf writes a directory, {fix}")
        if out.stat().st_size > 0:
            raise ExportError(f"output {out} already exists; {fix}")


def _publish(staged: Path, out: Path, fmt: str) -> None:
    """Move the finished output into place, never replacing something that appeared meanwhile."""
    _check_output_free(out, fmt)
    if staged.is_dir():
        try:
            os.rename(staged, out)  # replaces at most an empty directory
        except OSError as exc:
            raise ExportError(
                f"output {out} appeared during the export ({exc.strerror}); choose another path"
            ) from None
        return
    if out.exists():
        out.unlink()  # an empty file (just checked)
    try:
        os.link(staged, out)  # unlike rename, fails if a file appeared at ``out`` meanwhile
    except FileExistsError:
        raise ExportError(f"output {out} appeared during the export; choose another path") from None
    except OSError:
        os.replace(staged, out)  # a filesystem without hard links
    staged.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Model:
    """What the writers need: the loaded weights and where they came from."""

    state: dict[str, torch.Tensor]
    args: ModelArgs
    manifest: dict[str, Any]
    tokenizer_json: str | None

    def unique_state(self) -> dict[str, torch.Tensor]:
        """The state without the tied alias (safetensors refuses two names for one tensor)."""
        tied = self.args.tie_embeddings
        return {name: t for name, t in self.state.items() if not (tied and name == _TIED_ALIAS)}


def _save_torch(target: Path, model: _Model) -> None:
    torch.save(model.state, target)


def _save_safetensors(target: Path, model: _Model) -> None:
    metadata = {
        "format": "pt",
        "step": str(model.manifest.get("step")),
        "model_args": json.dumps(model.args.model_dump()),
    }
    save_file(model.unique_state(), target, metadata=metadata)


def _save_hf(target: Path, model: _Model) -> None:
    target.mkdir()
    eos_id = None
    if model.tokenizer_json is not None:
        files, eos_id = _tokenizer_files(model.tokenizer_json, model.args.max_seq_len)
        for name, text in files.items():
            (target / name).write_text(text, encoding="utf-8")
    config = json.dumps(hf_config(model.args, eos_id), indent=2) + "\n"
    (target / "config.json").write_text(config, encoding="utf-8")
    save_file(hf_state_dict(model.state, model.args), target / "model.safetensors", metadata={"format": "pt"})


_WRITERS: dict[str, Callable[[Path, _Model], None]] = {
    "torch": _save_torch,
    "safetensors": _save_safetensors,
    "hf": _save_hf,
}


def export_checkpoint(
    checkpoint: str, fmt: str, out: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> ExportResult:
    """Write the model of a committed checkpoint to ``out`` (a local path) in ``fmt`` (see FORMATS)."""
    if fmt not in _WRITERS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    _check_output_free(out, fmt)  # before the (possibly long) load
    state, args, manifest = load_model_state(checkpoint, storage_options)
    tokenizer = _run_tokenizer(checkpoint, manifest, storage_options) if fmt == "hf" else None
    model = _Model(state, args, manifest, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        _WRITERS[fmt](staged, model)
        _publish(staged, out, fmt)
    finally:
        if staged.is_dir():
            shutil.rmtree(staged)
        else:
            staged.unlink(missing_ok=True)
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
    parameters = sum(t.numel() for t in model.unique_state().values())
    return ExportResult(out, fmt, int(manifest.get("step", -1)), parameters, files)


__all__ = [
    "FORMATS",
    "ExportError",
    "ExportResult",
    "export_checkpoint",
    "hf_config",
    "hf_state_dict",
    "load_model_state",
    "resolve_checkpoint",
]
