"""Ray's elastic scaling, made to offer only sizes the run can train on and to resize without losing work.

Ray Train 2.60's ``ElasticScalingPolicy`` sizes a group by the workers the free resources hold,
anything from ``min_workers`` to ``max_workers``. A meshtrain run trains only on whole shard groups
that divide the global batch (``MeshtrainConfig.elastic_sizes``): offered 15 GPUs it could train on
8, but a group of 15 fails its start, Ray counts a failure and offers 15 again. And when capacity
returns, Ray restarts a healthy group larger straight away, losing every step since its last
scheduled checkpoint.

:class:`TrainableSizesPolicy` subclasses Ray's policy (the controller runs it; Ray has no public
hook for this, so :mod:`meshtrain.cluster.ray_trainer` hands it over where Ray builds its own):

* every count of possible workers leaves out draining and dead nodes (Ray counts them, and a group
  sized for them times out placing, again and again, or restarts for nothing) and is rounded down to the largest trainable size (none:
  below ``min_workers``, so Ray waits for capacity as it does below the minimum), so no size Ray
  offers ends a run;
* a resize of a running group (a grow when capacity returns, or a shrink off a node that is being
  drained) is held back until the group has saved where it is: the policy marks every worker (through
  the same ``mark_preempt`` call Ray's own ``PreemptionWatcher`` uses, with no node named: a resize,
  not a preemption), the ranks agree at the next step boundary, save that step, and wait; the policy
  resizes once that checkpoint is committed (or after ``grow_save_timeout_s``, if it never is), so
  the new group resumes at the step the old one stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import (
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2.api.preemption import PreemptionInfo

from meshtrain.checkpoint.storage import CheckpointStorage


@dataclass(frozen=True)
class NewestCommittedStep:
    """The step of a run's newest committed checkpoint (None: none yet); picklable, for Ray's controller."""

    root: str
    storage_options: dict[str, Any]

    def __call__(self) -> int | None:
        committed = CheckpointStorage(self.root, self.storage_options).committed()
        return committed[0].step if committed else None


# A notice that names no preempted node: save where you are, the group is about to be resized.
RESIZE_REQUEST = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={})


def unusable_nodes() -> set[str]:
    """The IDs (hex) of the nodes that take no new workers: being drained, or dead (a drained node
    leaves once idle, before the resources Ray Train last saw are refreshed); empty when unknown."""
    try:
        import ray

        dead = {node["NodeID"] for node in ray.nodes() if not node["Alive"]}
        return dead | set(ray._private.state.state.get_draining_nodes())
    except Exception:  # not connected to Ray (unit tests), or another Ray version
        return set()


def is_resize_request(info: Any) -> bool:
    return info is not None and not getattr(info, "preempted_node_to_ranks", None)


class TrainableSizesPolicy(ElasticScalingPolicy):
    def __init__(
        self,
        scaling_config: Any,
        sizes: list[int],
        newest_checkpoint_step: Callable[[], int | None],
        grow_save_timeout_s: float,
    ) -> None:
        super().__init__(scaling_config)
        self.sizes = sorted(sizes)
        self.newest_checkpoint_step = newest_checkpoint_step
        self.grow_save_timeout_s = grow_save_timeout_s
        self._pending_grow: tuple[float, int | None, ResizeDecision] | None = None

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        # Ray's count includes draining nodes (a spot reclaim, an evicted straggler) and, for a while,
        # nodes that just left: a group sized for them would time out placing, or restart for nothing.
        unusable = unusable_nodes()
        usable = {node: resources for node, resources in reserved_resources.items() if node not in unusable}
        possible = super()._count_possible_workers(usable)
        return max((size for size in self.sizes if size <= possible), default=0)

    def make_decision_for_running_worker_group(self, worker_group_state: Any, worker_group_status: Any) -> ScalingDecision:
        if self._pending_grow is not None:
            asked_at, newest_before, decision = self._pending_grow
            newest = self.newest_checkpoint_step()
            saved = newest is not None and (newest_before is None or newest > newest_before)
            if saved or time.monotonic() - asked_at > self.grow_save_timeout_s:
                self._pending_grow = None
                return decision
            return NoopDecision()
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers != worker_group_state.num_workers:
            self._pending_grow = (time.monotonic(), self.newest_checkpoint_step(), decision)
            for worker in worker_group_state.workers:
                worker.actor.mark_preempt.remote(RESIZE_REQUEST)
            return NoopDecision()
        return decision

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        self._pending_grow = None  # the group it was for is gone
        return super().make_decision_for_non_running_worker_group()
