"""Saving on a cadence (async by default, never two in flight), committing, pruning and restoring."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from meshtrain.checkpoint.state import TrainState
from meshtrain.checkpoint.write_progress import counting_writes
from meshtrain.checkpoint.storage import (
    CheckpointError,
    CheckpointStorage,
    CommittedCheckpoint,
)


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
        writer = counting_writes(self.storage.writer(path))  # the hang watchdog sees a long save progress
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
