"""Where a run lives and how it survives: its name and folder, restarts and hangs, checkpoints, fault
injection for tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from meshtrain.config.redaction import OptionalLocation, StorageOptions, redact_url
from meshtrain.config.section import MAX_DURATION_S, Section, check_tested_scheme


SHARED_FOLDERS = ("token_stores", "prometheus")
_REPLICA_GROUP = re.compile(r"(.+)\.replica(\d+)")  # what replica_group_name makes


def replica_group_name(run: str, replica: int) -> str:
    """The name of a replica group of run ``run`` (fault_tolerance.mode=replica): of its Ray Train records, a
    folder beside the run's, and of its Prometheus targets file. Run names of this form are refused."""
    return f"{run}.replica{replica}"


MAX_RUN_NAME = 128  # leaves room under a file system's 255-byte names for what meshtrain adds to it


class RunConfig(Section):
    name: str | None = Field(
        None, description="Run name (a folder under storage_path); unset = '<preset>-<timestamp>'."
    )
    storage_path: str = Field(
        "runs", description="Directory (shared by all nodes on a cluster) where runs are written."
    )
    max_failures: int = Field(
        3, ge=-1, description="Worker-group restarts Ray Train may do; each resumes from the newest checkpoint (-1 = unlimited)."
    )
    hang_timeout_s: float | None = Field(
        600.0,
        gt=0, le=MAX_DURATION_S,
        description="After the first step, a worker with no progress for this long (a hung collective, a stuck "
        "rank) exits so Ray restarts the group from the last checkpoint; bytes reaching checkpoint storage count as "
        "progress, so a long save that keeps writing is never cut; must exceed the slowest step and evaluation; null = off.",
    )
    preemption_save_s: float | None = Field(
        25.0,
        gt=0, le=MAX_DURATION_S,
        description="On a preemption notice (SIGTERM, or Ray's drain notice) every worker stops at the next step, "
        "saves it and exits so Ray restarts the group; this is how long after the notice a worker may take to commit "
        "that save before it exits anyway. Fit it inside the notice period: GCP spot and Kubernetes' default grace 30 s, "
        "AWS spot 120 s. null = no handling (SIGTERM ends the worker at once).",
    )
    flight_recorder_entries: int = Field(
        2000,
        ge=0,
        description="Recent collectives each worker's torch flight recorder keeps (TORCH_FR_BUFFER_SIZE; gloo and "
        "NCCL groups alike); when the hang watchdog fires, every rank writes them to <run dir>/hangs/rank<R>.json "
        "and one line names the collective that never completed and the ranks that never entered it; 0 = off.",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or "/" in value or value in {".", ".."}):
            raise ValueError(f"must be a plain folder name (no '/', not '.' or '..'), got {value!r}")
        if value is not None and len(value) > MAX_RUN_NAME:
            raise ValueError(f"is {len(value)} characters; use at most {MAX_RUN_NAME} (files of the run, its Prometheus "
                             "targets and Ray's records all carry it in their names)")
        if value is not None and not value.isprintable():
            raise ValueError(f"holds a control character ({value[:40]!r}); use letters, digits and punctuation")
        group = _REPLICA_GROUP.fullmatch(value or "")
        if group is not None:
            raise ValueError(
                f"{value!r} is how replica group {group[2]} of a run {group[1]!r} names its Ray records and Prometheus "
                "targets; choose a run.name that does not end in .replica<N>"
            )
        if value in SHARED_FOLDERS:
            raise ValueError(
                f"{value!r} is a folder every run under run.storage_path shares ({', '.join(SHARED_FOLDERS)}); "
                "choose another run.name"
            )
        return value

    @field_validator("storage_path")
    @classmethod
    def _directory(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(
                f"must be a directory (on a cluster, one every node mounts), not a URL, got {redact_url(value)!r}; "
                "put s3:// storage in checkpoint.path and data.cache_dir"
            )
        return value

    @property
    def run_dir(self) -> Path:
        """The run folder, ``storage_path/name``: the one place it is derived (the launcher resolves ``name``
        before any worker starts; a trainer run directly without one writes into ``storage_path``)."""
        return Path(self.storage_path) / (self.name or "")


class CheckpointConfig(Section):
    enabled: bool = Field(True, description="Save checkpoints and resume from the newest committed one.")
    interval: int = Field(50, gt=0, description="Save every N steps (and always after the last step).")
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are deleted.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the loop waits only while state is staged to host memory; sync: until written."
    )
    path: OptionalLocation = Field(
        None,
        description="Root for checkpoints: a local/NFS path or s3://bucket/prefix (run.name is appended); "
        "unset = checkpoints/ in the run directory.",
    )
    storage_options: StorageOptions = Field(
        default_factory=dict,
        description="fsspec options for a remote path, e.g. {client_kwargs: {endpoint_url: ...}} for S3-compatible "
        "stores; shown redacted wherever meshtrain writes or prints the config.",
    )
    resume: bool = Field(True, description="Continue from the newest committed checkpoint when one exists.")
    start_from: OptionalLocation = Field(
        None,
        description="Start a new run from another run's committed meshtrain checkpoint (a step directory, or a run "
        "folder or checkpoints folder: its newest): its weights, and with checkpoint.start_from_optimizer its "
        "optimizer; the data and schedule are this run's (an anneal on a new mix). Once the run has checkpoints "
        "of its own it resumes them. Its run, step and fingerprint go into the records, summary and exports.",
    )
    start_from_optimizer: bool = Field(
        False, description="checkpoint.start_from: also take its AdamW moments and step counts."
    )
    start_from_lr: bool = Field(
        True,
        description="checkpoint.start_from: optim.lr becomes the learning rate the checkpoint's own schedule gave "
        "its next step (this run's schedule then decays from it); false keeps optim.lr.",
    )
    allow_untested_scheme: bool = Field(
        False,
        description="Accept a checkpoint.path scheme other than a local path or s3:// (untested with meshtrain).",
    )

    @model_validator(mode="after")
    def _tested_path_scheme(self) -> "CheckpointConfig":
        if self.path is not None and not self.allow_untested_scheme:
            check_tested_scheme(self.path, "checkpoint.path", opt_in="checkpoint.allow_untested_scheme")
        return self


class FaultConfig(Section):
    """Fault injection for tests and demonstrations: nothing here belongs in a production config."""

    kill_rank: int | None = Field(
        None, ge=0, description="Chaos testing: this worker fails once, at fault.at_step (how: fault.kind)."
    )
    at_step: int | None = Field(None, gt=0, description="Step at which fault.kill_rank fails.")
    kind: Literal["kill", "hang", "freeze", "nan", "slow"] = Field(
        "kill",
        description=(
            "kill: the worker sends itself SIGKILL; hang: it stops making progress (sleeps forever); freeze: it "
            "sends itself SIGSTOP (every thread stops, its heartbeats too) and is resumed fault.freeze_s later; nan: its "
            "logits are NaN from fault.at_step on, so the global loss and gradients are (the step guard's case); "
            "slow: its transformer blocks take fault.slow_factor times as long from fault.at_step on (a straggler)."
        ),
    )
    slow_factor: float = Field(3.0, gt=1, description="fault.kind=slow: how many times slower the worker computes.")
    freeze_s: float = Field(30.0, gt=0, le=MAX_DURATION_S, description="fault.kind=freeze: how long the worker stays stopped.")
    node: str | None = Field(
        None, description="fault.kind=slow: slow every worker on the node with this address (Ray: its IP) instead of fault.kill_rank."
    )
    during_checkpoint: bool = Field(
        False, description="Die right after the checkpoint of fault.at_step starts writing (it must be a save step)."
    )
    downstream_fail_step: int | None = Field(
        None, gt=0, description="Chaos testing: the downstream evaluation of this step's checkpoint fails in its Ray "
        "task, as a crashed evaluation would (one line in the job log, a downstream_eval_failed record; training and "
        "the next evaluations go on)."
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, values: Any) -> Any:
        if isinstance(values, dict) and "preemption_save_s" in values:
            raise ValueError("fault.preemption_save_s is now run.preemption_save_s (the fault section is for tests); "
                             "move the setting")
        return values
