"""The configuration's sections, one-line errors and redaction. The whole tree (``config.schema``'s
``MeshtrainConfig``) and its loading (``config.loading``) are imported from their modules: only the
driver's layers (``cli``, ``cluster``) see the whole config; a contract keeps the layers below on the
sections (``train.plan.WorkerPlan`` carries them to the workers).

Pure by design: nothing here imports the rest of meshtrain, torch or Ray, or looks at files, stores
or clusters beyond the YAML it is given; ``meshtrain.cluster.preflight`` checks the config against
the world. A test keeps that true.
"""

from meshtrain.config.data import (
    OVERALL_LABEL,
    DataConfig,
    SourceConfig,
    StageConfig,
    ValidationConfig,
    source_labels,
)
from meshtrain.config.errors import (
    ConfigError,
    PermanentError,
    config_error_in,
    one_line,
    require_extra,
    wrapped_errors,
)
from meshtrain.config.model import ModelArgs, ModelConfig, RopeScaling
from meshtrain.config.presets import MODEL_PRESETS
from meshtrain.config.redaction import REDACTED, redact_options, redact_url
from meshtrain.config.evaluation import EvalConfig
from meshtrain.config.observability import MetricsConfig
from meshtrain.config.parallelism import (
    PIPELINE_SCHEDULES,
    STRATEGIES,
    ParallelConfig,
    PipelineSchedule,
    ScalingConfig,
    Strategy,
    StrategyName,
    check_parallel_groups,
)
from meshtrain.config.run import SHARED_FOLDERS, CheckpointConfig, FaultConfig, RunConfig, replica_group_name
from meshtrain.config.fault_tolerance import FaultToleranceConfig
from meshtrain.config.training import OptimConfig, TrainConfig

__all__ = [
    "MODEL_PRESETS",
    "OVERALL_LABEL",
    "REDACTED",
    "SHARED_FOLDERS",
    "CheckpointConfig",
    "ConfigError",
    "PermanentError",
    "require_extra",
    "one_line",
    "replica_group_name",
    "wrapped_errors",
    "check_parallel_groups",
    "DataConfig",
    "EvalConfig",
    "FaultConfig",
    "FaultToleranceConfig",
    "MetricsConfig",
    "ModelArgs",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PIPELINE_SCHEDULES",
    "PipelineSchedule",
    "RopeScaling",
    "RunConfig",
    "ScalingConfig",
    "SourceConfig",
    "StageConfig",
    "STRATEGIES",
    "Strategy",
    "StrategyName",
    "TrainConfig",
    "ValidationConfig",
    "config_error_in",
    "redact_options",
    "redact_url",
    "source_labels",
]
