"""Each data-parallel rank's micro-batches of optimizer step ``t`` (global samples ``[t*G, (t+1)*G)``),
read ahead on a pool of threads and moved to the device."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from meshtrain.data.sampling import Samples, WindowRef


def to_device(rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(rows.astype(np.int64))
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


class DataParallelBatches:
    """This rank's micro-batches for each optimizer step, from a global sample position.

    Step layout: the global batch of ``G`` samples is split into ``accumulation`` micro-steps;
    micro-step ``a`` gives rank ``r`` samples ``a*dp*m + r*m + [0, m)`` of the batch.

    The order is known in advance, so the windows of the next ``read_ahead_steps`` steps are read
    by ``read_threads`` background threads while the current step trains: with storage that takes
    tens of milliseconds per request, the step finds its batch already read. Only the reads run in
    the threads; which window a sample is (the order, the mixture) is decided in the caller's thread,
    which hands a step's reads to the threads in one task, after it has made its own step's batch:
    reads (and their checks) then run beside the training step rather than slowing its wait for data.
    """

    def __init__(
        self,
        samples: Samples,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        position: int = 0,
        read_ahead_steps: int = 0,
        read_threads: int = 4,
    ) -> None:
        self.samples, self.global_batch_size, self.micro_batch_size = samples, global_batch_size, micro_batch_size
        self.device = device
        self._split(dp_rank, dp_size)
        self.position = position
        self.read_ahead_steps = read_ahead_steps
        self._reader = ThreadPoolExecutor(read_threads, thread_name_prefix="meshtrain-read") if read_ahead_steps else None
        # Per step being read: a task that submits its reads, returning them per micro-step.
        self._pending: OrderedDict[int, Future[list[list[Future[np.ndarray]]]]] = OrderedDict()

    def _split(self, dp_rank: int, dp_size: int) -> None:
        if self.global_batch_size % (self.micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x data-parallel size")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accumulation = self.global_batch_size // (self.micro_batch_size * dp_size)

    def resplit(self, dp_rank: int, dp_size: int, position: int) -> None:
        """From ``position`` on, this rank is ``dp_rank`` of ``dp_size``: the live replica groups of a
        replica-mode step split its samples (the same samples, over more or fewer ranks)."""
        if (dp_rank, dp_size, position) != (self.dp_rank, self.dp_size, self.position):
            self._drop_pending()  # what was read ahead is another rank's share, or another step's
            self._split(dp_rank, dp_size)
            self.position = position

    def _rows_of(self, base: int) -> list[list[WindowRef]]:
        """Where each of this rank's samples of the step starting at ``base`` is, per micro-step."""
        per_micro_step = self.micro_batch_size * self.dp_size
        firsts = [base + a * per_micro_step + self.dp_rank * self.micro_batch_size for a in range(self.accumulation)]
        return [[self.samples.locate(first + i) for i in range(self.micro_batch_size)] for first in firsts]

    def _read_ahead(self, base: int, steps: int) -> None:
        """Start reading the ``steps`` steps from ``base`` that are not being read yet."""
        assert self._reader is not None
        for step in range(steps):
            at = base + step * self.global_batch_size
            if at not in self._pending:
                self._pending[at] = self._reader.submit(self._submit_reads, self._rows_of(at))

    def _submit_reads(self, rows: list[list[WindowRef]]) -> list[list[Future[np.ndarray]]]:
        assert self._reader is not None
        return [[self._reader.submit(ref.read) for ref in refs] for refs in rows]

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-step of the next optimizer step; advances the position."""
        base, self.position = self.position, self.position + self.global_batch_size
        if self._reader is None:
            for refs in self._rows_of(base):
                yield to_device(np.stack([ref.read() for ref in refs]), self.device)
            return
        self._read_ahead(base, 1)
        step = self._pending.pop(base).result()
        if not all(future.done() for futures in step for future in futures):
            self._read_ahead(self.position, self.read_ahead_steps)  # reading is behind: keep every thread busy
        batches = [to_device(np.stack([future.result() for future in futures]), self.device) for futures in step]
        self._read_ahead(self.position, self.read_ahead_steps)
        yield from batches

    def _drop_pending(self) -> None:
        """Cancel the reads not started yet (reads already running finish; their results are dropped)."""
        for task in self._pending.values():
            if not task.cancel() and task.done() and task.exception() is None:
                for futures in task.result():
                    for future in futures:
                        future.cancel()
        self._pending.clear()

    def close(self) -> None:
        """Stop reading ahead (reads already running finish; their results are dropped)."""
        self._drop_pending()
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
        self._drop_pending()
