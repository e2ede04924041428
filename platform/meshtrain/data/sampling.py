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

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from meshtrain.config import ConfigError
from meshtrain.data.permutation import FeistelPermutation

SAMPLING_SCHEME = "feistel-v2"  # what new runs use
WINDOW_SPLIT_SAMPLING = "feistel-v1"
LEGACY_SAMPLING = "permutation-v0"  # runs whose checkpoints record no scheme were trained with this
SAMPLING_SCHEMES = (SAMPLING_SCHEME, WINDOW_SPLIT_SAMPLING, LEGACY_SAMPLING)


def checkpoint_sampling(manifest: dict, which: str) -> str:
    """The sampling scheme a checkpoint was trained with (``which`` names it in the error): a resumed run
    reads with it, so the data order never changes mid-run. One this meshtrain does not know is refused."""
    scheme = manifest.get("sampling", LEGACY_SAMPLING)  # checkpoints written before the record
    if scheme not in SAMPLING_SCHEMES:
        raise ConfigError(
            f"data: {which} were trained with sampling scheme {scheme!r}, which this meshtrain does not know "
            f"({', '.join(SAMPLING_SCHEMES)}); resume with the meshtrain that wrote them or choose another run.name"
        )
    return scheme
# Seeds the choice of held-out windows: fixed, so changing train.seed keeps the same validation set.
_VALIDATION_SEED = 0x5EED
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


class SpanSplit:
    """``feistel-v2``'s split: whole spans of ``span_windows`` consecutive windows held out.

    The ``full`` whole spans are ordered by one fixed Feistel permutation; its first
    ``held_out_spans`` are held out, the others (and the windows after the last whole span) train.
    Held-out windows are listed round-robin over the held-out spans, so the first few of them
    already come from all over the stream. Everything is computed per index, in constant memory.
    """

    def __init__(self, windows: int, fraction: float, span_windows: int) -> None:
        self.span_windows = max(1, min(span_windows, windows))
        self.spans = windows // self.span_windows
        self.held_out_spans = held_out_count(self.spans, fraction)
        self.held_out_windows = self.held_out_spans * self.span_windows
        self.training_windows = windows - self.held_out_windows
        self._training_in_spans = (self.spans - self.held_out_spans) * self.span_windows
        self._permutation = FeistelPermutation(self.spans, (_VALIDATION_SEED,))

    def held_out(self, k: int) -> int:
        round_, nth = divmod(k, self.held_out_spans)
        return self._permutation(nth) * self.span_windows + round_

    def training(self, j: int) -> int:
        if j >= self._training_in_spans:
            return self.spans * self.span_windows + (j - self._training_in_spans)
        slot, offset = divmod(j, self.span_windows)
        return self._permutation(self.held_out_spans + slot) * self.span_windows + offset

    def is_held_out(self, window: int) -> bool:
        span = window // self.span_windows
        return span < self.spans and self._permutation.inverse(span) < self.held_out_spans

    def span_of(self, window: int) -> tuple[int, int]:
        """The first window of ``window``'s span and the first after it."""
        first = window - window % self.span_windows
        return first, first + self.span_windows


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


# A small corpus may hold out up to this many times its fraction, so that a span can still hold
# whole documents (a span shorter than the documents would score nothing).
SPAN_OVERSHOOT = 8


def span_windows_for(seq_len: int, span_tokens: int, windows: int, fraction: float) -> int:
    """Windows per held-out span: ``span_tokens`` worth, shortened only where a corpus is so small
    that one span would hold out more than ``SPAN_OVERSHOOT`` times the fraction."""
    budget = max(1, math.floor(windows * fraction * SPAN_OVERSHOOT))
    return max(1, min(math.ceil(span_tokens / seq_len), budget))


def validation_split(scheme: str, windows: int, fraction: float, seq_len: int, span_tokens: int) -> WindowSplit | None:
    """The split of one training stream under ``scheme``, or None when nothing is held out."""
    if fraction <= 0:
        return None
    if scheme == SAMPLING_SCHEME:
        return SpanSplit(windows, fraction, span_windows_for(seq_len, span_tokens, windows, fraction))
    if scheme == WINDOW_SPLIT_SAMPLING:
        return FeistelSplit(windows, fraction)
    if scheme == LEGACY_SAMPLING:
        return LegacySplit(windows, fraction)
    raise ValueError(f"unknown sampling scheme {scheme!r}; this meshtrain knows {', '.join(SAMPLING_SCHEMES)}")


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

    def locate(self, global_index: int) -> WindowRef:
        source, index = self.source_of(global_index)
        return self.components[source].locate(index)

    def sample(self, global_index: int) -> np.ndarray:
        return self.locate(global_index).read()


@dataclass(frozen=True)
class ValidationPart:
    """One source's held-out windows. With ``eos_id``, only the documents wholly inside a held-out
    span are scored (a span split); without, every target of a held-out window is."""

    name: str
    sequences: PackedSequences
    split: WindowSplit
    eos_id: int | None = None


@dataclass(frozen=True)
class ValidationWindow:
    part: int
    window: int
    lo: int  # targets [lo, hi) of the window are scored
    hi: int


@dataclass(frozen=True)
class ValidationBatch:
    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX where a target is not scored
    sources: torch.Tensor  # each row's part index


class ValidationSet:
    """Held-out windows of every source, and which of their targets count.

    A held-out span scores the documents that lie wholly inside it (no training window reads them;
    a window's last token is the next window's first, so the span's first and last tokens are shared
    with training). :meth:`select` lists the windows an evaluation reads: one per held-out span in
    turn (so a few hundred windows already come from a few hundred places in the corpus), each part
    (source) in turn, skipping windows with nothing to score. Every rank computes the same list.
    """

    def __init__(self, parts: Sequence[ValidationPart]) -> None:
        self.parts = [part for part in parts if part.split.held_out_windows]
        self.names = [part.name for part in self.parts]
        self._selected: dict[int, list[ValidationWindow]] = {}

    def __len__(self) -> int:
        """Held-out windows in all (an upper bound on what :meth:`select` can return)."""
        return sum(part.split.held_out_windows for part in self.parts)

    def _scored_windows(self, index: int, limit: int) -> Iterator[ValidationWindow]:
        """One part's windows with scored targets, in turn over its first ``limit`` held-out spans."""
        part = self.parts[index]
        split, seq_len = part.split, part.sequences.seq_len
        if part.eos_id is None or not isinstance(split, SpanSplit):
            for k in range(split.held_out_windows):
                yield ValidationWindow(index, split.held_out(k), 0, seq_len)
            return
        ranges = []  # per span: its first and last window with a scored target, and the scored positions
        for nth in range(min(split.held_out_spans, limit)):
            first, stop = split.span_of(split.held_out(nth))
            ends = np.flatnonzero(part.sequences.stream.read(first * seq_len, stop * seq_len) == part.eos_id)
            if len(ends) >= 2:
                first_end, last_end = first * seq_len + int(ends[0]), first * seq_len + int(ends[-1])
                ranges.append((first_end // seq_len, (last_end - 1) // seq_len, first_end, last_end))
        for round_ in range(max((high - low + 1 for low, high, _, _ in ranges), default=0)):
            for low, high, first_end, last_end in ranges:
                window = low + round_
                if window <= high:
                    start = window * seq_len
                    yield ValidationWindow(index, window, max(0, first_end - start), min(seq_len, last_end - start))

    def select(self, count: int) -> list[ValidationWindow]:
        """The first ``count`` windows of the evaluation order (fewer when the held-out data has fewer)."""
        if count not in self._selected:
            streams = [self._scored_windows(k, count) for k in range(len(self.parts))]
            chosen: list[ValidationWindow] = []
            while streams and len(chosen) < count:
                for stream in list(streams):
                    item = next(stream, None)
                    if item is None:
                        streams.remove(stream)
                    elif len(chosen) < count:
                        chosen.append(item)
            self._selected[count] = chosen
        return self._selected[count]

    def batches(
        self, chosen: Sequence[ValidationWindow], micro_batch_size: int, dp_rank: int, dp_size: int, device: torch.device
    ) -> Iterator[ValidationBatch]:
        """This rank's part of ``chosen`` (rank r takes every dp_size-th, from r), in micro-batches;
        the union over ranks is the same on any mesh."""
        mine = chosen[dp_rank::dp_size]
        for first in range(0, len(mine), micro_batch_size):
            group = mine[first : first + micro_batch_size]
            rows = np.stack([self.parts[item.part].sequences.window(item.window) for item in group])
            inputs, targets = _to_device(rows, device)
            keep = torch.zeros(targets.shape, dtype=torch.bool)
            for row, item in enumerate(group):
                keep[row, item.lo : item.hi] = True
            targets = targets.masked_fill(~keep.to(targets.device), IGNORE_INDEX)
            sources = torch.tensor([item.part for item in group], device=targets.device)
            yield ValidationBatch(inputs, targets, sources)


def _to_device(rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x data-parallel size")
        self.samples, self.global_batch_size, self.micro_batch_size = samples, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device
        self.accumulation = global_batch_size // (micro_batch_size * dp_size)
        self.position = position
        self.read_ahead_steps = read_ahead_steps
        self._reader = ThreadPoolExecutor(read_threads, thread_name_prefix="meshtrain-read") if read_ahead_steps else None
        # Per step being read: a task that submits its reads, returning them per micro-step.
        self._pending: OrderedDict[int, Future[list[list[Future[np.ndarray]]]]] = OrderedDict()

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
                yield _to_device(np.stack([ref.read() for ref in refs]), self.device)
            return
        self._read_ahead(base, 1)
        step = self._pending.pop(base).result()
        if not all(future.done() for futures in step for future in futures):
            self._read_ahead(self.position, self.read_ahead_steps)  # reading is behind: keep every thread busy
        batches = [_to_device(np.stack([future.result() for future in futures]), self.device) for futures in step]
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
