"""Evicting a straggler's node (``scaling.evict_stragglers``): drain it through Ray, as an autoscaler
does on a spot reclaim, and let the run's preemption path do the rest.

Ray Train's ``PreemptionWatcher`` sees the drain and marks every worker; the ranks save the step
they are at and leave (:mod:`meshtrain.train.preemption`); Ray restarts the elastic group on what
the cluster still schedules, which no longer includes the drained node. Nothing is evicted that
would leave the group below ``scaling.min_workers``, the head node (Ray's GCS) never is, and a node is
drained at most once per group.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from meshtrain import ray_compat
from meshtrain.config import one_line
from meshtrain.observe.run_folder import EvictionRecord, Placement, StragglerRecord

DRAIN_DEADLINE_S = 600  # the node is told it will be stopped; nothing stops it: it just takes no new work


def drain_node(node_id: str, message: str) -> tuple[bool, str]:
    """Ask Ray's GCS to drain a node (the call behind ``ray drain-node``); (accepted, why not)."""
    return ray_compat.drain_node(node_id, message, time.time_ns() // 1_000_000 + DRAIN_DEADLINE_S * 1000)


HEAD = "head"


def node_id_of(ip: str) -> str | None:
    """The live node at ``ip``: its ID, HEAD for the head node (Ray's GCS lives there: never drained), or None."""
    import ray

    for node in ray.nodes():
        if node["Alive"] and node["NodeManagerAddress"] == ip:
            return HEAD if "node:__internal_head__" in node.get("Resources", {}) else str(node["NodeID"])
    return None


class StragglerEviction:
    """Called (on rank 0) with each straggler record: drains the straggler's node when the group can
    go on without it."""

    def __init__(
        self,
        workers: list[Placement],
        min_workers: int,
        emit: Callable[[EvictionRecord], None],
        drain: Callable[[str, str], tuple[bool, str]] = drain_node,
        find_node: Callable[[str], str | None] = node_id_of,
    ) -> None:
        self.workers, self.min_workers, self.emit = workers, min_workers, emit
        self.drain, self.find_node = drain, find_node
        self.drained: set[str] = set()

    def __call__(self, straggler: StragglerRecord) -> None:
        ip = straggler.node
        if ip in self.drained:
            return
        remaining = sum(1 for worker in self.workers if worker["node_ip"] != ip)

        def record(evicted: bool, reason: str, node_id: str | None = None) -> EvictionRecord:
            return EvictionRecord(step=straggler.step, rank=straggler.rank, node=ip, evicted=evicted, reason=reason,
                                  node_id=node_id)

        if remaining < self.min_workers:
            self._say(record(False, f"{remaining} workers would remain, under scaling.min_workers={self.min_workers}"))
            return
        node_id = self.find_node(ip)
        if node_id is None or node_id == HEAD:
            why = "it is the head node, which holds Ray's GCS" if node_id == HEAD else "Ray knows no live node with that address"
            self.drained.add(ip)
            self._say(record(False, why))
            return
        message = f"meshtrain: rank {straggler.rank} computes {straggler.slowdown:.2f}x slower than the others"
        try:
            accepted, rejection = self.drain(node_id, message)
        except Exception as exc:  # an internal Ray API: report, never stop training over it
            accepted, rejection = False, one_line(exc)
        self.drained.add(ip)
        self._say(record(accepted, "drained; the group saves and restarts without it" if accepted
                         else f"drain refused: {rejection}", node_id))

    def _say(self, record: EvictionRecord) -> None:
        self.emit(record)  # the driver prints it in the job log, from metrics.jsonl
