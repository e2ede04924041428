"""The data mixture as trained: at each logged step, each source's share of the samples since the
previous one, beside the share it aims at (the mixture's, exact per block). ``data.sources``' weights are what the shares aim at; the mixture is exact per block of
samples, so over a short interval the shares wander around the weights; with data.stages each record
names the stage whose weights its shares aim at."""

from __future__ import annotations

from meshtrain.checkpoint.state import Progress
from meshtrain.data.sampling import MixtureSamples
from meshtrain.data.stages import StagedSamples
from meshtrain.observe.run_folder import MixtureRecord
from meshtrain.train.loop import LoopPart, StepDone
from meshtrain.train.records import LoopOutputs


class MixtureLog(LoopPart):
    def __init__(self, samples: MixtureSamples | StagedSamples, labels: list[str], progress: Progress,
                 outputs: LoopOutputs) -> None:
        self.samples, self.labels, self.progress, self.outputs = samples, labels, progress, outputs
        self._since = 0

    def at_start(self) -> None:
        self._since = self.progress.data_position

    def rewound(self, step: int) -> None:
        self._since = self.progress.data_position

    def after_step(self, done: StepDone) -> bool:
        if not done.logged:
            return True
        since, until = self._since, self.progress.data_position
        self._since = until
        if self.outputs.on_record is not None:  # counted only where the records are written
            counts = self.samples.source_counts(since, until)
            mixture = (self.samples.mixtures[self.samples.stage_of(max(until - 1, 0))]
                       if isinstance(self.samples, StagedSamples) else self.samples)
            self.outputs.mixture(MixtureRecord(
                step=done.step, samples=[since, until],
                sources={label: counts[k] / max(until - since, 1) for k, label in enumerate(self.labels)},
                stage=self.samples.stage_name(until - 1) if isinstance(self.samples, StagedSamples) else None,
                target={label: mixture.counts[k] / mixture.block for k, label in enumerate(self.labels)},
            ))
        return True
