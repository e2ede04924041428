"""MLflow as a tracker (``metrics.mlflow``): params from the config, metrics by step, one MLflow run
per meshtrain run, found again after a restart by its ``meshtrain.run_id`` tag."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from meshtrain.config import ConfigError, MetricsConfig, redact_url, require_extra
from meshtrain.observe.run_folder import RunPaths
from meshtrain.observe.trackers import flat_settings, tracker_run_id, unreachable

RUN_ID_TAG = "meshtrain.run_id"
_PARAM_VALUE_LIMIT = 6000  # MLflow's longest parameter value
_BATCH_LIMIT = 100  # parameters per log_batch call


def tracking_uri(metrics: MetricsConfig, paths: RunPaths) -> str:
    return metrics.mlflow_tracking_uri or f"sqlite:///{paths.run_dir.resolve() / 'mlflow.db'}"


def _client(uri: str, paths: RunPaths) -> Any:
    from mlflow.tracking import MlflowClient

    registry = uri
    if not uri.startswith(("http://", "https://")):
        # Only tracking is used; the model registry follows the tracking URI unless told otherwise,
        # and mlflow-skinny has no registry store for sqlite.
        registry = f"file://{paths.run_dir.resolve() / 'mlflow-registry'}"
    return MlflowClient(tracking_uri=uri, registry_uri=registry)


def _artifact_location(metrics: MetricsConfig, paths: RunPaths) -> str | None:
    """With the run's local store, artifacts (text samples) go into the run folder too; a tracking
    server keeps its own artifact root."""
    if metrics.mlflow_tracking_uri is not None:
        return None
    return (paths.run_dir.resolve() / "mlflow-artifacts").as_uri()


def check_mlflow(metrics: MetricsConfig) -> None:
    """ConfigError (one line) before Ray starts: mlflow missing, or the tracking server unreachable."""
    if not metrics.mlflow:
        return
    require_extra("metrics.mlflow", "mlflow", "mlflow")
    uri = metrics.mlflow_tracking_uri
    if uri is None or not uri.startswith(("http://", "https://")):
        return  # a local store is created on first use
    reason = unreachable(uri)
    if reason is not None:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={redact_url(uri)} cannot be reached ({reason}); start the server, fix the URI, "
            "or set metrics.mlflow=false"
        )


def mlflow_params(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The run's settings (the config's JSON dump, credentials redacted) as MLflow parameters (dotted key,
    value as text)."""
    return [(key, str(value)[:_PARAM_VALUE_LIMIT]) for key, value in flat_settings(settings)]


class MlflowTracker:
    name = "mlflow"

    def __init__(self, metrics: MetricsConfig, paths: RunPaths, settings: Mapping[str, Any]) -> None:
        """``settings``: the run's config as JSON (redacted), logged as the new run's parameters."""
        from mlflow.entities import Param

        self.paths = paths
        self.client = _client(tracking_uri(metrics, paths), paths)
        experiment = self.client.get_experiment_by_name(metrics.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(
                metrics.mlflow_experiment, artifact_location=_artifact_location(metrics, paths))
        )
        run_id = tracker_run_id(paths)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(
            experiment_id, run_name=paths.name, tags={RUN_ID_TAG: run_id, "meshtrain.run_dir": str(paths.run_dir)}
        )
        self.run_id = run.info.run_id
        params = [Param(key, value) for key, value in mlflow_params(settings)]
        for start in range(0, len(params), _BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=params[start : start + _BATCH_LIMIT])

    def log(self, step: int, values: dict[str, float], timestamp: float | None) -> None:
        from mlflow.entities import Metric

        milliseconds = int((timestamp or time.time()) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, milliseconds, step) for key, value in values.items()])

    def log_text(self, step: int, name: str, rows: list[dict[str, str]]) -> None:
        """A JSON artifact per step (MLflow keeps text as artifacts, in the run's artifact location)."""
        self.client.log_text(self.run_id, json.dumps(rows, indent=1), f"{name}/step-{step:08d}.json")

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")
