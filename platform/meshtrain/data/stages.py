"""Data stages: the mixture changes at given steps, with exact accounting.

A run's global samples are cut into stages at sample positions (a stage ending after step ``s`` ends at
global sample ``s * G``, so a boundary falls between two steps). Stage ``k`` draws its samples from the
sources in its own proportions (a source may be absent from a stage) through a :class:`MixtureSamples`
of its own, and every source's own sample index continues where the earlier stages left it: no sample of
a source is drawn twice, or skipped, across a boundary. Which sample a global position holds depends on
the position alone (and on the stages that began before it), so a run resumes exactly at any step, the
boundary itself included, and on any number of data-parallel ranks, from the one integer it always kept.

With one stage whose weights are the sources' own, the order is the plain mixture's, and a run without
data.stages that leaves samples out (``data.skip_samples``, rollbacks) reads through one such unnamed stage.

Samples left out (:class:`~meshtrain.data.skips.SkipRange`) are ranges of a stage's own sequence: a
position of the stage reads the next sample of its sequence that is not left out, and the sources of the
next stage continue after everything the stage's sequence reached, left-out samples included.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.config import DataConfig
from meshtrain.data.sampling import MIXTURE_BLOCK, MixtureSamples, Samples, WindowRef
from meshtrain.data.skips import SkipMap, SkipRange


@dataclass(frozen=True)
class DataStage:
    """One stage as the samples see it: its label (None: the one stage of a run without data.stages), its
    first global sample, and a weight per source (in the order of the run's sources; 0 where the source
    is not drawn)."""

    name: str | None
    first_sample: int
    weights: tuple[float, ...]
    seq_len: int | None = None  # the stage's own sequence length (None: data.seq_len)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"name": self.name, "first_sample": self.first_sample, "weights": list(self.weights)}
        if self.seq_len is not None:
            document["seq_len"] = self.seq_len
        return document


def data_stages(data: DataConfig, global_batch_size: int) -> tuple[DataStage, ...]:
    """``data.stages`` as the samples see them: a stage ending after step ``s`` (its until_step, or the step its
    until_tokens resolve to) ends at sample ``s * G``, its weights in the order of ``data.sources``."""
    sources = [source.name or "" for source in data.sources or []]
    resolved, first = [], 0
    for stage, end in zip(data.stages or (), data.stage_ends(global_batch_size)):
        seq_len = stage.seq_len if stage.seq_len != data.seq_len else None
        resolved.append(DataStage(stage.name, first, tuple(float(stage.weights.get(name, 0.0)) for name in sources),
                                  seq_len))
        if end is not None:
            first = end * global_batch_size
    return tuple(resolved)


def unstaged(weights: Sequence[float]) -> tuple[DataStage, ...]:
    """The one unnamed stage of a run without data.stages, drawing in the sources' own weights."""
    return (DataStage(None, 0, tuple(float(weight) for weight in weights)),)


class StagedSamples:
    """Global samples drawn stage by stage; each stage a mixture of its own over the same sources (at the
    stage's own sequence length: ``other_lengths`` holds the sources' windows of each length that is not
    data.seq_len, in the sources' order)."""

    def __init__(self, components: Sequence[Samples], stages: Sequence[DataStage], seed: int,
                 block: int = MIXTURE_BLOCK, skips: Sequence[SkipRange] = (),
                 other_lengths: Mapping[int, Sequence[Samples]] | None = None) -> None:
        if not stages or stages[0].first_sample != 0:
            raise ValueError("the first stage starts at sample 0")
        if any(b.first_sample <= a.first_sample for a, b in zip(stages, stages[1:])):
            raise ValueError("stages must start at increasing samples")
        self.components, self.stages = list(components), list(stages)
        lengths = dict(other_lengths or {})
        missing = sorted({stage.seq_len for stage in stages if stage.seq_len is not None} - lengths.keys())
        if missing:
            raise ValueError(f"no windows of length {missing[0]} for the stages that train it")
        # Each stage's sources: the run's windows, or those of the stage's own length.
        self.sources_of = [list(lengths[stage.seq_len]) if stage.seq_len is not None else self.components
                           for stage in self.stages]
        self.firsts = [stage.first_sample for stage in self.stages]
        # Stage 0 keeps the plain mixture's shuffle, so one stage is the mixture of old.
        self.mixtures = [MixtureSamples(self.sources_of[k], stage.weights, seed, block, salt=() if k == 0 else (k,))
                         for k, stage in enumerate(self.stages)]
        self.skip(skips)

    def skip(self, skips: Sequence[SkipRange]) -> None:
        """Leave out ``skips`` (every range the run leaves out, not only new ones) from now on."""
        names = [stage.name for stage in self.stages]
        unknown = sorted({str(skip.stage) for skip in skips if skip.stage not in names})
        if unknown:
            raise ValueError(f"skipped ranges name stages this run does not have: {', '.join(unknown)}")
        self.skips = tuple(skips)
        self.maps = [SkipMap([(s.start, s.stop) for s in skips if s.stage == stage.name]) for stage in self.stages]
        # Each source's samples drawn by the stages of the same length before stage k: where its index
        # continues in stage k (windows of another length are another order of the source).
        drawn_by_length: dict[int | None, list[int]] = {}
        self.offsets = []
        for k, stage in enumerate(self.stages):
            before = drawn_by_length.setdefault(stage.seq_len, [0] * len(self.components))
            self.offsets.append(list(before))
            if k + 1 < len(self.stages):
                reach = self.maps[k].extent(self.firsts[k + 1] - self.firsts[k])
                drawn_by_length[stage.seq_len] = [a + b for a, b in zip(before, self.mixtures[k].source_counts(0, reach))]

    def stage_of(self, global_index: int) -> int:
        return bisect.bisect_right(self.firsts, global_index) - 1

    def stage_name(self, global_index: int) -> str | None:
        return self.stages[self.stage_of(max(global_index, 0))].name

    def sequence_index(self, global_index: int) -> tuple[int, int]:
        """(stage, index in that stage's own sequence) of a global sample."""
        k = self.stage_of(global_index)
        return k, self.maps[k].index(global_index - self.firsts[k])

    def skip_ranges(self, start: int, stop: int) -> list[SkipRange]:
        """The ranges of the stages' sequences that the global samples ``[start, stop)`` read (with the
        ranges already left out between them, so the result joins up with them)."""
        ranges = []
        for k, first in enumerate(self.firsts):
            end = self.firsts[k + 1] if k + 1 < len(self.firsts) else None
            low, high = max(start, first), stop if end is None else min(stop, end)
            if low < high:
                ranges.append(SkipRange(self.stages[k].name, self.maps[k].index(low - first),
                                        self.maps[k].extent(high - first)))
        return ranges

    def source_of(self, global_index: int) -> tuple[int, int]:
        """(source, that source's own sample index) of a global sample."""
        k, index = self.sequence_index(global_index)
        source, own = self.mixtures[k].source_of(index)
        return source, self.offsets[k][source] + own

    def locate(self, global_index: int) -> WindowRef:
        source, index = self.source_of(global_index)
        return self.sources_of[self.stage_of(global_index)][source].locate(index)

    def sample(self, global_index: int) -> Any:
        return self.locate(global_index).read()

    def source_counts(self, start: int, stop: int) -> list[int]:
        """How many of the global samples ``[start, stop)`` each source gives."""
        counts = [0] * len(self.components)
        for k, (first, mixture) in enumerate(zip(self.firsts, self.mixtures)):
            end = self.firsts[k + 1] if k + 1 < len(self.firsts) else None
            low, high = max(start, first), stop if end is None else min(stop, end)
            if low < high:
                counts = [a + b for a, b in zip(counts, self._trained(k, low - first, high - first))]
        return counts

    def _trained(self, k: int, start: int, stop: int) -> list[int]:
        """Samples each source gives positions ``[start, stop)`` of stage ``k`` (the left-out ones not)."""
        return self._kept(k, self.maps[k].index(start), self.maps[k].extent(stop))

    def _kept(self, k: int, low: int, high: int) -> list[int]:
        """Samples each source has at indices ``[low, high)`` of stage ``k``'s sequence, less those left out."""
        counts = self.mixtures[k].source_counts(low, high)
        for a, b in self.maps[k].inside(low, high):
            counts = [n - m for n, m in zip(counts, self.mixtures[k].source_counts(a, b))]
        return counts

    def _stage_index(self, skip: SkipRange) -> int:
        return next(k for k, stage in enumerate(self.stages) if stage.name == skip.stage)

    def skipped_counts(self, skip: SkipRange) -> list[int]:
        """Samples each source has in a left-out range."""
        return self.mixtures[self._stage_index(skip)].source_counts(skip.start, skip.stop)

    def newly_left_out(self, skip: SkipRange) -> list[int]:
        """Samples each source has in ``skip`` that are not left out yet (what leaving it out takes away)."""
        return self._kept(self._stage_index(skip), skip.start, skip.stop)

    def counters(self, position: int, labels: Sequence[str]) -> dict[str, dict[str, int]]:
        """Samples each source gave each stage that began before ``position`` (the samples trained so far)."""
        drawn: dict[str, dict[str, int]] = {}
        for k, stage in enumerate(self.stages):
            if stage.first_sample >= position:
                break
            end = min(position, self.firsts[k + 1]) if k + 1 < len(self.firsts) else position
            counts = self._trained(k, 0, end - stage.first_sample)
            drawn[stage.name or ""] = {label: count for label, count in zip(labels, counts) if count}
        return drawn


def left_out_now(samples: object) -> tuple[tuple[SkipRange, ...], list[tuple[str | None, int]]]:
    """What a run's training samples leave out, and its stages' names and first samples."""
    if isinstance(samples, StagedSamples):
        return samples.skips, [(stage.name, stage.first_sample) for stage in samples.stages]
    return (), [(None, 0)]
