"""From a token stream to per-rank micro-batches, addressed by one global sample position.

A stream (a numpy array, or a :class:`TokenStore` whose shards are memory-mapped) is cut into
windows of ``seq_len + 1`` tokens at a stride of ``seq_len`` (inputs and shifted targets, no
padding; a window may span two shards). The order of windows is a seeded permutation per epoch
over the *global* sample index. Optimizer step ``t`` consumes global samples ``[t*G, (t+1)*G)``;
each data-parallel rank takes its own disjoint part of every micro-batch. The only state is that
global position, so a run resumes exactly, and on any number of ranks, from one integer.

A mixture draws global samples from several streams in fixed proportions; a validation split holds
windows out of training, and :class:`HeldOutSamples` reads them back in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

# Seeds the choice of held-out windows: fixed, so changing train.seed keeps the same validation set.
_VALIDATION_SEED = 0x5EED
# Mixture assignments repeat in blocks of this many samples, so proportions hold to 1/BLOCK.
MIXTURE_BLOCK = 4096


class TokenStream(Protocol):
    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ArrayStream:
    """An in-memory token array as a stream."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


def as_stream(tokens: np.ndarray | TokenStream) -> TokenStream:
    return ArrayStream(tokens) if isinstance(tokens, np.ndarray) else tokens


def window_count(stream: TokenStream, seq_len: int) -> int:
    return (len(stream) - 1) // seq_len


def held_out_windows(windows: int, fraction: float) -> np.ndarray:
    """The sorted ids of the windows a validation ``fraction`` holds out (at least one when > 0)."""
    if fraction <= 0:
        return np.empty(0, dtype=np.int64)
    count = min(windows - 1, max(1, round(windows * fraction)))
    chosen = np.random.default_rng([_VALIDATION_SEED, windows]).choice(windows, size=count, replace=False)
    return np.sort(chosen).astype(np.int64)


class Samples(Protocol):
    def sample(self, global_index: int) -> np.ndarray: ...


class PackedSequences:
    """Windows of ``seq_len + 1`` tokens over a stream, in a seeded order per epoch.

    ``exclude`` (sorted window ids, e.g. a validation split) are never sampled.
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenStream,
        seq_len: int,
        seed: int | tuple[int, ...],
        exclude: np.ndarray | None = None,
    ) -> None:
        self.stream, self.seq_len = as_stream(tokens), seq_len
        self.seed = list(seed) if isinstance(seed, tuple) else [seed]
        total = window_count(self.stream, seq_len)
        self._ids: np.ndarray | None = None
        if exclude is not None and len(exclude):
            self._ids = np.setdiff1d(np.arange(total, dtype=np.int64), exclude, assume_unique=True)
        self.windows = total if self._ids is None else len(self._ids)
        if self.windows < 1:
            raise ValueError(f"{len(self.stream)} tokens cannot fill one window of {seq_len + 1}")
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([*self.seed, epoch]).permutation(self.windows)
        return self._order

    def window(self, window_id: int) -> np.ndarray:
        start = window_id * self.seq_len
        return self.stream.read(start, start + self.seq_len + 1)

    def window_of(self, global_index: int) -> int:
        epoch, position = divmod(global_index, self.windows)
        slot = int(self._order_for(epoch)[position])
        return slot if self._ids is None else int(self._ids[slot])

    def sample(self, global_index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of global sample ``global_index`` (epochs wrap around)."""
        return self.window(self.window_of(global_index))


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder; ties to the earlier source)."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


class MixtureSamples:
    """Global samples drawn from several sources in fixed proportions, stateless in the index.

    Samples come in blocks of ``MIXTURE_BLOCK``: each block holds ``apportion(BLOCK, weights)``
    samples of every source, in an order shuffled by ``(seed, block)``. Global index ``i`` maps to
    a source and that source's own sample index, so the one global position still resumes a mixture
    exactly on any number of ranks.
    """

    def __init__(self, components: Sequence[Samples], weights: Sequence[float], seed: int, block: int = MIXTURE_BLOCK) -> None:
        if len(components) != len(weights) or not components:
            raise ValueError("a mixture needs one weight per source")
        self.components, self.seed, self.block = list(components), seed, block
        self.counts = apportion(block, weights)
        self._block_index = -1
        self._source = self._rank = np.empty(0, dtype=np.int64)

    def _assign(self, block_index: int) -> None:
        if block_index == self._block_index:
            return
        source = np.repeat(np.arange(len(self.counts)), self.counts)
        np.random.default_rng([self.seed, 0x31C, block_index]).shuffle(source)
        rank = np.empty_like(source)
        for k in range(len(self.counts)):
            positions = np.flatnonzero(source == k)
            rank[positions] = np.arange(len(positions))
        self._block_index, self._source, self._rank = block_index, source, rank

    def source_of(self, global_index: int) -> tuple[int, int]:
        """(source, that source's sample index) of a global sample."""
        block_index, offset = divmod(global_index, self.block)
        self._assign(block_index)
        source = int(self._source[offset])
        return source, block_index * self.counts[source] + int(self._rank[offset])

    def sample(self, global_index: int) -> np.ndarray:
        source, index = self.source_of(global_index)
        return self.components[source].sample(index)


class HeldOutSamples:
    """Validation windows read back in a fixed order (sorted window ids, sources in turn)."""

    def __init__(self, parts: Sequence[tuple[PackedSequences, np.ndarray]]) -> None:
        self.parts = [(sequences, ids) for sequences, ids in parts if len(ids)]
        self.offsets = np.cumsum([0] + [len(ids) for _, ids in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, index: int) -> np.ndarray:
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        sequences, ids = self.parts[part]
        return sequences.window(int(ids[index - self.offsets[part]]))

    def batches(
        self, count: int, micro_batch_size: int, dp_rank: int, dp_size: int, device: torch.device
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of the first ``count`` validation samples (rank r takes every dp_size-th,
        from r), as (inputs, targets) micro-batches; the union over ranks is the same on any mesh."""
        mine = list(range(dp_rank, min(count, len(self)), dp_size))
        for first in range(0, len(mine), micro_batch_size):
            rows = np.stack([self.sample(i) for i in mine[first : first + micro_batch_size]])
            yield _to_device(rows, device)


def _to_device(rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(rows.astype(np.int64))
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


class DataParallelBatches:
    """This rank's micro-batches for each optimizer step, from a global sample position.

    Step layout: the global batch of ``G`` samples is split into ``accumulation`` micro-steps;
    micro-step ``a`` gives rank ``r`` samples ``a*dp*m + r*m + [0, m)`` of the batch.
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
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x data-parallel size")
        self.samples, self.global_batch_size, self.micro_batch_size = samples, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device
        self.accumulation = global_batch_size // (micro_batch_size * dp_size)
        self.position = position

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-step of the next optimizer step; advances the position."""
        base, self.position = self.position, self.position + self.global_batch_size
        per_micro_step = self.micro_batch_size * self.dp_size
        for micro_step in range(self.accumulation):
            first = base + micro_step * per_micro_step + self.dp_rank * self.micro_batch_size
            rows = np.stack([self.samples.sample(first + i) for i in range(self.micro_batch_size)])
            yield _to_device(rows, self.device)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
