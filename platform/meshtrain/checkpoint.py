"""Distributed checkpoints: DCP shards on shared storage, committed by a marker written last.

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
import math
import os
import random
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it."""


@dataclass
class Progress:
    """How far training got: restored with the weights so the run continues where it stopped."""

    step: int = 0
    tokens: int = 0
    data_position: int = 0
    skipped_steps: int = 0  # steps the guard skipped (non-finite or spiking loss)


class TrainState(Stateful):
    """Everything a checkpoint holds, handed to ``dcp.save``/``dcp.load`` as one object.

    Model and optimizer state stay sharded (DTensors), so each rank reads and writes only its own
    shards and DCP reshards them when the mesh changes. RNG state is kept per rank; it is restored
    only when the world size is unchanged (with another layout, ranks keep the seeded state).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        progress: Progress,
        rank: int,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.progress, self.rank = model, optimizer, scheduler, progress, rank
        self.include_rng = True

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "progress": {key: torch.tensor(value) for key, value in vars(self.progress).items()},
        }
        if self.include_rng:
            state[f"rng_rank{self.rank}"] = _rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        for key, value in state["progress"].items():
            setattr(self.progress, key, int(value))
        if self.include_rng:
            _set_rng_state(state[f"rng_rank{self.rank}"])


def _rng_state() -> dict[str, torch.Tensor]:
    """Every generator's state as tensors (DCP stores tensors as data; nothing is unpickled on load)."""
    python_version, python_mt, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python_version": torch.tensor(python_version),
        "python_mt": torch.tensor(python_mt, dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if python_gauss is None else python_gauss, dtype=torch.float64),
        "numpy_keys": torch.from_numpy(numpy_keys.astype(np.int64)),
        "numpy_pos": torch.tensor(numpy_pos),
        "numpy_has_gauss": torch.tensor(numpy_has_gauss),
        "numpy_gauss": torch.tensor(numpy_gauss, dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    gauss = float(state["python_gauss"])
    python_gauss = None if math.isnan(gauss) else gauss
    random.setstate((int(state["python_version"]), tuple(state["python_mt"].tolist()), python_gauss))
    np.random.set_state((
        "MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(state["numpy_pos"]),
        int(state["numpy_has_gauss"]), float(state["numpy_gauss"]),
    ))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


@dataclass
class _PendingSave:
    step: int
    path: str
    future: Future
    started: float
    blocking_s: float
    manifest: dict[str, Any]
    finished: list[float] = field(default_factory=list)


Event = Callable[[dict[str, Any]], None]


class CheckpointManager:
    """Saves on a cadence (async by default, never two in flight), commits, prunes and restores."""

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        rank: int,
        world_size: int,
        interval: int,
        keep: int,
        asynchronous: bool,
        on_event: Event | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.storage, self.rank, self.world_size = storage, rank, world_size
        self.interval, self.keep, self.asynchronous = interval, keep, asynchronous
        self.on_event, self.log = on_event, log
        self._pending: _PendingSave | None = None
        self._stager: DefaultStager | None = None  # made at the first async save, kept for the next ones
        self.distributed = dist.is_initialized()
        # Background saves run their own collectives; a separate gloo group keeps them from
        # interleaving with the training step's collectives (and works for NCCL jobs too).
        self.group = dist.new_group(backend="gloo") if self.distributed else None

    # --- saving -------------------------------------------------------------------------------

    def due(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, state: TrainState, manifest: dict[str, Any], *, wait: bool = False) -> None:
        """Start saving ``state`` at ``state.progress.step``; returns once it is staged (async)."""
        self.finish_pending()
        step = state.progress.step
        path = self.storage.step_dir(step)
        if self.rank == 0:
            self.storage.remove(path)  # leftovers of a save that was interrupted before its commit
        self._barrier()
        state.include_rng = True
        started = time.perf_counter()
        writer = self.storage.writer(path)
        kwargs = {"storage_writer": writer, "process_group": self.group, "no_dist": not self.distributed}
        if self.asynchronous and not wait:
            future = dcp.async_save({"train": state}, async_stager=self._staging(state, writer), **kwargs)
        else:
            dcp.save({"train": state}, **kwargs)
            future = Future()
            future.set_result(None)
        pending = _PendingSave(step, path, future, started, time.perf_counter() - started, manifest)
        future.add_done_callback(lambda _: pending.finished.append(time.perf_counter()))
        self._pending = pending
        if wait or not self.asynchronous:
            self.finish_pending()

    def _staging(self, state: TrainState, writer: dcp.StorageWriter) -> DefaultStager:
        """The stager that copies the state to host memory, kept so every save refills the same host
        buffers (pinned when training on CUDA) instead of allocating a new copy of the whole state.

        DefaultStager keeps one host buffer per source storage, weakly keyed by that storage. The
        sharded parameters and the optimizer's moments are updated in place, so every save finds its
        buffers again; tensors built per save (progress, RNG state) get small fresh ones, released with
        their source. A storage whose size changed would fail loudly, never be copied short. Refilling
        is safe because ``save`` first waits for the previous save's writes (``finish_pending``).
        """
        if self._stager is None:
            on_cuda = any(param.device.type == "cuda" for param in state.model.parameters())
            options = StagingOptions(
                use_pinned_memory=on_cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=on_cuda
            )
            self._stager = DefaultStager(options)
        # With tensors already in host memory the writer's GPU copy-ahead only adds stream syncs
        # (DCP's own staging writer turns it off the same way).
        if hasattr(writer, "per_thread_copy_ahead"):
            writer.per_thread_copy_ahead = 0
        return self._stager

    def poll(self) -> None:
        """Commit the save in flight if it has finished (cheap; call every step)."""
        if self._pending is not None and self._pending.future.done():
            self.finish_pending()

    def finish_pending(self) -> None:
        """Wait for the save in flight, then commit it on rank 0 and prune old checkpoints."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.future.result()  # raises if any rank failed to write: then nothing is committed
        if self.rank != 0:
            return
        # Rank 0's save returns only after DCP gathered every rank's write results and wrote the
        # metadata, so all shards are on storage (fsynced) when the marker goes down.
        manifest = self.storage.commit(pending.path, {"step": pending.step, **pending.manifest})
        total = (pending.finished[0] if pending.finished else time.perf_counter()) - pending.started
        self._emit(
            {
                "event": "checkpoint_save",
                "step": pending.step,
                "path": self.storage.display(pending.path),
                "blocking_s": pending.blocking_s,
                "total_s": total,
                "bytes": manifest["bytes"],
                "mode": "async" if self.asynchronous else "sync",
            }
        )
        self._prune(pending.step)

    def _prune(self, newest: int) -> None:
        for checkpoint in self.storage.committed()[self.keep :]:
            self.storage.remove(checkpoint.path)
        for step, path in self.storage.uncommitted():
            if step < newest:
                self.storage.remove(path)

    # --- restoring ----------------------------------------------------------------------------

    def any_committed(self) -> bool:
        """Whether there is a committed checkpoint to resume from (rank 0 lists, every rank agrees)."""
        return bool(self._broadcast(bool(self.storage.committed()) if self.rank == 0 else None))

    def restore(self, state: TrainState) -> CommittedCheckpoint | None:
        """Load the newest usable committed checkpoint into ``state``; fall back past broken ones.

        Returns None when there is no committed checkpoint. Raises CheckpointError when there are
        some but none can be loaded (starting over would later overwrite them).
        """
        candidates = self._broadcast(self.storage.committed() if self.rank == 0 else None)
        failures = []
        for checkpoint in candidates:
            problem = None
            if self.rank == 0:
                try:
                    self.storage.validate(checkpoint)
                except CheckpointError as exc:
                    problem = str(exc)
            problem = self._broadcast(problem)
            if problem is None:
                try:
                    started = time.perf_counter()
                    state.include_rng = checkpoint.manifest.get("world_size") == self.world_size
                    dcp.load(
                        {"train": state},
                        storage_reader=self.storage.reader(checkpoint.path),
                        process_group=self.group,
                        no_dist=not self.distributed,
                    )
                    self._emit(
                        {
                            "event": "checkpoint_load",
                            "step": checkpoint.step,
                            "path": self.storage.display(checkpoint.path),
                            "load_s": time.perf_counter() - started,
                            "rng_restored": state.include_rng,
                        }
                    )
                    return checkpoint
                except Exception as exc:  # DCP wraps every rank's failure in CheckpointException
                    problem = f"checkpoint {self.storage.display(checkpoint.path)}: {_first_line(exc)}"
            failures.append(problem)
            if self.rank == 0:
                self.log(f"[meshtrain] {problem}; falling back to the previous committed checkpoint")
        if failures:
            raise CheckpointError(
                f"no usable checkpoint in {self.storage.url} ({'; '.join(failures)}); "
                "repair or remove them, or start a new run.name"
            )
        return None

    # --- plumbing -----------------------------------------------------------------------------

    def _emit(self, event: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        self.finish_pending()
        if self._stager is not None:  # DCP leaves closing a stager it was given to its owner
            self._stager.close()
            self._stager = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]
