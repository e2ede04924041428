"""From a token stream to per-rank micro-batches, addressed by one global sample position.

A stream (a numpy array, or a :class:`TokenStore`) is cut into windows of ``seq_len + 1`` tokens
at a stride of ``seq_len`` (inputs and shifted targets, no padding; a window may span two shards).
The order of windows is a seeded permutation per epoch over the *global* sample index. Optimizer
step ``t`` consumes global samples ``[t*G, (t+1)*G)``; each data-parallel rank takes its own
disjoint part of every micro-batch. The only state is that global position, so a run resumes
exactly, and on any number of ranks, from one integer.

A mixture draws global samples from several streams in fixed proportions. Validation data is held
out of training in whole documents, and :class:`ValidationSet` reads it back in a fixed order that
takes from every source in turn, scoring each source on its own.

Sampling schemes (a checkpoint records the one it was trained with, and a resumed run keeps it):

* ``feistel-v2``: each epoch's order is a Feistel permutation evaluated per index
  (:mod:`meshtrain.data.permutation`), so a rank's memory does not grow with the corpus; validation
  holds out whole *spans* of consecutive windows, chosen by another Feistel permutation, and scores
  only the documents that lie wholly inside a held-out span, which no training window touches.
* ``feistel-v1``: the same order, but single windows held out and scored whole, so a document could
  straddle a training and a held-out window; kept for runs whose checkpoints were trained with it.
* ``permutation-v0``: the order is a materialized permutation of every window per epoch and the
  split materialized id arrays (8 bytes per window); kept only for runs whose checkpoints predate
  the record, so their order does not change mid-run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from meshtrain.data.permutation import FeistelPermutation
from meshtrain.data.schemes import LEGACY_SAMPLING, SAMPLING_SCHEME, SAMPLING_SCHEMES
from meshtrain.data.splits import WindowSplit

# Mixture assignments repeat in blocks of this many samples, so proportions hold to 1/BLOCK.
MIXTURE_BLOCK = 4096
IGNORE_INDEX = -100  # a target the loss skips (the loss functions' and F.cross_entropy's convention)


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


@dataclass(frozen=True)
class WindowRef:
    """Where one sample's tokens are: ``length`` tokens of ``stream`` from ``start``."""

    stream: TokenStream
    start: int
    length: int

    def read(self) -> np.ndarray:
        return self.stream.read(self.start, self.start + self.length)


class Samples(Protocol):
    def locate(self, global_index: int) -> WindowRef: ...

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
            if self.scheme != LEGACY_SAMPLING:
                self._order = FeistelPermutation(self.windows, (*self.seed, epoch))
            else:
                order = np.random.default_rng([*self.seed, epoch]).permutation(self.windows)
                self._order = lambda position: int(order[position])
        return self._order

    def window_ref(self, window_id: int) -> WindowRef:
        return WindowRef(self.stream, window_id * self.seq_len, self.seq_len + 1)

    def window(self, window_id: int) -> np.ndarray:
        return self.window_ref(window_id).read()

    def window_of(self, global_index: int) -> int:
        epoch, position = divmod(global_index, self.windows)
        slot = self._order_for(epoch)(position)
        return slot if self.split is None else self.split.training(slot)

    def locate(self, global_index: int) -> WindowRef:
        return self.window_ref(self.window_of(global_index))

    def sample(self, global_index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of global sample ``global_index`` (epochs wrap around)."""
        return self.locate(global_index).read()


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

    def __init__(self, components: Sequence[Samples], weights: Sequence[float], seed: int, block: int = MIXTURE_BLOCK,
                 salt: tuple[int, ...] = ()) -> None:
        if len(components) != len(weights) or not components or not sum(weights) > 0:
            raise ValueError("a mixture needs one weight per source, and a positive one")
        self.components, self.seed, self.block, self.salt = list(components), seed, block, salt
        self.counts = apportion(block, weights)
        self._block_index = -1
        self._source = self._rank = np.empty(0, dtype=np.int64)

    def _sources_of_block(self, block_index: int) -> np.ndarray:
        """The source of each sample of one block, in order."""
        if block_index == self._block_index:
            return self._source
        source = np.repeat(np.arange(len(self.counts)), self.counts)
        np.random.default_rng([self.seed, 0x31C, block_index, *self.salt]).shuffle(source)
        return source

    def _assign(self, block_index: int) -> None:
        if block_index == self._block_index:
            return
        source = self._sources_of_block(block_index)
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

    def source_counts(self, start: int, stop: int) -> list[int]:
        """How many of the global samples ``[start, stop)`` each source gives (the block the reader is in
        stays the cached one)."""
        counts = np.zeros(len(self.counts), dtype=np.int64)
        if stop <= start:
            return counts.tolist()
        first_block, last_block = start // self.block, (stop - 1) // self.block
        for block_index in {first_block, last_block}:  # the partial blocks at either end
            first = block_index * self.block
            sources = self._sources_of_block(block_index)[max(start - first, 0) : min(stop - first, self.block)]
            counts += np.bincount(sources, minlength=len(self.counts))
        whole = max(last_block - first_block - 1, 0)  # the blocks between hold every source's count exactly
        return (counts + whole * np.asarray(self.counts, dtype=np.int64)).tolist()

    def locate(self, global_index: int) -> WindowRef:
        source, index = self.source_of(global_index)
        return self.components[source].locate(index)

    def sample(self, global_index: int) -> np.ndarray:
        return self.locate(global_index).read()
