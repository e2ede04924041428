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

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from meshtrain.checkpoint.averaging import AveragedModel
from meshtrain.checkpoint.reading import TIED_ALIAS, TIED_SOURCE, CommittedModel, run_tokenizer, tokenizer_files
from meshtrain.model.hf_llama import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, hf_config, hf_name
from meshtrain.model.llama import build_model, count_parameters

FORMATS = ("torch", "safetensors", "hf")
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as transformers' save_pretrained


class ExportError(ValueError):
    """An output that cannot be written (e.g. it already exists); the message names it and the fix."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    step: int
    parameters: int
    files: list[str]
    averaged_steps: list[int] | None = None  # the steps whose mean was exported


# --- reading ------------------------------------------------------------------------------------


# --- Hugging Face layout ------------------------------------------------------------------------


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
    """What the writers need: the checkpoint (or the mean of several), the run's tokenizer and the hf options."""

    source: CommittedModel | AveragedModel
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
    for key in ("averaged_steps", "started_from"):
        if key in export.source.manifest:
            metadata[key] = json.dumps(export.source.manifest[key])
    # safetensors refuses two names for one tensor: the tied alias is left out.
    state = {
        name: tensor
        for name, tensor in export.source.full_state().items()
        if not (args.tie_embeddings and name == TIED_ALIAS)
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
    config = hf_config(args, eos_id, export.dtype)
    if "started_from" in export.source.manifest:  # the lineage: transformers keeps unknown keys as they are
        config["meshtrain_started_from"] = export.source.manifest["started_from"]
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
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
            tied_alias = source.args.tie_embeddings and name == TIED_ALIAS
            tensors[hf_name(TIED_SOURCE if tied_alias else name)] = tensor.to(dtype)
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
    average: int | None = None,
) -> ExportResult:
    """Write the model of a committed checkpoint to ``out`` (a local path) in ``fmt`` (see FORMATS);
    with ``average``, the mean of the newest ``average`` committed checkpoints under ``checkpoint``
    (a run's checkpoint root).

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
    source: CommittedModel | AveragedModel
    if average is not None:
        source = AveragedModel.open(checkpoint, average, storage_options)
        newest = source.newest
    else:
        source, newest = CommittedModel.open(checkpoint, storage_options), checkpoint
    tokenizer = run_tokenizer(newest, source.manifest, storage_options) if fmt == "hf" else None
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
    return ExportResult(out, fmt, int(source.manifest.get("step", -1)), parameters, files,
                        source.manifest.get("averaged_steps"))


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMATS",
    "HF_DTYPES",
    "ExportError",
    "ExportResult",
    "export_checkpoint",
]
