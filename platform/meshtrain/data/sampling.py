"""From a token stream to per-rank micro-batches, addressed by one global sample position.

A stream (a numpy array, or a :class:`TokenStore`) is cut into windows of ``seq_len + 1`` tokens
at a stride of ``seq_len`` (inputs and shifted targets, no padding; a window may span two shards).
The order of windows is a seeded permutation per epoch over the *global* sample index. Optimizer
step ``t`` consumes global samples ``[t*G, (t+1)*G)``; each data-parallel rank takes its own
disjoint part of every micro-batch. The only state is that global position, so a run resumes
exactly, and on any number of ranks, from one integer.

A mixture draws global samples from several streams in fixed proportions; a validation split holds
windows out of training, and :class:`HeldOutSamples` reads them back in a fixed order.

Sampling schemes (a checkpoint records the one it was trained with, and a resumed run keeps it):

* ``feistel-v1``: each epoch's order and the validation split are Feistel permutations evaluated
  per index (:mod:`meshtrain.data.permutation`), so a rank's memory does not grow with the corpus.
* ``permutation-v0``: the order is a materialized permutation of every window per epoch and the
  split materialized id arrays (8 bytes per window); kept only for runs whose checkpoints predate
  the record, so their order does not change mid-run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from meshtrain.data.permutation import FeistelPermutation

SAMPLING_SCHEME = "feistel-v1"  # what new runs use
LEGACY_SAMPLING = "permutation-v0"  # runs whose checkpoints record no scheme were trained with this
SAMPLING_SCHEMES = (SAMPLING_SCHEME, LEGACY_SAMPLING)
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


def held_out_count(windows: int, fraction: float) -> int:
    """How many of ``windows`` a validation ``fraction`` holds out (at least one when > 0, never all)."""
    return 0 if fraction <= 0 else min(windows - 1, max(1, round(windows * fraction)))


class WindowSplit(Protocol):
    """Which windows of one stream are held out: ``held_out(k)`` is the ``k``-th held-out window,
    ``training(j)`` the ``j``-th training window (each set in a fixed order)."""

    held_out_windows: int
    training_windows: int

    def held_out(self, k: int) -> int: ...

    def training(self, j: int) -> int: ...


class FeistelSplit:
    """The split as one fixed permutation of the windows: its first ``held_out_windows`` values are
    held out, the rest train. Membership and lookups are computed per window, in constant memory."""

    def __init__(self, windows: int, fraction: float) -> None:
        self.held_out_windows = held_out_count(windows, fraction)
        self.training_windows = windows - self.held_out_windows
        self._permutation = FeistelPermutation(windows, (_VALIDATION_SEED,))

    def held_out(self, k: int) -> int:
        return self._permutation(k)

    def training(self, j: int) -> int:
        return self._permutation(self.held_out_windows + j)

    def is_held_out(self, window: int) -> bool:
        return self._permutation.inverse(window) < self.held_out_windows


class LegacySplit:
    """``permutation-v0``'s split: a seeded choice of held-out ids, both sets as sorted arrays."""

    def __init__(self, windows: int, fraction: float) -> None:
        count = held_out_count(windows, fraction)
        chosen = np.random.default_rng([_VALIDATION_SEED, windows]).choice(windows, size=count, replace=False)
        self._held = np.sort(chosen).astype(np.int64)
        self._train = np.setdiff1d(np.arange(windows, dtype=np.int64), self._held, assume_unique=True)
        self.held_out_windows, self.training_windows = len(self._held), len(self._train)

    def held_out(self, k: int) -> int:
        return int(self._held[k])

    def training(self, j: int) -> int:
        return int(self._train[j])


class WholeStream:
    """A separate validation source: every window held out, in stream order."""

    def __init__(self, windows: int) -> None:
        self.held_out_windows, self.training_windows = windows, 0

    def held_out(self, k: int) -> int:
        return k

    def training(self, j: int) -> int:
        raise IndexError("a validation source has no training windows")


def validation_split(scheme: str, windows: int, fraction: float) -> WindowSplit | None:
    """The split of one training stream under ``scheme``, or None when nothing is held out."""
    if fraction <= 0:
        return None
    if scheme == SAMPLING_SCHEME:
        return FeistelSplit(windows, fraction)
    if scheme == LEGACY_SAMPLING:
        return LegacySplit(windows, fraction)
    raise ValueError(f"unknown sampling scheme {scheme!r}; this meshtrain knows {', '.join(SAMPLING_SCHEMES)}")


class Samples(Protocol):
    def sample(self, global_index: int) -> np.ndarray: ...


class PackedSequences:
    """Windows of ``seq_len + 1`` tokens over a stream, in a seeded order per epoch.

    With a ``split``, only its training windows are sampled.
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenStream,
        seq_len: int,
        seed: int | tuple[int, ...],
        split: WindowSplit | None = None,
        scheme: str = SAMPLING_SCHEME,
    ) -> None:
        if scheme not in SAMPLING_SCHEMES:
            raise ValueError(f"unknown sampling scheme {scheme!r}; this meshtrain knows {', '.join(SAMPLING_SCHEMES)}")
        self.stream, self.seq_len, self.split, self.scheme = as_stream(tokens), seq_len, split, scheme
        self.seed = list(seed) if isinstance(seed, tuple) else [seed]
        self.windows = window_count(self.stream, seq_len) if split is None else split.training_windows
        if self.windows < 1:
            raise ValueError(f"{len(self.stream)} tokens cannot fill one window of {seq_len + 1}")
        self._epoch: int | None = None
        self._order: Callable[[int], int] = int

    def _order_for(self, epoch: int) -> Callable[[int], int]:
        """Position within the epoch -> slot among the training windows."""
        if epoch != self._epoch:
            self._epoch = epoch
            if self.scheme == SAMPLING_SCHEME:
                self._order = FeistelPermutation(self.windows, (*self.seed, epoch))
            else:
                order = np.random.default_rng([*self.seed, epoch]).permutation(self.windows)
                self._order = lambda position: int(order[position])
        return self._order

    def window(self, window_id: int) -> np.ndarray:
        start = window_id * self.seq_len
        return self.stream.read(start, start + self.seq_len + 1)

    def window_of(self, global_index: int) -> int:
        epoch, position = divmod(global_index, self.windows)
        slot = self._order_for(epoch)(position)
        return slot if self.split is None else self.split.training(slot)

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
    """Validation windows read back in a fixed order (each split's held-out order, sources in turn)."""

    def __init__(self, parts: Sequence[tuple[PackedSequences, WindowSplit]]) -> None:
        self.parts = [(sequences, split) for sequences, split in parts if split.held_out_windows]
        self.offsets = np.cumsum([0] + [split.held_out_windows for _, split in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, index: int) -> np.ndarray:
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        sequences, split = self.parts[part]
        return sequences.window(split.held_out(int(index - self.offsets[part])))

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
