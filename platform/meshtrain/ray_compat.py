"""Every private or internal name of Ray that meshtrain uses, in one place.

Read from Ray 2.60.0, the version ``pyproject.toml`` pins. Ray offers no public call for these: the
notice Ray Train hands a worker without a barrier, the exit Ray's SIGTERM handler calls, draining a
node, the nodes being drained, the autoscaler's report and cluster config, and the Train v2
controller's failure and scaling policies (which meshtrain replaces). ``tests/test_ray_compat.py``
resolves every name in :data:`INTERNAL_NAMES` against the installed Ray and fails, naming what
moved, when Ray is not the version this was read from.

Importing this module imports no Ray: each function imports what it reads when called (a dry run, the
config and the tests of a plain process never start Ray).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

RAY_VERSION_READ = "2.60.0"

# (module, attribute) of every internal name read below; a name with dots is an attribute path.
INTERNAL_NAMES: tuple[tuple[str, str], ...] = (
    ("ray.train.v2._internal.execution.context", "get_train_context"),
    ("ray.train.v2._internal.execution.context", "TrainContext.preemption_context"),
    ("ray._private.worker", "raise_sys_exit_with_custom_error_message"),
    ("ray._private.worker", "global_worker"),
    ("ray._private.state", "state"),
    ("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS"),
    ("ray.experimental.internal_kv", "_internal_kv_get"),
    ("ray.autoscaler.v2.utils", "is_autoscaler_v2"),
    ("ray.core.generated.autoscaler_pb2", "DrainNodeReason"),
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision"),
    ("ray.train.v2._internal.execution.failure_handling.default", "DefaultFailurePolicy"),
    ("ray.train.v2._internal.execution.scaling_policy", "ElasticScalingPolicy"),
    ("ray.train.v2._internal.execution.scaling_policy.scaling_policy", "NoopDecision"),
    ("ray.train.v2._internal.execution.scaling_policy.scaling_policy", "ResizeDecision"),
    ("ray.train.v2._internal.execution.scaling_policy.scaling_policy", "ScalingDecision"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer._initialize_and_run_controller"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer._register_sigint_handler"),
)


def resolve(module: str, attribute: str) -> Any:
    """``module``'s ``attribute`` (a dotted path of attributes, or a dataclass's declared field); ImportError
    or AttributeError when Ray moved it."""
    value: Any = importlib.import_module(module)
    for part in attribute.split("."):
        fields = getattr(value, "__dataclass_fields__", {}) if isinstance(value, type) else {}
        value = fields[part] if part in fields else getattr(value, part)
    return value


# The Ray Train v2 controller's classes that meshtrain subclasses or compares with, imported from here
# (``from meshtrain.ray_compat import ElasticScalingPolicy``): each is read from Ray when first imported.
_TRAIN_V2_CLASSES = {name: module for module, name in INTERNAL_NAMES if module.startswith("ray.train.v2._internal.execution.")
                     and "." not in name}


def __getattr__(name: str) -> Any:
    if name in _TRAIN_V2_CLASSES:
        return resolve(_TRAIN_V2_CLASSES[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train_context() -> Any:
    """This Ray Train worker's context, None outside one (or when this Ray reads it otherwise)."""
    if "ray" not in sys.modules:  # a Ray Train worker has imported Ray; a plain process never needs it
        return None
    try:
        return resolve("ray.train.v2._internal.execution.context", "get_train_context")()
    except Exception:  # not in a Ray Train worker, or another Ray version: signals still work
        return None


def preemption_info(context: Any) -> Any:
    """Ray Train's notice to this worker (PreemptionInfo) from its ``context``, read locally: the public
    ``ray.train.get_preemption_info()`` is a barrier through Ray on every call."""
    try:
        return context.preemption_context.preemption_info if context is not None else None
    except AttributeError:
        return None


def train_context_logger() -> str:
    """The logger Ray Train's worker context logs every report to (named after its module's file)."""
    return str(resolve("ray.train.v2._internal.execution.context", "__file__"))


def route_sigterm_exit(on_sigterm: Callable[[], None]) -> Callable[[], None] | None:
    """Make the exit Ray's SIGTERM handler calls (in a worker's main thread, looked up by name at every
    signal) call ``on_sigterm`` instead; every other exit Ray asks for still happens. Returns the undo,
    or None when this Ray has no such function."""
    try:
        ray_worker: Any = importlib.import_module("ray._private.worker")  # its exit function is replaced below
        ray_exit = ray_worker.raise_sys_exit_with_custom_error_message
    except (ImportError, AttributeError):
        return None

    def record_instead(message: Any = "", *args: Any, **kwargs: Any) -> None:
        if "SIGTERM" in str(message):
            on_sigterm()
            return
        ray_exit(message, *args, **kwargs)

    ray_worker.raise_sys_exit_with_custom_error_message = record_instead

    def undo() -> None:
        if ray_worker.raise_sys_exit_with_custom_error_message is record_instead:
            ray_worker.raise_sys_exit_with_custom_error_message = ray_exit

    return undo


def drain_node(node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask Ray's GCS to drain a node as a preemption (the call behind ``ray drain-node``); (accepted, why not)."""
    gcs = resolve("ray._private.worker", "global_worker").gcs_client
    reason = resolve("ray.core.generated.autoscaler_pb2", "DrainNodeReason").Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, rejection = gcs.drain_node(node_id, reason, message, deadline_ms)
    return bool(accepted), str(rejection or "")


def draining_nodes() -> set[str]:
    """The IDs (hex) of the nodes Ray is draining."""
    return set(resolve("ray._private.state", "state").get_draining_nodes())


def cluster_config() -> Any:
    """The cluster config an autoscaler reported to the GCS (node groups, limits), None when none did."""
    return resolve("ray._private.state", "state").get_cluster_config()


def autoscaler_status() -> bytes | None:
    """The autoscaler v1 monitor's status record (what ``ray status`` prints), None until it wrote one."""
    key = resolve("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS")
    status: bytes | None = resolve("ray.experimental.internal_kv", "_internal_kv_get")(key)
    return status


def is_autoscaler_v2() -> bool:
    return bool(resolve("ray.autoscaler.v2.utils", "is_autoscaler_v2")(fetch_from_server=True))
