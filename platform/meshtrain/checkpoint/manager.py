"""Saving on a cadence (async by default, never two in flight), committing, pruning and restoring."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from meshtrain.checkpoint.dcp_files import ChecksummedWriting
from meshtrain.checkpoint.errors import CheckpointError, CheckpointUnreachable, NoLoadableCheckpoint
from meshtrain.checkpoint.save_failures import is_full, not_writable, storage_full, storage_os_error, wrapped_errors
from meshtrain.checkpoint.state import TrainState, keeps_optimizer_by_name
from meshtrain.checkpoint.storage import BAD_MARKER, CheckpointStorage, CommittedCheckpoint
from meshtrain.checkpoint.write_progress import counting_writes


@dataclass
class _PendingSave:
    step: int
    path: str
    state: TrainState
    writer: ChecksummedWriting
    future: Future
    started: float
    blocking_s: float
    manifest: dict[str, Any]
    finished: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SaveCommitted:
    """A save committed (rank 0): what the run's ``checkpoint_save`` record says (the record classes are
    observe's, a sibling layer: ``train.checkpointing`` makes the record)."""

    step: int
    path: str
    blocking_s: float
    total_s: float
    bytes: int
    mode: Literal["async", "sync"]


@dataclass(frozen=True)
class CheckpointLoaded:
    """A checkpoint restored: what the run's ``checkpoint_load`` record says."""

    step: int
    path: str
    load_s: float
    rng_restored: bool


Event = Callable[[SaveCommitted | CheckpointLoaded], None]


# torch 2.11 and 2.12 empty a DefaultStager's copier at the end of every stage, so there one stager
# serves one save (and its host buffers are not reused); 2.13 keeps them until close().
_STAGER_KEEPS_BUFFERS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


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
        try:
            if self.rank == 0:
                self._clear_step_dir(path, step)
            self._barrier()
            state.include_rng = True
            started = time.perf_counter()
            writer = self.storage.writer(path)
            counting_writes(writer)  # the hang watchdog sees a long save progress
            kwargs = {"storage_writer": writer, "process_group": self.group, "no_dist": not self.distributed}
            if self.asynchronous and not wait:
                future = dcp.async_save({"train": state}, async_stager=self._staging(state, writer), **kwargs)
            else:
                dcp.save({"train": state}, **kwargs)
                future = Future()
                future.set_result(None)
        except (Exception, CheckpointException) as exc:
            self._stop_if_storage_failed(exc, path, state)
            raise
        pending = _PendingSave(step, path, state, writer, future, started, time.perf_counter() - started, manifest)
        future.add_done_callback(lambda _: pending.finished.append(time.perf_counter()))
        self._pending = pending
        if wait or not self.asynchronous:
            self.finish_pending()

    def _clear_step_dir(self, path: str, step: int) -> None:
        """Make room for the save of ``step``: leftovers of a save interrupted before its commit are
        removed; a committed checkpoint that is bad is moved aside, never deleted."""
        existing = self.storage.committed_at(step)
        if existing is None or existing.bad is None:
            self.storage.remove(path)
            return
        moved = self.storage.set_aside(path)
        self.log(
            f"[meshtrain] checkpoint {self.storage.display(path)} is bad ({existing.bad}); "
            f"moved it to {moved} to save step {step} again"
        )

    def _stop_if_storage_failed(self, exc: BaseException, path: str, state: TrainState) -> None:
        """Raise a one-line PermanentError if ``exc`` says the storage is full (after removing the
        partial save) or refuses writes; return otherwise (the caller re-raises ``exc``)."""
        error = storage_os_error(exc)
        if error is None:
            return
        shown = self.storage.display(path)
        if not is_full(error):
            raise not_writable(error, shown) from exc
        if self.rank == 0:
            self.storage.remove(path)  # every rank's writes ended: DCP gathered their results first
        previous = self.storage.committed()
        if previous and previous[0].manifest.get("bytes"):
            needed, basis = int(previous[0].manifest["bytes"]), "the size of the previous checkpoint"
        else:
            needed, basis = state.nbytes(), "the size of the training state"
        raise storage_full(error, shown, needed, basis, self.storage.free_bytes(path)) from exc

    def _staging(self, state: TrainState, writer: dcp.StorageWriter) -> DefaultStager:
        """The stager that copies the state to host memory, kept so every save refills the same host
        buffers (pinned when training on CUDA) instead of allocating a new copy of the whole state.

        DefaultStager keeps one host buffer per source storage, weakly keyed by that storage. The
        sharded parameters and the optimizer's moments are updated in place, so every save finds its
        buffers again; tensors built per save (progress, RNG state) get small fresh ones, released with
        their source. A storage whose size changed would fail loudly, never be copied short. Refilling
        is safe because ``save`` first waits for the previous save's writes (``finish_pending``).
        """
        if self._stager is not None and not _STAGER_KEEPS_BUFFERS:
            self._stager.close()
            self._stager = None
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
        manifest: dict[str, Any] = {}
        try:
            pending.future.result()  # raises if any rank failed to write: then nothing is committed
            if self.rank == 0:
                # Rank 0's save returns only after DCP gathered every rank's write results (and their
                # checksums) and wrote the metadata, so all shards are durable when the marker goes down.
                manifest = {"step": pending.step, **pending.manifest}
                manifest = self.storage.commit(pending.path, manifest, pending.writer.written)
        except (Exception, CheckpointException) as exc:
            self._stop_if_storage_failed(exc, pending.path, pending.state)
            raise
        if self.rank != 0:
            return
        total = (pending.finished[0] if pending.finished else time.perf_counter()) - pending.started
        self._emit(SaveCommitted(
            step=pending.step,
            path=self.storage.display(pending.path),
            blocking_s=pending.blocking_s,
            total_s=total,
            bytes=manifest["bytes"],
            mode="async" if self.asynchronous else "sync",
        ))
        self._prune(pending.step)

    def _prune(self, newest: int) -> None:
        """Keep the ``keep`` newest checkpoints not marked bad (the newest loadable one always among
        them); checkpoints marked bad stay for inspection and do not count, and older ones under a
        lease (a downstream evaluation that has yet to read them) stay until it is released."""
        for checkpoint in self.storage.committed()[self.keep :]:
            if not self.storage.leased(checkpoint.path):
                self.storage.remove(checkpoint.path)
        for step, path in self.storage.uncommitted():
            if step < newest:
                self.storage.remove(path)

    # --- restoring ----------------------------------------------------------------------------

    def any_committed(self) -> bool:
        """Whether there is a committed checkpoint, marked bad or not (rank 0 lists, every rank agrees):
        with only bad ones the run must stop in ``restore``, not start over and overwrite them."""
        return bool(self._broadcast(bool(self.storage.all_committed()) if self.rank == 0 else None))

    def restore(self, state: TrainState, at_most: int | None = None) -> CommittedCheckpoint | None:
        """Load the newest loadable committed checkpoint into ``state`` (of step ``at_most`` or older,
        when given), falling back past broken ones.

        A checkpoint that fails to load on any rank (missing or damaged files, a checksum mismatch,
        other shapes or keys, metadata that is unreadable or refused) is marked bad, with one line,
        and the next older one is tried; every rank takes the same decision. Returns None when there
        is no committed checkpoint; raises NoLoadableCheckpoint when none loads.
        """
        listing: list[CommittedCheckpoint] = self._broadcast(
            self.storage.all_committed() if self.rank == 0 else None
        )
        listing = [checkpoint for checkpoint in listing if at_most is None or checkpoint.step <= at_most]
        if not listing:
            return None
        tried = []
        for index, checkpoint in enumerate(listing):
            shown = self.storage.display(checkpoint.path)
            if checkpoint.bad is not None:
                tried.append(f"checkpoint {shown}: skipped ({checkpoint.bad})")
                if self.rank == 0:
                    self.log(self.storage.skipped_line(checkpoint))
                continue
            problem = self._load(state, checkpoint)
            if problem is None:
                return checkpoint
            tried.append(problem)
            if self.rank == 0:
                self._mark_bad(checkpoint, problem, any(c.bad is None for c in listing[index + 1 :]))
        raise NoLoadableCheckpoint(
            f"no loadable checkpoint in {self.storage.url}: {'; '.join(tried)}; repair them (and remove their "
            f"{BAD_MARKER} files) or start a new run.name"
        )

    def roll_back(self, state: TrainState, before_step: int, reason: str) -> CommittedCheckpoint | None:
        """Load the newest loadable committed checkpoint older than ``before_step`` into ``state``, having
        marked every newer one bad with ``reason`` (kept for inspection, never resumed); None, and nothing
        marked, when no committed checkpoint is older."""
        self.finish_pending()
        listing: list[CommittedCheckpoint] = self._broadcast(self.storage.committed() if self.rank == 0 else None)
        if not any(checkpoint.step < before_step for checkpoint in listing):
            return None
        if self.rank == 0:
            for checkpoint in listing:
                if checkpoint.step >= before_step:
                    self.log(f"[meshtrain] checkpoint {self.storage.display(checkpoint.path)} set aside: {reason}")
                    self.storage.mark_bad(checkpoint, reason)
        self._barrier()
        return self.restore(state, at_most=before_step - 1)

    def _load(self, state: TrainState, checkpoint: CommittedCheckpoint) -> str | None:
        """Load ``checkpoint`` into ``state``; None, or the one-line reason it failed (the same on every
        rank). Raises CheckpointUnreachable, marking nothing, when the storage did not answer."""
        shown = self.storage.display(checkpoint.path)
        problem = None
        if self.rank == 0:
            try:
                self.storage.validate(checkpoint)
                if self.storage.sidecars(checkpoint) is None:
                    self.log(
                        f"[meshtrain] checkpoint {shown} has no checksums (written before meshtrain recorded "
                        "them): checked its file sizes only"
                    )
            except Exception as exc:  # a CheckpointError, or storage that cannot be listed
                problem = _problem(exc, shown)
        problem = _settled(self._broadcast(problem))
        if problem is not None:
            return problem
        started = time.perf_counter()
        try:  # read, verify and unpickle the metadata on every rank, before DCP's collectives
            reader = self.storage.reader(checkpoint.path, self.storage.sidecars(checkpoint))
            by_name = keeps_optimizer_by_name(reader.read_metadata())
        except Exception as exc:
            problem = _problem(exc, shown)
        problem = _settled(self._agree(problem))
        if problem is not None:
            return problem
        try:
            state.include_rng = checkpoint.manifest.get("world_size") == self.world_size
            state.optimizer_by_name = by_name
            try:
                dcp.load({"train": state}, storage_reader=reader, process_group=self.group, no_dist=not self.distributed)
            finally:
                state.optimizer_by_name = True  # the next save writes the current layout
        except (Exception, CheckpointException) as exc:  # DCP gathers every rank's failure into one
            problem = _problem(exc, shown)
        problem = _settled(self._agree(problem))
        if problem is None:
            self._emit(CheckpointLoaded(
                step=checkpoint.step, path=shown, load_s=time.perf_counter() - started, rng_restored=state.include_rng,
            ))
        return problem

    def _mark_bad(self, checkpoint: CommittedCheckpoint, problem: str, older: bool) -> None:
        next_step = "falling back to the previous committed checkpoint"
        if not older:
            next_step = "no older checkpoint to fall back to"
        reason = problem.removeprefix(f"checkpoint {self.storage.display(checkpoint.path)}: ")
        try:
            marker = self.storage.mark_bad(checkpoint, reason)
        except OSError as exc:  # read-only storage: still fall back, say why it is not marked
            self.log(f"[meshtrain] {problem}; could not mark it bad ({exc.strerror}), {next_step}")
            return
        self.log(f"[meshtrain] {problem}; marked it bad ({marker}), {next_step}")

    # --- plumbing -----------------------------------------------------------------------------

    def _emit(self, event: SaveCommitted | CheckpointLoaded) -> None:
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

    def _agree(self, problem: _Problem | None) -> _Problem | None:
        """The lowest rank's problem, on every rank (None when no rank has one)."""
        if not self.distributed:
            return problem
        problems: list[_Problem | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, problem, group=self.group)
        return next((p for p in problems if p is not None), None)

    def close(self) -> None:
        self.finish_pending()
        if self._stager is not None:  # DCP leaves closing a stager it was given to its owner
            self._stager.close()
            self._stager = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


@dataclass(frozen=True)
class _Problem:
    reason: str
    unreachable: bool  # the storage did not answer: nothing is known about the checkpoint itself


def _problem(exc: BaseException, shown: str) -> _Problem:
    return _Problem(_reason(exc, shown), _unreachable(exc))


def _settled(problem: _Problem | None) -> str | None:
    """The reason to mark a checkpoint bad, or None; a storage that did not answer is no reason to:
    CheckpointUnreachable then ends this start (Ray restarts the group, which tries again)."""
    if problem is not None and problem.unreachable:
        raise CheckpointUnreachable(
            f"{problem.reason}; the checkpoint storage did not answer (nothing was marked bad): a restart tries again"
        )
    return None if problem is None else problem.reason


# Errors of a store that did not answer (the network, S3's clients), as opposed to what it returned.
_UNREACHABLE_ERRNOS = frozenset({
    errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EHOSTUNREACH,
    errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE,
})
_UNREACHABLE_TYPES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError",
})


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the storage not answering rather than a fault in the checkpoint."""
    return any(
        isinstance(e, (ConnectionError, TimeoutError))
        or (isinstance(e, OSError) and e.errno in _UNREACHABLE_ERRNOS)
        or any(cls.__name__ in _UNREACHABLE_TYPES for cls in type(e).__mro__)
        for e in wrapped_errors(exc)
    )


def _reason(exc: BaseException, shown: str) -> str:
    """One line for a failed load: the lowest failing rank's error, naming the checkpoint."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]
    if isinstance(exc, CheckpointError):  # ours name the checkpoint already
        return _first_line(exc)
    return f"checkpoint {shown}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]
