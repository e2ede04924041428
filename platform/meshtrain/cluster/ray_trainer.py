"""Ray Train's TorchTrainer with meshtrain's policies handed to its controller.

meshtrain runs on Ray Train v2 (Ray's default; ``RAY_TRAIN_V2_ENABLED=0`` is not supported), so the
trainer and its configs are imported from ``ray.train.v2`` directly: ``ray.train``'s own names switch
between v1 and v2 at import time, which a type checker cannot follow. Ray builds its controller's scaling
and failure policies from the trainer's configs and has no public hook to replace them, so
:func:`trainer_class` overrides the one method that passes them on: an
elastic run gets :class:`~meshtrain.cluster.elastic_policy.TrainableSizesPolicy`, and every run gets
:class:`StopOnPermanentFailure`; and Ctrl-C is left to the launcher,
which has the workers save first.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from meshtrain.cluster.capacity import worker_resources
from meshtrain.cluster.elastic_policy import TrainableSizesPolicy
from meshtrain.cluster.failures import root_failure
from meshtrain.cluster.worker_env import worker_env
from meshtrain.config import ConfigError, one_line, replica_group_name
from meshtrain.distributed.replicas import ReplicaPlacement
from meshtrain.ray_compat import DefaultFailurePolicy, ElasticScalingPolicy, FailureDecision
from meshtrain.train.plan import WorkerPlan

logger = logging.getLogger(__name__)


class StopOnPermanentFailure(DefaultFailurePolicy):
    """Ray's default failure policy, except that a worker group failing for a reason a restart cannot
    fix (:func:`meshtrain.cluster.failures.is_permanent`) ends the run at once instead of using
    ``run.max_failures`` restarts."""

    def make_decision(self, training_failed_error: Any) -> FailureDecision:
        failure = root_failure(training_failed_error)
        if failure.permanent:
            logger.info("[meshtrain] not restarting the worker group: %s (a restart cannot fix this)", failure.describe())
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def trainer_class() -> type:
    """TorchTrainer, handing Ray's controller meshtrain's failure policy and, for elastic runs, its
    scaling policy."""
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    class MeshtrainTorchTrainer(TorchTrainer):
        def __init__(self, *args: Any, elastic_policy: Callable[[Any], TrainableSizesPolicy] | None = None,
                     **kwargs: Any) -> None:
            self._elastic_policy = elastic_policy
            super().__init__(*args, **kwargs)

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            if self._elastic_policy is not None and isinstance(controller_init_kwargs.get("scaling_policy"), ElasticScalingPolicy):
                controller_init_kwargs["scaling_policy"] = self._elastic_policy(self.scaling_config)
            failure_config: Any = self.run_config.failure_config  # typed as v1's config by Ray's v2 trainer
            controller_init_kwargs["failure_policy"] = StopOnPermanentFailure(failure_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

        def _register_sigint_handler(self, controller: Any) -> None:
            """Keep the driver's own handler (:mod:`meshtrain.cluster.interrupts`): Ray's would abort
            the workers at once, losing every step since the last checkpoint."""

    return MeshtrainTorchTrainer


def load_ray_callbacks(specs: list[str]) -> list[Any]:
    """Instances of the ``module:Class`` Ray Train callbacks named in metrics.ray_callbacks."""
    import importlib

    from ray.train import UserCallback

    callbacks = []
    for spec in specs:
        module_name, class_name = spec.split(":")
        try:
            callback_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"metrics.ray_callbacks: cannot import {spec!r} ({one_line(exc)}); install its package "
                "on every node or fix the name"
            ) from None
        if not (isinstance(callback_class, type) and issubclass(callback_class, UserCallback)):
            raise ConfigError(f"metrics.ray_callbacks: {spec!r} is not a ray.train.UserCallback subclass")
        callbacks.append(callback_class())
    return callbacks


def build_trainer(plan: WorkerPlan, replica: ReplicaPlacement | None = None) -> Any:
    """The run's Ray Train trainer; with ``replica`` (fault_tolerance.mode=replica), one replica group's."""
    from ray.train.torch import TorchConfig
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig

    from meshtrain.cluster.worker import train_loop_per_worker

    paths, scaling = plan.paths, plan.scaling
    if not scaling.use_gpu:
        backend = "gloo"
    elif plan.parallel.cpu_offload:
        backend = "cpu:gloo,cuda:nccl"  # offloaded gradients are clipped with collectives on host memory
    else:
        backend = "nccl"
    elastic_policy = None
    if scaling.elastic:
        # Only trainable sizes; a resize first has the group save where it is (without checkpoints the
        # ranks answer at once).
        elastic_policy = functools.partial(
            TrainableSizesPolicy, sizes=list(plan.group_sizes), grow_save_timeout_s=scaling.grow_save_timeout_s
        )
    return trainer_class()(
        train_loop_per_worker,
        elastic_policy=elastic_policy,
        # The resolved objects themselves: re-validating on workers would re-check data paths that exist
        # only where the driver runs; the data plan holds store locations, workers map the shards themselves.
        train_loop_config={"plan": plan, "replica": replica},
        torch_config=TorchConfig(backend=backend, timeout_s=scaling.timeout_s),
        scaling_config=ScalingConfig(
            # Elastic: Ray starts the group on as many workers as the cluster holds in this range,
            # and restarts it larger when a check every resize_check_interval_s finds more.
            num_workers=(scaling.required_workers, scaling.num_workers) if scaling.elastic
            else scaling.num_workers // replica.replicas if replica is not None else scaling.num_workers,
            elastic_resize_monitor_interval_s=scaling.resize_check_interval_s,
            use_gpu=scaling.use_gpu,
            resources_per_worker=worker_resources(scaling),
            placement_strategy=scaling.placement_strategy,
            accelerator_type=scaling.accelerator_type,
        ),
        run_config=RunConfig(
            name=paths.name if replica is None else replica_group_name(paths.name, replica.index),
            storage_path=str(paths.storage_path),
            failure_config=FailureConfig(max_failures=plan.run.max_failures),
            callbacks=load_ray_callbacks(plan.metrics.ray_callbacks),
            # Read by torch when the worker starts its process group and CUDA, before our code runs.
            worker_runtime_env={"env_vars": worker_env(plan.run, plan.scaling, plan.memory, os.environ)},
        ),
    )
