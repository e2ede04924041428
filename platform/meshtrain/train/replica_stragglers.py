"""Stragglers across replica groups (``fault_tolerance.mode=replica``): a group that computes slower
than the others holds every live group in each step's cross-replica sum, as a slow rank holds its own
group's collectives.

At each logged step, the first worker of every group posts its group's transformer-block compute per
step (its slowest worker's: the group steps at that pace; ``train/stragglers.py`` times it, collective
waits excluded) on the run's board and reads the latest each live group posted. Groups are compared as
ranks are inside a group: a group at or above ``metrics.straggler_factor`` times the median of the
others for ``metrics.straggler_patience`` logged steps in a row is reported once (a
``replica_straggler`` record and a job-log line) until it recovers. Its peers keep waiting for it: it is
not hung (the step pace, and so the deadline, follows it).
"""

from __future__ import annotations

import statistics

from meshtrain.distributed.replicas import ReplicaPeers
from meshtrain.observe.run_folder import ReplicaStragglerRecord
from meshtrain.train.records import LoopOutputs
from meshtrain.train.stragglers import Streaks, slowdowns


class ReplicaStragglers:
    def __init__(self, peers: ReplicaPeers, factor: float, patience: int, outputs: LoopOutputs) -> None:
        self.peers, self.outputs = peers, outputs
        self.streaks = Streaks(factor, patience)

    def __call__(self, step: int, seconds: float) -> None:
        """This group's block compute per step at logged step ``step``."""
        compute = self.peers.compare_compute(seconds)
        if len(compute) < 2:
            return
        groups = sorted(compute)
        ratios = dict(zip(groups, slowdowns([compute[group] for group in groups])))
        for group in self.streaks.update(ratios):
            self.outputs.emit(ReplicaStragglerRecord(
                step=step, replica=group, slowdown=ratios[group], compute_s=compute[group],
                median_others_s=statistics.median(compute[other] for other in groups if other != group),
                logged_steps=self.streaks.runs[group],
            ))
