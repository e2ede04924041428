"""Weights & Biases as a tracker (``metrics.wandb``): the resolved config once, records by step, one
W&B run per meshtrain run whose id is derived from the run, resumed by every restart.

``WANDB_MODE=offline`` (clusters without internet access) writes the run under
``<run dir>/wandb/offline-run-*``; ``wandb sync <run dir>/wandb/offline-run-*`` uploads it later.
Each worker-group start writes its own offline folder under the same run id.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from meshtrain.config import ConfigError, MetricsConfig, require_extra
from meshtrain.observe.run_folder import RunPaths
from meshtrain.observe.trackers import tracker_run_id, unreachable

_OFFLINE_MODES = ("offline", "dryrun", "disabled")
STEP_METRIC = "step"  # the x-axis of every logged series: the training step


def check_wandb(metrics: MetricsConfig) -> None:
    """ConfigError (one line) before Ray starts: wandb missing, or (online) no credentials."""
    if not metrics.wandb:
        return
    require_extra("metrics.wandb", "wandb", "wandb")
    if os.environ.get("WANDB_MODE", "online") in _OFFLINE_MODES:
        return
    if not _has_api_key():
        raise ConfigError(
            "metrics.wandb=true needs W&B credentials: run `wandb login` or set WANDB_API_KEY (on a cluster, in the "
            "job's runtime env); without internet access set WANDB_MODE=offline and `wandb sync` the run later"
        )
    base_url = _base_url()
    reason = unreachable(base_url)
    if reason is not None:
        raise ConfigError(
            f"metrics.wandb=true: W&B at {base_url} cannot be reached ({reason}); check the network or "
            "WANDB_BASE_URL, or set WANDB_MODE=offline and `wandb sync` the run later"
        )


def _base_url() -> str:
    """The server wandb would talk to: WANDB_BASE_URL, else its own default (it changes between releases)."""
    import wandb

    return os.environ.get("WANDB_BASE_URL") or str(wandb.Settings().base_url)


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(_base_url()).hostname
    try:
        return netrc.netrc().authenticators(host or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class WandbTracker:
    name = "wandb"

    def __init__(self, metrics: MetricsConfig, paths: RunPaths, settings: Mapping[str, Any]) -> None:
        """``settings``: the run's config as JSON (redacted), the W&B run's config."""
        import wandb

        paths.run_dir.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            project=metrics.wandb_project,
            entity=metrics.wandb_entity,
            id=tracker_run_id(paths),
            name=paths.name,
            resume="allow",
            tags=metrics.wandb_tags or None,
            config=dict(settings),
            dir=str(paths.run_dir),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log(self, step: int, values: dict[str, float], timestamp: float | None) -> None:
        # W&B's own _step only counts rows; the x-axis is meshtrain's step, so records of an earlier
        # step (a resume's checkpoint load) still land where they belong.
        self.run.log({STEP_METRIC: step, **values})

    def log_text(self, step: int, name: str, rows: list[dict[str, str]]) -> None:
        import wandb

        names = list(rows[0]) if rows else ["prompt", "continuation"]
        columns: list[str | int] = list(names)
        table = wandb.Table(columns=columns, data=[[row[name] for name in names] for row in rows])
        self.run.log({STEP_METRIC: step, name: table})

    def close(self, finished: bool) -> None:
        import wandb

        self.run.finish(exit_code=0 if finished else 1)
        wandb.teardown()  # stops the wandb-core process the run started
