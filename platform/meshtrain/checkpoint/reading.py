"""Reading a run's committed checkpoints outside training: which checkpoint a path names (a run folder,
its checkpoints folder or one step, local or remote), its model tensors in one process (never anything a
storage writer could have pickled), and the run's tokenizer. Export, evaluation and generation read
through it."""


from __future__ import annotations

import functools
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch.distributed.checkpoint.api import CheckpointException

from meshtrain.checkpoint.storage import (
    BAD_MARKER,
    COMMIT_MARKER,
    CheckpointError,
    CheckpointStorage,
    CommittedCheckpoint,
)
from meshtrain.config import ConfigError, ModelArgs
from meshtrain.model.llama import build_model, materialize


_STATE_PREFIX = "train.model."  # dcp.save({"train": TrainState}) → TrainState's "model" entry
TIED_ALIAS, TIED_SOURCE = "output.weight", "tok_embeddings.weight"


def resolve_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """``path`` itself if it is a committed checkpoint, else the newest committed step under it (a root)."""
    storage = CheckpointStorage(path, storage_options)
    if storage.fs.exists(f"{storage.root.rstrip('/')}/{COMMIT_MARKER}"):
        return path
    loadable = newest_loadable(storage)
    if loadable:
        return storage.display(loadable[0].path)
    committed = storage.all_committed()
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
    read_committed(storage)  # raises the error that says what is wrong with ``path``
    return path


def checkpoint_in(path: str, storage_options: dict[str, Any] | None = None, average: int | None = None) -> str:
    """What export, evaluate and generate read for the ``path`` given: a committed step directory as it is; a
    checkpoint root or a run folder, its newest committed step; with ``average``, the checkpoint root whose
    newest steps are averaged."""
    root = run_checkpoint_root(path, storage_options)
    return root if average is not None else resolve_checkpoint(root, storage_options)


def run_checkpoint_root(path: str, storage_options: dict[str, Any] | None) -> str:
    """A run folder's checkpoint root (``{run}/checkpoints``), local or remote; any other path as it is."""
    if "://" not in path:
        return str(Path(path) / "checkpoints") if (Path(path) / "checkpoints").is_dir() else path
    root = f"{path.rstrip('/')}/checkpoints"
    try:
        fs, fs_root = fsspec.core.url_to_fs(root, **(storage_options or {}))
        return root if fs.isdir(fs_root) else path
    except Exception:  # unreachable or refused: reading the checkpoint says why, in its own words
        return path


def newest_loadable(storage: CheckpointStorage, count: int = 1) -> list[CommittedCheckpoint]:
    """The newest ``count`` committed checkpoints not marked bad under ``storage``'s root, newest first (fewer
    when it holds fewer). Each bad one newer than those it passes over is named on stderr, as a restore does;
    when there are too few, nothing is: the caller's refusal is then the one line."""
    committed = storage.all_committed()
    chosen = [checkpoint for checkpoint in committed if checkpoint.bad is None][:count]
    if len(chosen) == count:
        for checkpoint in committed:
            if checkpoint.bad is not None and checkpoint.step > chosen[-1].step:
                print(storage.skipped_line(checkpoint), file=sys.stderr)
    return chosen


def read_committed(storage: CheckpointStorage, whole_files: bool = True) -> CommittedCheckpoint:
    """The committed meshtrain checkpoint at ``storage``'s root: its marker read and sealed, not marked bad, its
    files of the sizes the marker records and, with ``whole_files``, every byte checked against its checksums
    (a reader that checks each read as it goes passes False); CheckpointError naming what is wrong."""
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
    if whole_files and not storage.verify_files(checkpoint):  # every byte: an export reads the checkpoint once
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
        drop = TIED_ALIAS if _STATE_PREFIX + TIED_SOURCE in stored else TIED_SOURCE
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
        committed = read_committed(storage)
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
