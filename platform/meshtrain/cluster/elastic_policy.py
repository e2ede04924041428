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
  drained) is held back until the group has saved where it is: the policy asks every worker
  (:func:`meshtrain.train.preemption.request_resize`, run in the worker's process through Ray's
  ``execute``), the ranks agree at the next step boundary, save that step, answer and wait; the policy
  resizes once every worker has answered (or after ``grow_save_timeout_s``, if they never do), so the
  new group resumes at the step the old one stopped. Ray's own preemption mark is not used for the
  request: the controller takes any mark it polls as a preemption and stops resizing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import ray

from meshtrain import ray_compat
from meshtrain.ray_compat import ElasticScalingPolicy, NoopDecision, ResizeDecision, ScalingDecision
from meshtrain.train.preemption import request_resize, resize_answer


def unusable_nodes() -> set[str]:
    """The IDs (hex) of the nodes that take no new workers: being drained, or dead (a drained node
    leaves once idle, before the resources Ray Train last saw are refreshed); empty when unknown."""
    try:
        import ray

        dead = {node["NodeID"] for node in ray.nodes() if not node["Alive"]}
        return dead | ray_compat.draining_nodes()
    except Exception:  # not connected to Ray (unit tests), or another Ray version
        return set()


class PendingResize:
    """A resize held back until every worker of the group has saved where it is."""

    def __init__(self, decision: ResizeDecision, actors: list[Any]) -> None:
        self.decision, self.actors = decision, actors
        self.token = uuid.uuid4().hex
        self.asked_at = time.monotonic()
        for actor in actors:
            actor.execute.remote(request_resize, self.token)
        self._answers: list[Any] | None = None

    def answered(self) -> bool:
        """Whether every worker has answered (never blocks: the controller's loop runs this)."""
        if self._answers is None:
            self._answers = [actor.execute.remote(resize_answer, self.token) for actor in self.actors]
        answers = ready_values(self._answers)
        if answers is None:
            return False
        self._answers = None  # ask again next time unless every worker has answered
        return all(answer is not None for answer in answers)


def ready_values(refs: list[Any]) -> list[Any] | None:
    """The values of ``refs`` if all are ready, else None; a dead worker's counts as no answer (its group is
    failing, and the controller's failure handling ends the pending resize)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if len(ready) < len(refs):
        return None
    try:
        return ray.get(refs)
    except ray.exceptions.RayError:
        return [None]


class TrainableSizesPolicy(ElasticScalingPolicy):
    def __init__(self, scaling_config: Any, sizes: list[int], grow_save_timeout_s: float) -> None:
        super().__init__(scaling_config)
        self.sizes = sorted(sizes)
        self.grow_save_timeout_s = grow_save_timeout_s
        self._pending: PendingResize | None = None

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        # Ray's count includes draining nodes (a spot reclaim, an evicted straggler) and, for a while,
        # nodes that just left: a group sized for them would time out placing, or restart for nothing.
        unusable = unusable_nodes()
        usable = {node: resources for node, resources in reserved_resources.items() if node not in unusable}
        possible = super()._count_possible_workers(usable)
        return max((size for size in self.sizes if size <= possible), default=0)

    def make_decision_for_running_worker_group(self, worker_group_state: Any, worker_group_status: Any) -> ScalingDecision:
        if self._pending is not None:
            pending = self._pending
            if pending.answered() or time.monotonic() - pending.asked_at > self.grow_save_timeout_s:
                self._pending = None
                return pending.decision
            return NoopDecision()
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers != worker_group_state.num_workers:
            self._pending = PendingResize(decision, [worker.actor for worker in worker_group_state.workers])
            return NoopDecision()
        return decision

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        self._pending = None  # the group it was for is gone
        return super().make_decision_for_non_running_worker_group()
