"""Where checkpoints live and which are committed: DCP shards on shared storage, a marker written last.

Layout under the checkpoint root (``{run_dir}/checkpoints`` or ``{checkpoint.path}/{run.name}``)::

    step-00000050/            DCP files: one or more shard files per rank, and .metadata
    step-00000050/COMMITTED   JSON written by rank 0 after every rank's shards and the metadata are
                              durable: step, tokens, data position, world and mesh, vocabulary, file
                              sizes (checked before loading), and the config the run had

A directory without ``COMMITTED`` is an interrupted save: it is never loaded and is removed by the
next save. Every rank writes only its own shards (``dcp.save``/``dcp.async_save``); nothing is ever
gathered on one rank.

Why not Ray Train's ``report(checkpoint=...)``: DCP already writes each rank's shards straight to
shared storage, and Ray would copy them again; Ray registers a reported checkpoint without proof
that every worker finished writing (ray-project/ray#41700); and Ray's ``get_checkpoint`` only knows
checkpoints of the current Ray run, while a user re-running the same run name must resume too. So the
commit marker is the single source of truth, and every start (Ray's automatic restart or a re-run)
looks for the newest committed checkpoint in the same place.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch.distributed.checkpoint as dcp

from meshtrain.config import MeshtrainConfig

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    path: str
    step: int
    manifest: dict[str, Any]


class CheckpointStorage:
    """A checkpoint root on a local/NFS path or an fsspec URL (``s3://bucket/prefix``)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(root, **self.storage_options)
        self.is_local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.url = root

    def step_dir(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step:08d}"

    def display(self, path: str) -> str:
        """The path as the user would write it (with the URL scheme for remote storage)."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def _step_dirs(self) -> list[tuple[int, str]]:
        if not self.fs.exists(self.root):
            return []
        found = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found.append((int(match.group(1)), entry.rstrip("/")))
        return sorted(found, reverse=True)

    def read_marker(self, path: str) -> dict[str, Any] | None:
        """The manifest in ``path``'s commit marker, or None when the checkpoint is not committed."""
        marker = f"{path}/{COMMIT_MARKER}"
        if not self.fs.exists(marker):
            return None
        try:
            with self.fs.open(marker, "r") as handle:
                return json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"checkpoint {self.display(path)}: {COMMIT_MARKER} is not valid JSON ({exc})") from None

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints, newest first."""
        result = []
        for step, path in self._step_dirs():
            manifest = self.read_marker(path)
            if manifest is not None:
                result.append(CommittedCheckpoint(path, step, manifest))
        return result

    def uncommitted(self) -> list[tuple[int, str]]:
        return [(step, path) for step, path in self._step_dirs() if not self.fs.exists(f"{path}/{COMMIT_MARKER}")]

    def files(self, path: str) -> dict[str, int]:
        """Relative name → size of every file in a checkpoint directory (the marker excluded)."""
        sizes = {}
        for name, info in self.fs.find(path, detail=True).items():
            relative = name[len(path.rstrip("/")) + 1 :]
            if relative != COMMIT_MARKER:
                sizes[relative] = int(info["size"])
        return sizes

    def commit(self, path: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Write the marker last; locally via a temporary file and an atomic rename, fsynced."""
        manifest = {**manifest, "files": self.files(path)}
        manifest["bytes"] = sum(manifest["files"].values())
        payload = json.dumps(manifest, indent=1)
        marker = f"{path}/{COMMIT_MARKER}"
        if self.is_local:
            tmp = f"{marker}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, marker)
            directory = os.open(path, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        else:
            with self.fs.open(marker, "w") as handle:  # one PUT: the object appears whole or not at all
                handle.write(payload)
        return manifest

    def validate(self, checkpoint: CommittedCheckpoint) -> None:
        """Every file the marker lists is present with its recorded size (catches truncation)."""
        expected: dict[str, int] = checkpoint.manifest.get("files", {})
        if ".metadata" not in expected:
            raise CheckpointError(f"checkpoint {self.display(checkpoint.path)}: its marker lists no .metadata")
        actual = self.files(checkpoint.path)
        for name, size in sorted(expected.items()):
            if name not in actual:
                raise CheckpointError(f"checkpoint {self.display(checkpoint.path)}: {name} is missing")
            if actual[name] != size:
                raise CheckpointError(
                    f"checkpoint {self.display(checkpoint.path)}: {name} has {actual[name]} bytes, expected {size}"
                )

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def writer(self, path: str) -> dcp.StorageWriter:
        if self.is_local:
            return dcp.FileSystemWriter(path, sync_files=True, overwrite=True)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.display(path), sync_files=True, overwrite=True, **self.storage_options)

    def reader(self, path: str, metadata_once: bool = False) -> dcp.StorageReader:
        """A DCP reader of the checkpoint at ``path``. With ``metadata_once`` it reads ``.metadata``
        at its first load only, for callers that load one checkpoint piece by piece."""
        if self.is_local:
            reader_class: type[dcp.StorageReader] = dcp.FileSystemReader
            location = path
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader_class, location = FsspecReader, self.display(path)
        if metadata_once:
            reader_class = _reading_metadata_once(reader_class)
        options = {} if self.is_local else self.storage_options
        return reader_class(location, **options)


class _MetadataOnce:
    """Mixed into a DCP reader: ``dcp.load`` asks for the metadata at every call, and for an hf
    export that loads a 70B checkpoint tensor by tensor each ask would re-read and unpickle it."""

    _metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)  # type: ignore[misc]
        return self._metadata


@functools.cache
def _reading_metadata_once(reader_class: type[dcp.StorageReader]) -> type[dcp.StorageReader]:
    return type(f"MetadataOnce{reader_class.__name__}", (_MetadataOnce, reader_class), {})


def checkpoint_root(cfg: MeshtrainConfig) -> str:
    """Where this run's checkpoints live (``checkpoint.path/<run.name>`` or ``<run dir>/checkpoints``)."""
    if cfg.run.name is None:
        raise ValueError("run.name must be resolved before training (the launcher does this)")
    if cfg.checkpoint.path:
        return f"{cfg.checkpoint.path.rstrip('/')}/{cfg.run.name}"
    return str(Path(cfg.run.storage_path) / cfg.run.name / "checkpoints")


def run_checkpoints(cfg: MeshtrainConfig) -> CheckpointStorage:
    """This run's checkpoint storage."""
    return CheckpointStorage(checkpoint_root(cfg), cfg.checkpoint.storage_options)


def newest_committed(cfg: MeshtrainConfig) -> tuple[CheckpointStorage, CommittedCheckpoint | None]:
    """This run's checkpoint storage and its newest committed checkpoint (None: none, or disabled)."""
    storage = run_checkpoints(cfg)
    committed = storage.committed() if cfg.checkpoint.enabled else []
    return storage, committed[0] if committed else None
