"""The validation set: held-out windows of every source read back in a fixed order that takes from each
source in turn, scoring each source on its own (and only documents wholly inside a held-out span)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from meshtrain.data.batches import to_device
from meshtrain.data.sampling import IGNORE_INDEX, PackedSequences
from meshtrain.data.splits import SpanSplit, WindowSplit


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
            inputs, targets = to_device(rows, device)
            keep = torch.zeros(targets.shape, dtype=torch.bool)
            for row, item in enumerate(group):
                keep[row, item.lo : item.hi] = True
            targets = targets.masked_fill(~keep.to(targets.device), IGNORE_INDEX)
            sources = torch.tensor([item.part for item in group], device=targets.device)
            yield ValidationBatch(inputs, targets, sources)
