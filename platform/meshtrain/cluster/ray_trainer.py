"""Ray Train's TorchTrainer with meshtrain's policies handed to its controller.

Ray builds its controller's scaling and failure policies from the trainer's configs and has no public
hook to replace them, so :func:`trainer_class` overrides the one method that passes them on: an
elastic run gets :class:`~meshtrain.cluster.elastic_policy.TrainableSizesPolicy`, and every run gets
:class:`StopOnPermanentFailure`; and Ctrl-C is left to the launcher,
which has the workers save first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy

from meshtrain.cluster.elastic_policy import TrainableSizesPolicy
from meshtrain.cluster.failures import root_failure

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
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    class MeshtrainTorchTrainer(TorchTrainer):
        def __init__(self, *args: Any, elastic_policy: Callable[[Any], TrainableSizesPolicy] | None = None,
                     **kwargs: Any) -> None:
            self._elastic_policy = elastic_policy
            super().__init__(*args, **kwargs)

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            if self._elastic_policy is not None and isinstance(controller_init_kwargs.get("scaling_policy"), ElasticScalingPolicy):
                controller_init_kwargs["scaling_policy"] = self._elastic_policy(self.scaling_config)
            controller_init_kwargs["failure_policy"] = StopOnPermanentFailure(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

        def _register_sigint_handler(self, controller: Any) -> None:
            """Keep the driver's own handler (:mod:`meshtrain.cluster.interrupts`): Ray's would abort
            the workers at once, losing every step since the last checkpoint."""

    return MeshtrainTorchTrainer
