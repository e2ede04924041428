"""Stragglers across replica groups (``fault_tolerance.mode=replica``): a group that computes slower
than the others holds every live group in each step's cross-replica sum, as a slow rank holds its own
group's collectives.

At each logged step, the first worker of every group posts its group's transformer-block compute per
step (its slowest worker's: the group steps at that pace; ``train/stragglers.py`` times it, collective
waits excluded) and that worker's node on the run's board, and reads the latest each live group posted.
Groups are compared as ranks are inside a group: a group at or above ``metrics.straggler_factor`` times
the median of the others for ``metrics.straggler_patience`` logged steps in a row is reported once (a
``replica_straggler`` record and a job-log line, written by the first of the other live groups) until it
recovers. It is not hung: the step pace, and so the deadline, follows it. With
``scaling.evict_stragglers``, that reporting group ends it through the lighthouse as it would a hung one
(once per group index in a launch, never below ``fault_tolerance.min_replicas`` live groups); Ray
replaces it, and the replacement heals from a peer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from meshtrain.distributed.replicas import ReplicaPeers
from meshtrain.observe.run_folder import ReplicaStragglerRecord
from meshtrain.train.records import LoopOutputs
from meshtrain.train.stragglers import Streaks, slowdowns


class ReplicaStragglers:
    """``evict``: ends a slow peer group, or None (report only)."""

    def __init__(self, peers: ReplicaPeers, factor: float, patience: int, outputs: LoopOutputs,
                 evict: ReplicaEviction | None = None) -> None:
        self.peers, self.outputs, self.evict = peers, outputs, evict
        self.streaks = Streaks(factor, patience)

    def __call__(self, step: int, seconds: float, node: str) -> None:
        """This group's block compute per step at logged step ``step``, and the node of its slowest worker."""
        posted = self.peers.compare_compute(seconds, node)
        if len(posted) < 2:
            return
        groups = sorted(posted)
        ratios = dict(zip(groups, slowdowns([posted[group].seconds for group in groups])))
        for group in self.streaks.update(ratios):
            others = [other for other in groups if other != group]
            if min(others) != self.peers.placement.index:  # the first of the other groups reports (and evicts)
                continue
            replaced = self.evict is not None and self.evict(group, step, len(groups))
            self.outputs.emit(ReplicaStragglerRecord(
                step=step, replica=group, slowdown=ratios[group], compute_s=posted[group].seconds,
                median_others_s=statistics.median(posted[other].seconds for other in others),
                logged_steps=self.streaks.runs[group], node=posted[group].node, replaced=replaced,
            ), any_replica=True)


class ReplicaEviction:
    """Ends a slow replica group when the run can go on without it (``scaling.evict_stragglers``):
    ``end``, ``ReplicaSteps.end_slow``."""

    def __init__(self, end: Callable[[int, int], bool], min_replicas: int) -> None:
        self.end, self.min_replicas = end, min_replicas

    def __call__(self, group: int, step: int, live: int) -> bool:
        return live - 1 >= self.min_replicas and self.end(group, step)
