"""Turn a committed DCP checkpoint into consolidated weights: one file, or a Hugging Face directory.

Only the model tensors are read (never the optimizer state), in this one process, into full fp32
tensors on CPU. Before that every file of the checkpoint is read once and checked against the
checksums its commit marker vouches for, and nothing read is unpickled beyond DCP's metadata
classes and plain data (see ``dcp_files``). The checkpoint may live on a local path or an fsspec
URL (``s3://bucket/prefix``). The torch and safetensors formats hold the whole model in memory; hf streams it tensor by tensor.

Formats:

* ``torch``: ``torch.save`` of the model state dict, meshtrain names (a tied output weight is the
  same tensor as the embedding, so ``Transformer.load_state_dict`` takes it as is).
* ``safetensors``: one file, meshtrain names; a tied ``output.weight`` is left out (safetensors
  refuses shared tensors) and ``safetensors.torch.load_model`` restores the tie.
* ``hf``: a ``LlamaForCausalLM`` directory: ``config.json``, the weights and, when the run has one,
  ``tokenizer.json``. The weights are ``model.safetensors``, or, beyond ``max_shard_bytes``,
  ``model-0000x-of-0000N.safetensors`` files with a ``model.safetensors.index.json`` (Hugging Face's
  layout). Each tensor is read from the checkpoint on its own and each file written once full, so
  memory peaks at about one file plus one tensor. The model's RoPE already uses Hugging Face's
  rotate-half pairing, so the weights map by name only, without permuting q/k.

Outputs are written next to their destination under a temporary name and moved into place at the
end, so a failed export leaves nothing half-written, and an existing non-empty output is refused.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
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
from torch.distributed.checkpoint.api import CheckpointException

from meshtrain.checkpoint.storage import (
    BAD_MARKER,
    COMMIT_MARKER,
    CheckpointError,
    CheckpointStorage,
    CommittedCheckpoint,
)
from meshtrain.config import ConfigError, ModelArgs
from meshtrain.model.hf_llama import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, hf_config, hf_name
from meshtrain.model.llama import build_model, count_parameters, materialize

FORMATS = ("torch", "safetensors", "hf")
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as transformers' save_pretrained
_STATE_PREFIX = "train.model."  # dcp.save({"train": TrainState}) → TrainState's "model" entry
_TIED_ALIAS, _TIED_SOURCE = "output.weight", "tok_embeddings.weight"


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
    committed = storage.all_committed()
    loadable = [checkpoint for checkpoint in committed if checkpoint.bad is None]
    if loadable:
        return storage.display(loadable[0].path)
    if committed:
        newest = committed[0]
        raise CheckpointError(
            f"no loadable checkpoint under {storage.display(storage.root)}: every committed one is bad (step "
            f"{newest.step}: {newest.bad}); give a step directory once it is repaired and its {BAD_MARKER} file removed"
        )
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
    bad = storage.bad_reason(path)
    if bad is not None:
        raise CheckpointError(
            f"checkpoint {shown} is marked bad ({bad}); repair it and remove its {BAD_MARKER} file, "
            "or give another step"
        )
    checkpoint = CommittedCheckpoint(path, int(manifest.get("step", -1)), manifest)
    storage.validate(checkpoint)
    if not storage.verify_files(checkpoint):  # every byte, whole files: an export reads the checkpoint once
        print(
            f"[meshtrain] checkpoint {shown} has no checksums (written before meshtrain recorded them): "
            "checked its file sizes only",
            file=sys.stderr,
        )
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


@dataclass(frozen=True)
class CommittedModel:
    """A committed checkpoint opened for reading its model tensors (into any tensors of their shapes)."""

    storage: CheckpointStorage
    committed: CommittedCheckpoint
    args: ModelArgs

    @classmethod
    def open(cls, checkpoint: str, storage_options: dict[str, Any] | None) -> "CommittedModel":
        storage = CheckpointStorage(checkpoint, storage_options)
        committed = _read_committed(storage)
        try:
            args = ModelArgs(**committed.manifest["model_args"])
        except ValidationError as exc:
            shown = storage.display(committed.path)
            raise CheckpointError(f"checkpoint {shown}: bad model_args ({exc.errors()[0]['msg']})") from None
        return cls(storage, committed, args)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.committed.manifest

    @functools.cached_property
    def reader(self) -> dcp.StorageReader:
        """Reads ``.metadata`` once, and checks each tensor it reads against the checkpoint's checksums."""
        return self.storage.reader(self.committed.path, self.storage.sidecars(self.committed))

    def to_load(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``model_state`` (a model's state dict) to read, checked against the metadata."""
        stored = self.reader.read_metadata().state_dict_metadata
        return _state_to_load(model_state, stored, self.args, self.storage.display(self.committed.path))

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Fill ``state``'s tensors (meshtrain names) from the checkpoint, reading nothing else."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load({"train": {"model": state}}, storage_reader=self.reader, no_dist=True)
        except CheckpointException as exc:  # DCP's wrapper (a BaseException) around this process's failure
            failure = next(iter(exc.failures.values()))[0]
            if isinstance(failure, CheckpointError):
                raise failure from None
            first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
            raise CheckpointError(f"checkpoint {self.storage.display(self.committed.path)}: {first}") from None

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model as fp32 CPU tensors (a tied embedding is one tensor under both names)."""
        model = materialize(build_model(self.args, "meta"), "cpu")
        self.load(self.to_load(model.state_dict()))
        return model.state_dict()


def load_model_state(
    checkpoint: str, storage_options: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], ModelArgs, dict[str, Any]]:
    """The model's full fp32 state dict (meshtrain names, CPU), its ModelArgs and the checkpoint's manifest.

    ``checkpoint`` is a committed ``step-XXXXXXXX`` directory (local path or fsspec URL). With tied
    embeddings, ``output.weight`` and ``tok_embeddings.weight`` are the same tensor.
    """
    source = CommittedModel.open(checkpoint, storage_options)
    return source.full_state(), source.args, source.manifest


# --- Hugging Face layout ------------------------------------------------------------------------


def run_tokenizer(
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


def tokenizer_files(tokenizer_json: str, max_length: int) -> tuple[dict[str, str], int | None]:
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
class _Export:
    """What the writers need: the checkpoint, the run's tokenizer and the hf options."""

    source: CommittedModel
    tokenizer_json: str | None
    max_shard_bytes: int
    dtype: str


def _save_torch(target: Path, export: _Export) -> None:
    torch.save(export.source.full_state(), target)


def _save_safetensors(target: Path, export: _Export) -> None:
    args = export.source.args
    metadata = {
        "format": "pt",
        "step": str(export.source.manifest.get("step")),
        "model_args": json.dumps(args.model_dump()),
    }
    # safetensors refuses two names for one tensor: the tied alias is left out.
    state = {
        name: tensor
        for name, tensor in export.source.full_state().items()
        if not (args.tie_embeddings and name == _TIED_ALIAS)
    }
    save_file(state, target, metadata=metadata)


def _save_hf(target: Path, export: _Export) -> None:
    args = export.source.args
    target.mkdir()
    eos_id = None
    if export.tokenizer_json is not None:
        files, eos_id = tokenizer_files(export.tokenizer_json, args.max_seq_len)
        for name, text in files.items():
            (target / name).write_text(text, encoding="utf-8")
    config = json.dumps(hf_config(args, eos_id, export.dtype), indent=2) + "\n"
    (target / CONFIG_FILE).write_text(config, encoding="utf-8")
    _write_hf_weights(target, export)


def _write_hf_weights(target: Path, export: _Export) -> None:
    """The weights in ``dtype``, one checkpoint tensor read at a time, each file written once full."""
    source, dtype = export.source, HF_DTYPES[export.dtype]
    wanted = source.to_load(build_model(source.args, "meta").state_dict())  # shapes only
    sizes = {name: meta.numel() * dtype.itemsize for name, meta in wanted.items()}
    shards = _plan_shards(sizes, export.max_shard_bytes)
    count = len(shards)
    files = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    if count == 1:
        files = [WEIGHTS_FILE]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards):
        tensors = {}
        for name in names:
            tensor = torch.empty(wanted[name].shape, dtype=wanted[name].dtype)
            source.load({name: tensor})
            # A tied embedding read under its alias is still the embedding (no lm_head.weight when tied).
            tied_alias = source.args.tie_embeddings and name == _TIED_ALIAS
            tensors[hf_name(_TIED_SOURCE if tied_alias else name)] = tensor.to(dtype)
        save_file(tensors, target / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if count > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most ``max_bytes`` in order (a larger tensor gets a file alone),
    the rule of transformers' save_pretrained."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


_WRITERS: dict[str, Callable[[Path, _Export], None]] = {
    "torch": _save_torch,
    "safetensors": _save_safetensors,
    "hf": _save_hf,
}


def export_checkpoint(
    checkpoint: str,
    fmt: str,
    out: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str = "float32",
) -> ExportResult:
    """Write the model of a committed checkpoint to ``out`` (a local path) in ``fmt`` (see FORMATS).

    ``max_shard_bytes`` and ``dtype`` (a key of HF_DTYPES) shape the hf format's weight files.
    """
    if fmt not in _WRITERS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in HF_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(HF_DTYPES)}")
    if max_shard_bytes <= 0:
        raise ExportError(f"max_shard_bytes={max_shard_bytes}: give a positive size, e.g. 5GB")
    out = Path(out).expanduser()
    _check_output_free(out, fmt)  # before the (possibly long) load
    source = CommittedModel.open(checkpoint, storage_options)
    tokenizer = run_tokenizer(checkpoint, source.manifest, storage_options) if fmt == "hf" else None
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        _WRITERS[fmt](staged, _Export(source, tokenizer, max_shard_bytes, dtype))
        _publish(staged, out, fmt)
    finally:
        if staged.is_dir():
            shutil.rmtree(staged)
        else:
            staged.unlink(missing_ok=True)
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
    parameters = count_parameters(build_model(source.args, "meta"))
    return ExportResult(out, fmt, int(source.manifest.get("step", -1)), parameters, files)


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMATS",
    "HF_DTYPES",
    "CommittedModel",
    "ExportError",
    "ExportResult",
    "export_checkpoint",
    "load_model_state",
    "resolve_checkpoint",
    "run_tokenizer",
    "tokenizer_files",
]
