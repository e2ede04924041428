"""Where checkpoints live and which are committed: DCP shards on shared storage, a marker written last.

Layout under the checkpoint root (``{run_dir}/checkpoints`` or ``{checkpoint.path}/{run.name}``)::

    step-00000050/            DCP files: one or more shard files per rank, and .metadata
    step-00000050/*.xxh3      per DCP file, the checksum of every item in it (see ``checksums``)
    step-00000050/COMMITTED   JSON written by rank 0 after every rank's shards and the metadata are
                              durable: step, tokens, data position, world and mesh, vocabulary, file
                              sizes (checked before loading), the checksums of the .xxh3 files, the
                              config the run had, and the sha256 of all that (``marker_sha256``; a
                              marker that does not match it is treated as damaged, one written before
                              it has none and still loads)
    step-00000050/BAD         JSON written when a committed checkpoint failed to load: the reason
                              and the time; such a checkpoint is skipped from then on and kept
                              for inspection (never pruned)

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

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch.distributed.checkpoint as dcp

from meshtrain.checkpoint.checksums import (
    ALGORITHM,
    SIDECAR_SUFFIX,
    read_sidecar,
    seal_marker,
    unseal_marker,
    verify_whole,
)
from meshtrain.checkpoint.dcp_files import (
    ChecksummedFileSystemWriter,
    ChecksummedFsspecWriter,
    ChecksummedWriting,
    VerifiedFileSystemReader,
    VerifiedFsspecReader,
)
from meshtrain.checkpoint.errors import CheckpointError
from meshtrain.config import CheckpointConfig, RunConfig
from meshtrain.data.local_files import write_atomically

COMMIT_MARKER = "COMMITTED"
BAD_MARKER = "BAD"
# A reader that will take a while to get to a checkpoint (a queued downstream evaluation) leases it:
# pruning keeps it until the lease is released, or expires (a reader that died releases nothing).
LEASE_MARKER = "LEASED"
LEASE_TTL_S = 24 * 3600.0
_MARKERS = (COMMIT_MARKER, BAD_MARKER, LEASE_MARKER)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class DamagedMarker(CheckpointError):
    """A commit marker that cannot be trusted (not JSON, or not matching its own checksum); ``reason`` is why,
    as a listing shows it."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CommittedCheckpoint:
    path: str
    step: int
    manifest: dict[str, Any]
    bad: str | None = None  # why it was marked bad (its BAD marker); None: not known to be broken


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
        """The manifest in ``path``'s commit marker, or None when the checkpoint is not committed;
        DamagedMarker when the marker is not JSON or does not match its own checksum."""
        marker = f"{path}/{COMMIT_MARKER}"
        if not self.fs.exists(marker):
            return None
        shown = self.display(path)
        try:
            with self.fs.open(marker, "r") as handle:
                document = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DamagedMarker(f"checkpoint {shown}: {COMMIT_MARKER} is not valid JSON ({exc})",
                                f"its {COMMIT_MARKER} is not valid JSON") from None
        if not isinstance(document, dict):
            raise DamagedMarker(f"checkpoint {shown}: {COMMIT_MARKER} is not a JSON object",
                                f"its {COMMIT_MARKER} is not a JSON object")
        manifest, problem = unseal_marker(document)  # a marker from before the checksum has none: taken as is
        if problem is not None:
            raise DamagedMarker(f"checkpoint {shown}: {COMMIT_MARKER} {problem}; it changed after the commit",
                                f"its {COMMIT_MARKER} {problem}")
        return manifest

    def bad_reason(self, path: str) -> str | None:
        """Why the checkpoint at ``path`` was marked bad; None when it was not."""
        marker = f"{path}/{BAD_MARKER}"
        if not self.fs.exists(marker):
            return None
        try:
            with self.fs.open(marker, "r") as handle:
                return str(json.load(handle)["reason"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"its {BAD_MARKER} marker is unreadable"

    def committed_at(self, step: int) -> CommittedCheckpoint | None:
        """The committed checkpoint of ``step`` (None: there is none); one whose marker is unreadable
        is listed as bad, never loaded and never deleted."""
        path = self.step_dir(step)
        try:
            manifest = self.read_marker(path)
        except DamagedMarker as exc:
            return CommittedCheckpoint(path, step, {}, exc.reason)
        return None if manifest is None else CommittedCheckpoint(path, step, manifest, self.bad_reason(path))

    def all_committed(self) -> list[CommittedCheckpoint]:
        """Every committed checkpoint, newest first, the bad ones included (with the reason)."""
        listed = [self.committed_at(step) for step, _ in self._step_dirs()]
        return [checkpoint for checkpoint in listed if checkpoint is not None]

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints not marked bad (the ones to resume from), newest first."""
        return [checkpoint for checkpoint in self.all_committed() if checkpoint.bad is None]

    def skipped_line(self, checkpoint: CommittedCheckpoint) -> str:
        """The line naming a checkpoint marked bad that a restore or a reader passes over, and why."""
        return f"[meshtrain] checkpoint {self.display(checkpoint.path)} skipped: it is bad ({checkpoint.bad})"

    def uncommitted(self) -> list[tuple[int, str]]:
        return [(step, path) for step, path in self._step_dirs() if not self.fs.exists(f"{path}/{COMMIT_MARKER}")]

    def files(self, path: str) -> dict[str, int]:
        """Relative name → size of every file in a checkpoint directory (the markers excluded)."""
        sizes = {}
        for name, info in self.fs.find(path, detail=True).items():
            relative = name[len(path.rstrip("/")) + 1 :]
            if relative not in _MARKERS:
                sizes[relative] = int(info["size"])
        return sizes

    def commit(self, path: str, manifest: dict[str, Any], written: dict[str, tuple[int, str]]) -> dict[str, Any]:
        """Write the marker last, with every file's size and the checksums of the files' sidecars.

        ``written`` is the writer's file → (bytes written, sidecar checksum); a file on storage that
        the save did not write whole is refused, so a marker never vouches for bytes nobody hashed.
        """
        files = self.files(path)
        lost = sorted(set(written) - set(files))
        if lost:
            raise CheckpointError(f"checkpoint {self.display(path)}: {lost[0]} was written but is not on storage")
        for name, size in sorted(files.items()):
            recorded = written.get(name)
            is_sidecar = name.endswith(SIDECAR_SUFFIX) and name[: -len(SIDECAR_SUFFIX)] in written
            if recorded is None and not is_sidecar and size:
                raise CheckpointError(f"checkpoint {self.display(path)}: {name} was not written by this save")
            if recorded is not None and recorded[0] != size:
                raise CheckpointError(
                    f"checkpoint {self.display(path)}: {name} has {size} bytes on storage, {recorded[0]} were written"
                )
        manifest = {
            **manifest,
            "files": files,
            "bytes": sum(files.values()),
            "checksums": {
                "algorithm": ALGORITHM,
                "sidecars": {name: sidecar for name, (_, sidecar) in sorted(written.items())},
            },
        }
        self._write_json(path, COMMIT_MARKER, seal_marker(manifest))  # the marker checks itself, too
        return manifest

    def mark_bad(self, checkpoint: CommittedCheckpoint, reason: str) -> str:
        """Mark ``checkpoint`` as not loadable (kept for inspection, skipped from now on); the marker's path."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._write_json(checkpoint.path, BAD_MARKER, {"step": checkpoint.step, "reason": reason, "marked_at": stamp})
        return self.display(f"{checkpoint.path}/{BAD_MARKER}")

    def lease(self, path: str, holder: str) -> None:
        """Keep the checkpoint at ``path`` from being pruned until :meth:`release` (or LEASE_TTL_S)."""
        self._write_json(path, LEASE_MARKER, {"holder": holder, "since": time.time()})

    def release(self, path: str) -> None:
        marker = f"{path}/{LEASE_MARKER}"
        if self.fs.exists(marker):
            self.fs.rm(marker)

    def leased(self, path: str) -> bool:
        """Whether a live lease keeps the checkpoint at ``path`` (an unreadable one counts as live)."""
        marker = f"{path}/{LEASE_MARKER}"
        if not self.fs.exists(marker):
            return False
        try:
            with self.fs.open(marker, "r", encoding="utf-8") as handle:
                since = float(json.load(handle)["since"])
        except (OSError, ValueError, KeyError, TypeError):
            return True
        return time.time() - since < LEASE_TTL_S

    def set_aside(self, path: str) -> str:
        """Move a checkpoint directory out of the step sequence (kept under a new name); the new path."""
        target = f"{path}.bad-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        self.fs.mv(path, target, recursive=True)
        return self.display(target)

    def _write_json(self, path: str, name: str, document: dict[str, Any]) -> None:
        """``path/name`` appears whole or not at all (locally ``write_atomically``)."""
        payload = json.dumps(document, indent=1)
        marker = f"{path}/{name}"
        if not self.is_local:
            with self.fs.open(marker, "w") as handle:  # one PUT: the object appears whole or not at all
                handle.write(payload)
            return
        write_atomically(marker, payload)

    def sidecars(self, checkpoint: CommittedCheckpoint) -> dict[str, str] | None:
        """The marker's file → sidecar checksum map; None for a checkpoint written before checksums."""
        checksums = checkpoint.manifest.get("checksums")
        if checksums is None:
            return None
        shown = self.display(checkpoint.path)
        if not isinstance(checksums, dict) or checksums.get("algorithm") != ALGORITHM:
            raise CheckpointError(
                f"checkpoint {shown}: {COMMIT_MARKER} records checksums this meshtrain cannot check"
            )
        sidecars = checksums.get("sidecars")
        if not isinstance(sidecars, dict) or not all(isinstance(v, str) for v in sidecars.values()):
            raise CheckpointError(f"checkpoint {shown}: the checksums in its {COMMIT_MARKER} are malformed")
        return sidecars

    def validate(self, checkpoint: CommittedCheckpoint) -> None:
        """Every file the marker lists is present with its recorded size (catches truncation), and
        every data file has a checksum when the marker records them."""
        shown = self.display(checkpoint.path)
        expected: dict[str, int] = checkpoint.manifest.get("files", {})
        if ".metadata" not in expected:
            raise CheckpointError(f"checkpoint {shown}: its marker lists no .metadata")
        actual = self.files(checkpoint.path)
        for name, size in sorted(expected.items()):
            if name not in actual:
                raise CheckpointError(f"checkpoint {shown}: {name} is missing")
            if actual[name] != size:
                raise CheckpointError(f"checkpoint {shown}: {name} has {actual[name]} bytes, expected {size}")
        sidecars = self.sidecars(checkpoint)
        if sidecars is not None and ".metadata" not in sidecars:
            raise CheckpointError(f"checkpoint {shown}: its marker has no checksum for .metadata")

    def verify_files(self, checkpoint: CommittedCheckpoint) -> bool:
        """Read every file whole and check it against its checksums; False (nothing checked) for a
        checkpoint written before checksums. Call ``validate`` first."""
        sidecars = self.sidecars(checkpoint)
        if sidecars is None:
            return False
        where = f"checkpoint {self.display(checkpoint.path)}"
        for name in sorted(checkpoint.manifest.get("files", {})):
            if name.endswith(SIDECAR_SUFFIX) and name[: -len(SIDECAR_SUFFIX)] in sidecars:
                continue  # checked with its file
            if name not in sidecars:
                raise CheckpointError(f"{where}: {name} has no checksum in its {COMMIT_MARKER}")
            try:
                with self.fs.open(f"{checkpoint.path}/{name}{SIDECAR_SUFFIX}", "rb") as handle:
                    index = read_sidecar(handle.read(), name, sidecars[name], where)
                with self.fs.open(f"{checkpoint.path}/{name}", "rb") as handle:
                    verify_whole(handle, name, index, where)
            except FileNotFoundError as exc:
                raise CheckpointError(f"{where}: {Path(str(exc.filename)).name} is missing") from None
        return True

    def free_bytes(self, path: str) -> int | None:
        """Free bytes on the local filesystem holding ``path``; None for object storage."""
        if not self.is_local:
            return None
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        return shutil.disk_usage(existing).free

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def writer(self, path: str) -> ChecksummedWriting:
        """A DCP writer of the checkpoint at ``path`` that records a checksum of every item it writes."""
        if self.is_local:
            return ChecksummedFileSystemWriter(path, sync_files=True, overwrite=True)
        return ChecksummedFsspecWriter(self.display(path), sync_files=True, overwrite=True, **self.storage_options)

    def reader(self, path: str, sidecars: dict[str, str] | None = None) -> dcp.StorageReader:
        """A DCP reader of the checkpoint at ``path`` that checks what it reads against ``sidecars``
        (see ``sidecars``; None checks nothing) and unpickles only DCP metadata and plain data.
        It reads ``.metadata`` once, however many loads it serves."""
        where = f"checkpoint {self.display(path)}"
        if self.is_local:
            return VerifiedFileSystemReader(path, where=where, sidecars=sidecars)
        return VerifiedFsspecReader(self.display(path), where=where, sidecars=sidecars, **self.storage_options)


def checkpoint_root(checkpoint: CheckpointConfig, run: RunConfig) -> str:
    """Where this run's checkpoints live (``checkpoint.path/<run.name>`` or ``<run dir>/checkpoints``)."""
    if run.name is None:
        raise ValueError("run.name must be resolved before training (the launcher does this)")
    if checkpoint.path:
        return f"{checkpoint.path.rstrip('/')}/{run.name}"
    return str(run.run_dir / "checkpoints")


def run_checkpoints(checkpoint: CheckpointConfig, run: RunConfig) -> CheckpointStorage:
    """This run's checkpoint storage."""
    return CheckpointStorage(checkpoint_root(checkpoint, run), checkpoint.storage_options)


def newest_committed(checkpoint: CheckpointConfig, run: RunConfig) -> tuple[CheckpointStorage, CommittedCheckpoint | None]:
    """This run's checkpoint storage and its newest committed checkpoint not marked bad (None: none, or
    checkpoints disabled): the one a restart would resume from."""
    storage = run_checkpoints(checkpoint, run)
    committed = storage.committed() if checkpoint.enabled else []
    return storage, committed[0] if committed else None
