"""How a launch ends when it does not finish: the exceptions the driver raises and the one final line
each prints (the failure, where the run can resume from, the restarts used)."""


from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any


from meshtrain.checkpoint.storage import newest_committed
from meshtrain.cluster.failures import Failure
from meshtrain.config import CheckpointConfig, RunConfig
from meshtrain.observe.run_folder import RunPaths, read_worker_starts



class TrainingFailed(RuntimeError):
    """The worker group failed for good (a permanent failure, or restarts exhausted) or the step guard
    stopped the run; the message names the cause and where the run can resume from."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class Interrupted(RuntimeError):
    """The driver was interrupted (Ctrl-C, ``ray job stop``); the message says where the run stopped,
    what was saved and how to resume."""


def _last_committed(checkpoint: CheckpointConfig, run: RunConfig) -> str:
    storage, newest = newest_committed(checkpoint, run)
    if newest is not None:
        return f"last committed checkpoint: {storage.display(newest.path)} (step {newest.step})"
    bad = len(storage.all_committed()) if checkpoint.enabled else 0
    return f"no loadable checkpoint ({bad} committed, marked bad)" if bad else "no checkpoint was committed"


def restarts_used(paths: RunPaths, launch_id: str) -> int:
    """How many times Ray restarted this launch's worker group (from worker_starts.jsonl); in replica
    mode, the most that any one replica group was restarted (run.max_failures bounds each group's)."""
    starts = Counter(entry.replica for entry in read_worker_starts(paths) if entry.launch == launch_id)
    return max((count - 1 for count in starts.values()), default=0)


def failure_message(checkpoint: CheckpointConfig, run: RunConfig, failure: Failure, restarts: int,
                    replica_groups: bool = False) -> str:
    """``restarts``: :func:`restarts_used`; ``replica_groups``: fault_tolerance.mode=replica, where they
    count a replica group's."""
    counted = f"{restarts} restart(s){' of a replica group' if replica_groups else ''}"
    if failure.permanent:
        how = f"not restarted, a restart cannot fix this{f' (after {counted})' if restarts else ''}"
        resume = f"fix the cause, then run the same command again (run.name={run.name}) to resume"
    else:
        how = f"after {counted} (run.max_failures={run.max_failures}{' per group' if replica_groups else ''})"
        resume = f"run the same command again (run.name={run.name}) to resume"
    return f"training failed: {failure.describe()}; {how}; {_last_committed(checkpoint, run)}; {resume}"


def interrupted_message(checkpoint: CheckpointConfig, run: RunConfig, interrupted: Mapping[str, Any] | None) -> str:
    storage, newest = newest_committed(checkpoint, run)
    if interrupted is None:
        at = "stopped at once without saving"
    else:
        at = f"interrupted at step {interrupted['step']}"
    saved = f"checkpoint step {newest.step} committed" if newest is not None else "no checkpoint committed"
    return f"{at}; {saved}; run the same command (run.name={run.name}) to resume"


def stopped_message(checkpoint: CheckpointConfig, run: RunConfig, reason: str) -> str:
    return (
        f"training stopped: {reason}; {_last_committed(checkpoint, run)}; fix the cause (e.g. lower optim.lr or raise "
        f"train.max_bad_steps) and run the same command again (run.name={run.name}) to resume from it"
    )
