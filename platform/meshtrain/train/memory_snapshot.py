"""A CUDA memory snapshot when a rank runs out of memory in a step.

On a GPU worker, a step that raises ``torch.OutOfMemoryError`` first writes the caching allocator's
snapshot to ``<run dir>/memory/rank<R>.step<S>.pickle`` (drag it onto https://pytorch.org/memory_viz),
then fails the run with one line naming the file, the plan's per-rank estimate and the real peak.
The failure is permanent: a restarted group resumes from the last checkpoint and replays the same
steps on the same batches with the same shapes, so it would run out at the same step again, each
restart costing a reload. (Memory held by a process outside the run is the exception: a real peak
well below the device's size says so.)
With ``memory.history_entries`` the allocator also records its recent allocations with their stacks
from the start of the run, so the snapshot says what allocated each block; without, it still shows
the segments and the blocks in them (fragmentation). With the history on, a rank that finishes its
steps writes ``rank<R>.step<S>.end.pickle`` too: the timeline of its last allocations, peaks included,
for a run that fits but runs close to the limit. The CUDA calls sit in :class:`CudaAllocator`,
which a CPU test substitutes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch

from meshtrain.config import PermanentError
from meshtrain.observe.run_folder import MemorySnapshotRecord
from meshtrain.train.loop import LoopPart
from meshtrain.train.records import LoopOutputs

GIB = 1024**3

# What the final line suggests: a restart would replay the step, so the shapes or the layout must change.
_FIX = ("lower train.micro_batch_size, set parallel.activation_checkpointing=selective or full, or shard over more "
        "workers (python jobs/pretrain.py --dry-run prints the plan); a restart would run out at the same step")


class DeviceOutOfMemory(PermanentError):
    """A step ran out of device memory: the same step would run out again after a restart."""


class CudaAllocator:
    """The caching allocator of one CUDA device: the only CUDA calls this module makes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def record_history(self, max_entries: int) -> None:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, device=self.device)

    def dump_snapshot(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def cuda_allocator(device: torch.device) -> CudaAllocator | None:
    """The allocator a snapshot is taken from: None on a CPU worker."""
    return CudaAllocator(device) if device.type == "cuda" else None


class OutOfMemorySnapshots(LoopPart):
    """Wraps each step (``with snapshots.step(n):``); on a CPU worker it only lets the error through.
    At the end, the snapshot of the last steps is written and announced to ``outputs``."""

    def __init__(
        self,
        allocator: CudaAllocator | None,
        folder: Path,
        rank: int,
        history_entries: int | None,
        planned_bytes: Callable[[], int],
        outputs: LoopOutputs | None = None,
    ) -> None:
        self.allocator, self.folder, self.rank, self.outputs = allocator, folder, rank, outputs
        self.planned_bytes = planned_bytes
        self.recording = allocator is not None and history_entries is not None
        if allocator is not None and history_entries is not None:
            allocator.record_history(history_entries)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        try:
            yield
        except torch.OutOfMemoryError:
            # Not chained as the cause: the driver reports the innermost cause, and this line is the one to show.
            raise DeviceOutOfMemory(self._describe(step)) from None

    def around_step(self, step: int) -> AbstractContextManager[None]:
        return self.step(step)

    def at_end(self, step: int) -> None:
        snapshot = self.finished(step)
        if snapshot is not None and self.outputs is not None:
            self.outputs.emit(MemorySnapshotRecord(step=step, rank=self.rank, path=str(snapshot)))

    def finished(self, step: int) -> Path | None:
        """The steps are done: with the allocator's history on, the snapshot of them, written."""
        if self.allocator is None or not self.recording:
            return None
        path = self.folder / f"rank{self.rank}.step{step}.end.pickle"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.allocator.dump_snapshot(path)
        except OSError as exc:  # the trained steps stand; the snapshot was only asked for
            print(f"[meshtrain] rank {self.rank}: no memory snapshot ({path}: {exc.strerror or exc})", file=sys.stderr)
            return None
        return path

    def _describe(self, step: int) -> str:
        planned = f"plan estimate {self.planned_bytes() / GIB:.2f} GiB per rank"
        if self.allocator is None:
            return f"rank {self.rank} ran out of memory at step {step} ({planned}); {_FIX}"
        path = self.folder / f"rank{self.rank}.step{step}.pickle"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.allocator.dump_snapshot(path)
            written = f"memory snapshot {path} (open it at https://pytorch.org/memory_viz)"
        except OSError as exc:  # running out of memory stays the failure to report
            written = f"no memory snapshot ({path}: {exc.strerror or exc})"
        peak = self.allocator.peak_allocated()
        return (f"rank {self.rank} ran out of CUDA memory at step {step} ({planned}, real peak {peak / GIB:.2f} GiB "
                f"allocated); {written}; {_FIX}")
