"""fault_tolerance.mode=replica on Ray: one Ray Train run per replica group, under one lighthouse that
the driver keeps for the run's life.

Each replica group is its own ``TorchTrainer`` (its own placement group, rendezvous and
``FailureConfig``), so Ray restarts only the group that lost a worker; the restarted group joins the
others by receiving a live peer's state. The lighthouse lives in the driver: the driver's end is the
job's end anyway, and a relaunch resumes from the newest checkpoint as in restart mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from meshtrain.checkpoint.storage import newest_committed
from meshtrain.distributed.replicas import LighthouseServer, ReplicaPlacement
from meshtrain.train.plan import WorkerPlan


def fit_replica_groups(plan: WorkerPlan, build: Callable[[WorkerPlan, ReplicaPlacement], Any]) -> None:
    """Train with every replica group; return once one group trained to the end, or raise the first
    group's failure once every group has failed (Ray restarts each up to run.max_failures times).

    ``build`` makes a group's trainer. Groups still restarting when the run ends (a replacement
    waiting for capacity) are left to Ray, which ends them with the job; those still stepping finish
    the same last step and are waited for, up to fault_tolerance.quorum_timeout_s."""
    replicas = plan.replica_groups
    assert replicas is not None, "fault_tolerance.mode=replica resolves the replica groups"
    lighthouse = LighthouseServer(plan.fault_tolerance, replicas)
    node = ray.util.get_node_ip_address()
    address, board = lighthouse.address_on(node), lighthouse.board_on(node)
    _, newest = newest_committed(plan.checkpoint, plan.run)
    resume_step = newest.step if newest is not None else 0
    outcomes: dict[int, BaseException | None] = {}
    changed = threading.Condition()

    def fit(index: int) -> None:
        error: BaseException | None = None
        try:
            build(plan, ReplicaPlacement(index, replicas, address, resume_step=resume_step, board=board)).fit()
        except BaseException as exc:  # handed to the driver's thread
            error = exc
        with changed:
            outcomes[index] = error
            changed.notify_all()

    threads = [threading.Thread(target=fit, args=(index,), name=f"meshtrain-replica-{index}", daemon=True)
               for index in range(replicas)]
    try:
        for thread in threads:
            thread.start()
        with changed:
            while not any(error is None for error in outcomes.values()):
                if len(outcomes) == replicas:
                    first_failure = next(error for error in outcomes.values() if error is not None)
                    raise first_failure
                changed.wait()
        deadline = time.monotonic() + plan.fault_tolerance.quorum_timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        lighthouse.close()
