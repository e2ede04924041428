"""Which windows of a stream are held out for validation, by sampling scheme: whole spans of windows
(``feistel-v2``), single windows (``feistel-v1``), materialized ids (``permutation-v0``), or none."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from meshtrain.data.permutation import FeistelPermutation

from meshtrain.data.schemes import LEGACY_SAMPLING, SAMPLING_SCHEME, SAMPLING_SCHEMES, WINDOW_SPLIT_SAMPLING

# Seeds the choice of held-out windows: fixed, so changing train.seed keeps the same validation set.
_VALIDATION_SEED = 0x5EED


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

    @classmethod
    def at_length(cls, base: SpanSplit, windows: int, span_windows: int) -> SpanSplit:
        """The split of ``base``'s stream cut into windows of another length, ``span_windows`` of which make
        one of its spans (``windows`` of them in all): the same token spans held out, in the same order."""
        split = cls.__new__(cls)
        split.span_windows, split.spans, split.held_out_spans = span_windows, base.spans, base.held_out_spans
        split.held_out_windows = split.held_out_spans * span_windows
        split.training_windows = windows - split.held_out_windows
        split._training_in_spans = (split.spans - split.held_out_spans) * span_windows
        split._permutation = base._permutation
        return split

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
