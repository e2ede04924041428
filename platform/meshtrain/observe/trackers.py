"""Experiment trackers (Weights & Biases, MLflow): the run's records, one tracker run per meshtrain run.

A tracker sees the records ``metrics.jsonl`` gets, as numbers named ``train/loss``, ``eval/loss``,
``checkpoint/save_s``... keyed by the training step. The driver hands them over
(:mod:`meshtrain.observe.tracker_relay`); each launch continues the same tracker run (its id is
derived from the run's directory) and logs each (event, step) once, so a step retrained after a
restart or a relaunch is not logged twice. A tracker that fails mid-run never stops training: the
first failure is printed, failed records are dropped, and each later record tries again.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from meshtrain.config import one_line
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    GroupStartRecord,
    MetricsRecord,
    ReadRecord,
    ResizeRecord,
    RunPaths,
    TextSamplesRecord,
    TrainRecord,
    UnknownRecord,
)

# The numbers of each kind of record, as (record field, tracker name).
_TRAIN = [
    ("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
    ("tokens_per_s", "train/tokens_per_s"), ("step_time_s", "train/step_time_s"),
    ("data_wait_s", "train/data_wait_s"), ("skipped_steps", "train/skipped_steps"), ("tokens", "train/tokens"),
    ("mfu", "train/mfu"), ("world_size", "run/workers"),
]
_CHECKPOINT_SAVE = [("total_s", "checkpoint/save_s"), ("blocking_s", "checkpoint/loop_stall_s"), ("bytes", "checkpoint/bytes")]


def tracker_values(record: ReadRecord) -> dict[str, float]:
    """The numbers a tracker logs for ``record`` (empty for records it does not log)."""
    match record:
        case TrainRecord():
            return _pick(record, _TRAIN)
        case EvalRecord():
            values = _pick(record, [("loss", "eval/loss"), ("perplexity", "eval/perplexity")])
            for source, figures in record.sources.items():
                if figures["loss"] is not None:  # a source without held-out windows has no loss
                    values[f"eval/{_metric_name(source)}/loss"] = float(figures["loss"])
            return values
        case CheckpointSaveRecord():
            return _pick(record, _CHECKPOINT_SAVE)
        case CheckpointLoadRecord():
            return {"run/resumed_from_step": float(record.step)}
        case ResizeRecord():
            return {"run/workers": float(record.to_workers)}
        case GroupStartRecord():
            return {"run/restarts": float(record.restarts)}
        case DownstreamEvalRecord():
            task = _metric_name(record.task)
            return {f"downstream/{task}/{_metric_name(key)}": value for key, value in record.scores.items()}
    return {}


# The driver's records, which rank 0 passes to TensorBoard as they land.
DRIVER_RECORDS = (DownstreamEvalRecord, TextSamplesRecord)


def record_key(record: MetricsRecord) -> tuple[str, int] | None:
    """What a tracker logs once per run: (kind, step), a downstream evaluation's per task too; None for a
    record without a step."""
    step = getattr(record, "step", None)
    if not isinstance(step, int):
        return None
    if isinstance(record, DownstreamEvalRecord):
        return f"{record.event}/{record.task}", step
    return record.event, step


def _pick(record: object, names: list[tuple[str, str]]) -> dict[str, float]:
    values = ((getattr(record, key, None), name) for key, name in names)
    return {name: float(value) for value, name in values if isinstance(value, (int, float))}


def _metric_name(text: str) -> str:
    """A name both trackers accept: letters, digits and ``_-.`` (a data source's name may hold more)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def tracker_run_id(paths: RunPaths) -> str:
    """The tracker run id of a meshtrain run: its name, made safe, and a hash of its directory (two
    runs of one name under different storage paths stay apart). Every restart derives the same id."""
    digest = hashlib.sha1(str(paths.run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{_metric_name(paths.name)[:48]}-{digest}"


def logged_keys(records: Iterable[ReadRecord]) -> set[tuple[str, int]]:
    """(kind, step) of each record with a step: those of a run's ``metrics.jsonl`` when a launch
    starts were handed to the trackers by an earlier launch's driver."""
    keys = (record_key(record) for record in records if not isinstance(record, UnknownRecord))
    return {key for key in keys if key is not None}


def unreachable(url: str) -> str | None:
    """Why ``url`` cannot be reached (the exception's type), or None when it answers at all."""
    import requests  # wandb's and mlflow's own dependency

    try:
        requests.head(url, timeout=10)
    except requests.RequestException as exc:
        return type(exc).__name__
    return None


def flat_settings(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A nested config as (dotted key, value) pairs, the form trackers show as parameters."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flat_settings(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class TrackerBackend(Protocol):
    name: str

    def log(self, step: int, values: dict[str, float], timestamp: float | None) -> None: ...

    def log_text(self, step: int, name: str, rows: list[dict[str, str]]) -> None: ...

    def close(self, finished: bool) -> None: ...


class TrackerSink:
    """The record sink in front of one tracker: names the numbers, logs each (event, step) once, and
    keeps training going when the tracker fails.

    Records without a step (a worker group's start with its restart count, a resize) are carried
    into the next logged row.
    """

    def __init__(self, backend: TrackerBackend, already_logged: set[tuple[str, int]]) -> None:
        self.backend = backend
        self.logged = set(already_logged)
        self.pending: dict[str, float] = {}
        self.failures = 0

    def record(self, record: ReadRecord) -> None:
        if isinstance(record, UnknownRecord):
            return
        if isinstance(record, TextSamplesRecord):
            self._text(record)
            return
        values = tracker_values(record)
        if not values:
            return
        key = record_key(record)
        if key is None:
            self.pending.update(values)
            return
        if key in self.logged:
            return
        self.logged.add(key)
        row = {**self.pending, **values}
        self.pending = {}
        step = key[1]
        try:
            self.backend.log(step, row, getattr(record, "time", None))
        except Exception as exc:  # a tracker outage must not stop training
            self._failed(exc, f"step {step}")

    def _text(self, record: TextSamplesRecord) -> None:
        """Text samples: a table of (prompt, continuation) per step."""
        key = (record.event, record.step)
        if key in self.logged:
            return
        self.logged.add(key)
        rows = [{"prompt": sample["prompt"], "continuation": sample["continuation"]} for sample in record.samples]
        try:
            self.backend.log_text(record.step, "samples", rows)
        except Exception as exc:  # a tracker outage must not stop training
            self._failed(exc, f"step {record.step}")

    def _failed(self, exc: Exception, where: str) -> None:
        self.failures += 1
        if self.failures == 1:
            print(
                f"[meshtrain] {self.backend.name}: logging failed at {where} ({one_line(exc)}); "
                "training goes on, records that fail are dropped",
                file=sys.stderr, flush=True,
            )

    def close(self, finished: bool = False) -> None:
        """``finished``: the launch trained to the end (not a failure a relaunch may follow)."""
        try:
            self.backend.close(finished)
        except Exception as exc:
            self._failed(exc, "close")
        if self.failures:
            print(f"[meshtrain] {self.backend.name}: {self.failures} records not logged", file=sys.stderr, flush=True)
