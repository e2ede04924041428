"""A CUDA memory snapshot when a rank runs out of memory in a step.

On a GPU worker, a step that raises ``torch.OutOfMemoryError`` first writes the caching allocator's
snapshot to ``<run dir>/memory/rank<R>.step<S>.pickle`` (drag it onto https://pytorch.org/memory_viz)
and prints one line naming the file, the plan's per-rank estimate and the real peak, then re-raises.
With ``memory.history_entries`` the allocator also records its recent allocations with their stacks
from the start of the run, so the snapshot says what allocated each block; without, it still shows
the segments and the blocks in them (fragmentation). The CUDA calls sit in :class:`CudaAllocator`,
which a CPU test substitutes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 1024**3


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


def _print_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class OutOfMemorySnapshots:
    """Wraps each step (``with snapshots.step(n):``); on a CPU worker it only lets the error through."""

    def __init__(
        self,
        allocator: CudaAllocator | None,
        folder: Path,
        rank: int,
        history_entries: int | None,
        planned_bytes: Callable[[], int],
        log: Callable[[str], None] = _print_line,
    ) -> None:
        self.allocator, self.folder, self.rank = allocator, folder, rank
        self.planned_bytes, self.log = planned_bytes, log
        if allocator is not None and history_entries is not None:
            allocator.record_history(history_entries)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        try:
            yield
        except torch.OutOfMemoryError:
            if self.allocator is not None:
                self._snapshot(self.allocator, step)
            raise

    def _snapshot(self, allocator: CudaAllocator, step: int) -> None:
        path = self.folder / f"rank{self.rank}.step{step}.pickle"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            allocator.dump_snapshot(path)
            written = f"memory snapshot {path} (open it at https://pytorch.org/memory_viz)"
        except OSError as exc:  # the out-of-memory error stays the failure to report
            written = f"no memory snapshot ({path}: {exc.strerror or exc})"
        planned, peak = self.planned_bytes(), allocator.peak_allocated()
        self.log(
            f"[meshtrain] rank {self.rank}: out of CUDA memory at step {step}; {written}; plan estimate "
            f"{planned / GIB:.2f} GiB per rank, real peak {peak / GIB:.2f} GiB allocated"
        )
