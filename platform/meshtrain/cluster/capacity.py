"""Can the Ray cluster ever hold the worker group? Checked on the driver before Ray Train starts.

Ray Train 2.60 waits 60 s for the worker group's placement group, then logs two tracebacks and
tries again, forever: a request no node can hold never fails. Here the workers are packed onto
each node's total resources (not what is free now: other jobs end) and onto the nodes an
autoscaler may add, so a request that can never fit fails with one line, and one that has to
wait for the cluster to grow says so once.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain import ray_compat
from meshtrain.config import ConfigError, ScalingConfig

# Ray counts resources in fixed point with four decimals (ray/src/ray/common/scheduling/fixed_point.h).
RESOURCE_UNIT = 10_000
# ray/_common/utils.py RESOURCE_CONSTRAINT_PREFIX: Ray Train turns ScalingConfig.accelerator_type
# into this resource, 0.001 per worker (ray/air/config.py, ScalingConfig._resources_per_worker_not_none).
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001
NODE_GROUP_LABEL = "ray.io/node-group"  # set from RAY_NODE_TYPE_NAME on nodes an autoscaler starts
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
WAITING_START_TIMEOUT_S = 3600
AUTOSCALER_REPORT_WAIT_S = 20.0


@dataclass(frozen=True)
class NodeGroup:
    """A node type an autoscaler may add: one node's resources, and how many more it may start
    (None: no limit)."""

    name: str
    resources: Mapping[str, float]
    more: int | None


@dataclass(frozen=True)
class Autoscaler:
    """What the driver knows of the cluster's autoscaler. ``groups`` is None when it runs but does
    not publish which nodes it may add; ``limits`` caps the whole cluster's resources."""

    groups: tuple[NodeGroup, ...] | None
    limits: Mapping[str, float]


def worker_resources(scaling: ScalingConfig) -> dict[str, float]:
    """What meshtrain asks Ray Train to reserve for each worker."""
    resources = {"CPU": scaling.cpus_per_worker}
    if scaling.use_gpu:
        resources["GPU"] = 1
    return resources


def worker_bundle(scaling: ScalingConfig) -> dict[str, float]:
    """One worker's placement-group bundle, as Ray Train builds it from worker_resources."""
    bundle = worker_resources(scaling)
    if scaling.accelerator_type:
        bundle[ACCELERATOR_PREFIX + scaling.accelerator_type] = ACCELERATOR_SHARE
    return bundle


def _units(amount: float) -> int:
    return round(amount * RESOURCE_UNIT)


def _per_worker_units(amount: float) -> int:
    return max(_units(amount), 1)  # a positive amount below Ray's precision still takes a unit here


def workers_per_node(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    return min(_units(node.get(name, 0)) // _per_worker_units(amount) for name, amount in bundle.items())


def max_workers(
    nodes: Sequence[Mapping[str, float]],
    bundle: Mapping[str, float],
    strategy: str,
    limits: Mapping[str, float] | None = None,
) -> int:
    """How many bundles the nodes can hold at once under a Ray placement strategy (PACK and
    SPREAD are soft: they fill every node), within the cluster-wide ``limits``."""
    fits = [workers_per_node(node, bundle) for node in nodes]
    if strategy == "STRICT_PACK":
        held = max(fits, default=0)
    elif strategy == "STRICT_SPREAD":
        held = sum(1 for fit in fits if fit > 0)
    else:
        held = sum(fits)
    for name, limit in (limits or {}).items():
        if name in bundle:
            held = min(held, _units(limit) // _per_worker_units(bundle[name]))
    return held


def grown_nodes(
    nodes: Sequence[Mapping[str, float]], groups: Sequence[NodeGroup], wanted: int
) -> list[Mapping[str, float]]:
    """The nodes plus every node the groups may add. No request needs more new nodes of a type than
    it has workers, so an unlimited group (and a large limit) counts as ``wanted`` nodes."""
    grown = list(nodes)
    for group in groups:
        grown += [group.resources] * (wanted if group.more is None else min(group.more, wanted))
    return grown


def _plural(count: float, noun: str) -> str:
    return f"{count:g} {noun}" + ("" if count == 1 else "s")


def _amounts(scaling: ScalingConfig, nodes: Sequence[Mapping[str, float]]) -> str:
    """The nodes' resources that a worker asks for, e.g. "16 CPUs and 2 GPUs"."""
    text = _plural(sum(node.get("CPU", 0) for node in nodes), "CPU")
    if scaling.use_gpu:
        text += f" and {_plural(sum(node.get('GPU', 0) for node in nodes), 'GPU')}"
    return text


def _describe(scaling: ScalingConfig, nodes: Sequence[Mapping[str, float]]) -> str:
    text = f"{_amounts(scaling, nodes)} on {_plural(len(nodes), 'node')}"
    if scaling.accelerator_type:
        accelerator = ACCELERATOR_PREFIX + scaling.accelerator_type
        typed = sum(1 for node in nodes if node.get(accelerator, 0) > 0)
        text += f" ({typed} of them {scaling.accelerator_type})"
    return text


def _describe_groups(scaling: ScalingConfig, groups: Sequence[NodeGroup]) -> str:
    if not groups:
        return "its autoscaler may add no nodes"
    described = [
        f"{'any number of' if group.more is None else f'{group.more} more'} '{group.name}' nodes "
        f"({_amounts(scaling, [group.resources])} each)"
        for group in groups
    ]
    return "its autoscaler may add " + ", ".join(described)


def _needs(scaling: ScalingConfig) -> str:
    count = scaling.required_workers
    text = (
        f"{scaling.required_setting}={count} needs {_plural(count * scaling.cpus_per_worker, 'CPU')} "
        f"({scaling.cpus_per_worker:g} per worker, scaling.cpus_per_worker)"
    )
    if scaling.use_gpu:
        text += f" and {_plural(count, 'GPU')} (1 per worker, scaling.use_gpu)"
    if scaling.accelerator_type:
        text += f" on {scaling.accelerator_type} nodes (scaling.accelerator_type)"
    if scaling.placement_strategy == "STRICT_PACK":
        text += ", all on one node (scaling.placement_strategy=STRICT_PACK)"
    elif scaling.placement_strategy == "STRICT_SPREAD":
        text += ", one per node (scaling.placement_strategy=STRICT_SPREAD)"
    return text


def _largest_cpus_per_worker(
    scaling: ScalingConfig, nodes: Sequence[Mapping[str, float]], limits: Mapping[str, float]
) -> float | None:
    """The largest scaling.cpus_per_worker at which the workers fit, when fewer CPUs are enough.
    Called only when scaling.cpus_per_worker itself does not fit."""
    bundle = worker_bundle(scaling)

    def fits(units: int) -> bool:
        cpus = {**bundle, "CPU": units / RESOURCE_UNIT}
        return max_workers(nodes, cpus, scaling.placement_strategy, limits) >= scaling.required_workers

    if not fits(1):
        return None
    low, high = 1, _units(scaling.cpus_per_worker)  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low / RESOURCE_UNIT


def _fixes(
    scaling: ScalingConfig, nodes: Sequence[Mapping[str, float]], limits: Mapping[str, float], held: int
) -> str:
    def fit(bundle: Mapping[str, float], strategy: str) -> bool:
        return max_workers(nodes, bundle, strategy, limits) >= scaling.required_workers

    lower = [f"{scaling.required_setting} to {held}"] if held > 0 else []
    cpus = _largest_cpus_per_worker(scaling, nodes, limits)
    if cpus is not None:
        lower.append(f"scaling.cpus_per_worker to {cpus:g}")
    fixes = ["lower " + " or ".join(lower)] if lower else []
    if scaling.placement_strategy.startswith("STRICT_") and fit(worker_bundle(scaling), "PACK"):
        fixes.append("use scaling.placement_strategy=PACK")
    if scaling.accelerator_type and fit(worker_resources(scaling), scaling.placement_strategy):
        fixes.append("unset scaling.accelerator_type")
    return " or ".join(fixes) or "add nodes that have these resources"


def check(
    scaling: ScalingConfig, nodes: Sequence[Mapping[str, float]], autoscaler: Autoscaler | None
) -> str | None:
    """None when the nodes (the total resources of each alive node) hold the workers now; the line
    to print when they will once the autoscaler adds nodes, or may; ConfigError when they never
    can. ``autoscaler`` is None for a cluster without one."""
    bundle = worker_bundle(scaling)
    wanted, strategy = scaling.required_workers, scaling.placement_strategy
    now = max_workers(nodes, bundle, strategy)
    if now >= wanted:
        return None
    waiting = (
        f"[meshtrain] waiting for the cluster to provide {wanted} workers ({now} fit now): {_needs(scaling)}"
    )
    if autoscaler is None:
        groups: Sequence[NodeGroup] = ()
        limits: Mapping[str, float] = {}
        growth = "no autoscaler"
    elif autoscaler.groups is None:
        return (
            f"{waiting}; an autoscaler runs but does not publish which nodes it may add, so Ray Train "
            "waits for them (stop with Ctrl-C if it never can)"
        )
    else:
        groups, limits = autoscaler.groups, autoscaler.limits
        growth = _describe_groups(scaling, groups)
    grown = grown_nodes(nodes, groups, wanted)
    ever = max_workers(grown, bundle, strategy, limits)
    if ever < wanted:
        raise ConfigError(
            f"{_needs(scaling)} but this Ray cluster has {_describe(scaling, nodes)} and {growth}; "
            f"{_fixes(scaling, grown, limits, ever)}"
        )
    return f"{waiting}; {growth}"


def _v1_report(deadline: float) -> dict[str, Any] | None:
    """The autoscaler v1 monitor's report (what ``ray status`` prints), once it has one."""
    while True:
        status = ray_compat.autoscaler_status()
        report = json.loads(status).get("autoscaler_report") if status else None
        if report is not None or time.monotonic() > deadline:
            return report
        time.sleep(1)


def read_autoscaler(nodes: Sequence[Mapping[str, Any]]) -> Autoscaler | None:
    """What the connected Ray 2.60 cluster tells a driver about its autoscaler (``nodes`` as in
    ``ray.nodes()``); None when it has none that adds nodes."""
    # Written by an autoscaler through GcsClient.report_cluster_config; Ray Train 2.60's own
    # resource check reads the same record. Ray's open-source autoscalers do not write it.
    config = ray_compat.cluster_config()
    if config is not None and config.node_group_configs:
        present = Counter((node.get("Labels") or {}).get(NODE_GROUP_LABEL) for node in nodes)
        groups = tuple(
            NodeGroup(
                group.name,
                dict(group.resources),
                None if group.max_count == -1 else max(group.max_count - present[group.name], 0),
            )
            for group in config.node_group_configs
        )
        return Autoscaler(groups, dict(config.max_resources))
    # Autoscaler v2 (`ray up` starts it since Ray 2.50; KubeRay when enabled) tells drivers nothing
    # of its node types, and its read-only mode (a hand-started head with it enabled) looks the same.
    if ray_compat.is_autoscaler_v2():
        return Autoscaler(None, {})
    # Autoscaler v1's monitor runs on every head. Without a cluster config it is read-only and
    # names each node's type after the node id it is keyed by.
    report = _v1_report(time.monotonic() + AUTOSCALER_REPORT_WAIT_S)
    mapping = (report or {}).get("node_type_mapping") or {}
    if mapping and all(node_type == f"node_{key}" for key, node_type in mapping.items()):
        return None
    return Autoscaler(None, {})


def check_capacity(scaling: ScalingConfig, local_ray: bool) -> None:
    """Raise ConfigError when the connected cluster can never hold the worker group (``local_ray``:
    this driver started it, without an autoscaler). When it must grow first, print one line, and
    make Ray Train retry the start hourly rather than every minute (each retry logs two tracebacks)
    unless the user set that timeout."""
    import ray

    nodes = [node for node in ray.nodes() if node["Alive"]]
    totals = [node["Resources"] for node in nodes]
    if max_workers(totals, worker_bundle(scaling), scaling.placement_strategy) >= scaling.required_workers:
        return  # the autoscaler is read only when needed: that may wait for its first report
    line = check(scaling, totals, None if local_ray else read_autoscaler(nodes))
    if line is not None:
        os.environ.setdefault(START_TIMEOUT_ENV, str(WAITING_START_TIMEOUT_S))
        print(line, flush=True)
