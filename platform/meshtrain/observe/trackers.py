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
from meshtrain.observe.run_folder import RunPaths

# The numbers of each kind of record, as (record key, tracker name).
_TRAIN = [
    ("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
    ("tokens_per_s", "train/tokens_per_s"), ("step_time_s", "train/step_time_s"),
    ("data_wait_s", "train/data_wait_s"), ("skipped_steps", "train/skipped_steps"), ("tokens", "train/tokens"),
    ("mfu", "train/mfu"), ("world_size", "run/workers"),
]
_CHECKPOINT_SAVE = [("total_s", "checkpoint/save_s"), ("blocking_s", "checkpoint/loop_stall_s"), ("bytes", "checkpoint/bytes")]


def tracker_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers a tracker logs for ``record`` (empty for records it does not log)."""
    event = record["event"]
    if event == "train":
        return _pick(record, _TRAIN)
    if event == "eval":
        values = _pick(record, [("loss", "eval/loss"), ("perplexity", "eval/perplexity")])
        for source, figures in (record.get("sources") or {}).items():
            values[f"eval/{_metric_name(source)}/loss"] = float(figures["loss"])
        return values
    if event == "checkpoint_save":
        return _pick(record, _CHECKPOINT_SAVE)
    if event == "checkpoint_load":
        return {"run/resumed_from_step": float(record["step"])}
    if event == "resize":
        return {"run/workers": float(record["to_workers"])}
    if event == "group_start":
        return {"run/restarts": float(record["restarts"])}
    if event == "downstream_eval":
        task = _metric_name(record["task"])
        return {f"downstream/{task}/{_metric_name(key)}": value for key, value in downstream_scores(record).items()}
    return {}


def downstream_scores(record: dict[str, Any]) -> dict[str, float]:
    """A ``downstream_eval`` record's metric values (acc, bits_per_byte, ...), without its bookkeeping."""
    return {key: value for key, value in record.items()
            if key not in ("step", "samples", "seconds", "time") and isinstance(value, float)}


DRIVER_EVENTS = ("downstream_eval", "text_samples")


def record_key(record: dict[str, Any]) -> tuple[str, int]:
    """What a tracker logs once per run: (event, step); a downstream evaluation per task too."""
    event = record["event"]
    if event == "downstream_eval":
        event = f"downstream_eval/{record.get('task')}"
    return event, record["step"]


def _pick(record: dict[str, Any], names: list[tuple[str, str]]) -> dict[str, float]:
    return {name: float(record[key]) for key, name in names if isinstance(record.get(key), (int, float))}


def _metric_name(text: str) -> str:
    """A name both trackers accept: letters, digits and ``_-.`` (a data source's name may hold more)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def tracker_run_id(paths: RunPaths) -> str:
    """The tracker run id of a meshtrain run: its name, made safe, and a hash of its directory (two
    runs of one name under different storage paths stay apart). Every restart derives the same id."""
    digest = hashlib.sha1(str(paths.run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{_metric_name(paths.name)[:48]}-{digest}"


def logged_keys(records: Iterable[dict[str, Any]]) -> set[tuple[str, int]]:
    """(event, step) of each record with a step: those of a run's ``metrics.jsonl`` when a launch
    starts were handed to the trackers by an earlier launch's driver."""
    return {record_key(record) for record in records if isinstance(record.get("step"), int)}


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

    def record(self, record: dict[str, Any]) -> None:
        if record["event"] == "text_samples":
            self._text(record)
            return
        values = tracker_values(record)
        step = record.get("step")
        if not values:
            return
        if not isinstance(step, int):
            self.pending.update(values)
            return
        key = record_key(record)
        if key in self.logged:
            return
        self.logged.add(key)
        row = {**self.pending, **values}
        self.pending = {}
        try:
            self.backend.log(step, row, record.get("time"))
        except Exception as exc:  # a tracker outage must not stop training
            self._failed(exc, f"step {step}")

    def _text(self, record: dict[str, Any]) -> None:
        """Text samples: a table of (prompt, continuation) per step."""
        key = record_key(record)
        if key in self.logged:
            return
        self.logged.add(key)
        rows = [{"prompt": sample["prompt"], "continuation": sample["continuation"]} for sample in record["samples"]]
        try:
            self.backend.log_text(record["step"], "samples", rows)
        except Exception as exc:  # a tracker outage must not stop training
            self._failed(exc, f"step {record['step']}")

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
