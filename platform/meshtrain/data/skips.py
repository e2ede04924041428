"""Samples a run leaves out: ranges of a stage's own sample sequence that are never trained.

A rollback after repeated loss spikes (``train.rollback_after_spikes``) leaves out the samples of the
steps behind the spikes, and a user can name ranges by hand (``data.skip_samples``). A range is given in
the stage's own sequence of samples (the sequence its mixture draws from, every sample counted, the
skipped ones included), so it names the same samples whatever the batch size, the ranks or the ranges
added after it; in a run without ``data.stages`` the one sequence is the run's.

The run still trains ``G`` samples per step and every stage still ends at its step: a position of the
stage (its samples in training order) reads the next sequence sample that is not left out, and a
skipped sample counts as drawn (the sources continue after it in the next stage), never as trained.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from meshtrain.config import ConfigError


@dataclass(frozen=True, order=True)
class SkipRange:
    """Samples ``[start, stop)`` of stage ``stage``'s sequence (None: a run without data.stages)."""

    stage: str | None
    start: int
    stop: int

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "start": self.start, "stop": self.stop}

    @classmethod
    def from_json(cls, document: Any) -> SkipRange:
        """ValueError unless ``document`` is {stage, start, stop} with 0 <= start < stop."""
        if not isinstance(document, dict) or not {"start", "stop"} <= document.keys():
            raise ValueError(f"a skipped range is {{stage, start, stop}}, not {document!r}")
        stage, start, stop = document.get("stage"), document["start"], document["stop"]
        if stage is not None and not isinstance(stage, str):
            raise ValueError(f"a skipped range's stage is a name, not {stage!r}")
        if not (type(start) is int and type(stop) is int and 0 <= start < stop):
            raise ValueError(f"a skipped range needs integers 0 <= start < stop, not {start!r}, {stop!r}")
        return cls(stage, start, stop)


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, with overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def merged_skips(skips: Iterable[SkipRange]) -> tuple[SkipRange, ...]:
    """The union of ``skips``, per stage, as few ranges as possible, in a stable order."""
    by_stage: dict[str | None, list[tuple[int, int]]] = {}
    for skip in skips:
        by_stage.setdefault(skip.stage, []).append((skip.start, skip.stop))
    return tuple(sorted(SkipRange(stage, a, b) for stage, spans in by_stage.items() for a, b in merged(spans)))


class SkipMap:
    """Positions of a sequence with some ranges left out → indices of the sequence."""

    def __init__(self, ranges: Sequence[tuple[int, int]] = ()) -> None:
        self.ranges = merged(ranges)
        # Position at which each range is jumped over: its start less the samples left out before it.
        self._at: list[int] = []
        left_out = 0
        for start, stop in self.ranges:
            self._at.append(start - left_out)
            left_out += stop - start
        self._before = [0]  # samples left out before range k
        for start, stop in self.ranges:
            self._before.append(self._before[-1] + stop - start)

    def index(self, position: int) -> int:
        """The sequence index that ``position`` reads."""
        return position + self._before[bisect.bisect_right(self._at, position)]

    def extent(self, positions: int) -> int:
        """How far into the sequence the first ``positions`` positions reach (the ranges they jump over
        counted)."""
        return 0 if positions <= 0 else self.index(positions - 1) + 1

    def inside(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The ranges lying in the sequence indices ``[start, stop)`` (a range never straddles what the
        positions read: positions jump over whole ranges)."""
        return [(a, b) for a, b in self.ranges if start <= a and b <= stop]


def changed_before(trained: Sequence[SkipRange], now: Sequence[SkipRange], stages: Sequence[tuple[str | None, int]],
                   position: int) -> SkipRange | None:
    """A range left out in one of ``trained`` (what a checkpoint was trained with) and ``now`` but not the
    other among the samples the checkpoint's first ``position`` global samples reached; None when the
    samples already trained are left out alike. ``stages``: each stage's name and first global sample (one
    unnamed stage at 0 in a run without data.stages). Ranges beyond what was reached may come and go."""
    for k, (name, first) in enumerate(stages):
        if first >= position:
            break
        end = stages[k + 1][1] if k + 1 < len(stages) else position
        reach = SkipMap([(s.start, s.stop) for s in trained if s.stage == name]).extent(min(end, position) - first)

        def past(ranges: Sequence[SkipRange], stage: str | None = name) -> set[tuple[int, int]]:
            spans = merged((s.start, s.stop) for s in ranges if s.stage == stage)
            return {(a, min(b, reach)) for a, b in spans if a < reach}  # what the positions read so far saw

        differ = sorted(past(trained) ^ past(now))
        if differ:
            return SkipRange(name, *differ[0])
    return None


def check_left_out(manifest: dict[str, Any], now: Sequence[SkipRange], stages: Sequence[tuple[str | None, int]],
                   step: int) -> None:
    """ConfigError unless the samples a checkpoint (its ``manifest``) was trained on are left out alike
    ``now`` (ranges among the samples it has yet to read may come and go)."""
    try:
        trained = [SkipRange.from_json(item) for item in manifest.get("left_out", [])]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the checkpoint of step {step}: its left_out list is damaged ({exc})") from None
    differs = changed_before(trained, now, stages, int(manifest.get("data_position", 0)))
    if differs is not None:
        where = f"stage {differs.stage!r}" if differs.stage is not None else "the run's samples"
        raise ConfigError(
            f"data.skip_samples: samples [{differs.start}, {differs.stop}) of {where} are left out by one of the "
            f"checkpoint of step {step} and this start but not the other, and the checkpoint had read past them; "
            "left-out samples already read cannot change: keep data.skip_samples and the run's left_out_samples.json "
            "as they were, or use another run.name"
        )


class _Range(Protocol):
    @property
    def stage(self) -> str | None: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...


def skips_of(*lists: Iterable[_Range]) -> tuple[SkipRange, ...]:
    """The union of ranges given by hand (data.skip_samples) and left out by rollbacks (the run folder's)."""
    return merged_skips(SkipRange(item.stage, item.start, item.stop) for items in lists for item in items)
