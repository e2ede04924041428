"""The driver hands the run's records to its experiment trackers (W&B, MLflow) as ``metrics.jsonl`` gets them.

Why the driver and not rank 0: the driver outlives every worker group. When one worker dies, Ray
ends the whole group, rank 0 included, often before it can close its trackers, and W&B's writer
buffers what it was handed (an offline run file is written 32 KiB at a time): a killed rank 0 lost
every row since the last flush, sometimes the whole run record, while ``metrics.jsonl`` (one
``write`` per line) held them. Following the file also keeps tracker calls, network round trips
among them, off the training loop.

Records already in the file when the driver starts were handed over by an earlier launch's driver;
each (event, step) is logged once per run (:class:`meshtrain.observe.trackers.TrackerSink`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from meshtrain.config import MetricsConfig, one_line
from meshtrain.observe.mlflow_tracker import MlflowTracker
from meshtrain.observe.run_folder import RecordFollower, RunPaths
from meshtrain.observe.trackers import TrackerBackend, TrackerSink, logged_keys
from meshtrain.observe.wandb_tracker import WandbTracker


class TrackerRelay:
    """A driver thread that follows ``metrics.jsonl`` and logs each new record to the trackers; on
    exit it hands over the last records and closes the tracker runs (finished when no exception)."""

    def __init__(self, sinks: list[TrackerSink], follower: RecordFollower, poll_s: float = 1.0) -> None:
        self.sinks, self.follower, self.poll_s = sinks, follower, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="meshtrain-trackers", daemon=True)

    @classmethod
    def open(cls, metrics: MetricsConfig, paths: RunPaths, settings: Mapping[str, Any]) -> TrackerRelay | None:
        """None when no tracker is configured (neither package is imported then). ``settings``: the run's
        config as JSON (redacted), which each new tracker run logs."""
        if not (metrics.wandb or metrics.mlflow):
            return None
        follower = RecordFollower(paths.metrics)
        already_logged = logged_keys(follower.new_records())  # the earlier launches' records
        sinks = open_trackers(metrics, paths, settings, already_logged)
        return cls(sinks, follower) if sinks else None

    def __enter__(self) -> TrackerRelay:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        for sink in self.sinks:
            sink.close(finished=kind is None)

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        for record in self.follower.new_records():
            for sink in self.sinks:
                sink.record(record)


def open_trackers(metrics: MetricsConfig, paths: RunPaths, settings: Mapping[str, Any],
                  already_logged: set[tuple[str, int]]) -> list[TrackerSink]:
    """The driver's W&B and MLflow sinks, as configured. One that cannot open its run is reported in
    one line and left out: a tracker never stops training (preflight checked them before Ray started)."""
    makers: list[tuple[str, Callable[[], TrackerBackend]]] = []
    if metrics.wandb:
        makers.append(("wandb", lambda: WandbTracker(metrics, paths, settings)))
    if metrics.mlflow:
        makers.append(("mlflow", lambda: MlflowTracker(metrics, paths, settings)))
    sinks = []
    for name, make in makers:
        try:
            sinks.append(TrackerSink(make(), already_logged))
        except Exception as exc:
            print(f"[meshtrain] {name}: could not open the run ({one_line(exc)}); training goes on without it",
                  file=sys.stderr, flush=True)
    return sinks
