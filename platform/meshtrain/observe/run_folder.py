"""The run folder is how the driver and the workers talk: this module is the one place that writes and
reads each of its shared files, so both sides (and the trackers, the benchmarks and the tests) read
the same thing.

=====================  ==========================================  ===========================================
file                   written by                                  read by
=====================  ==========================================  ===========================================
``metrics.jsonl``      rank 0 (its records), the driver            the driver (progress line, downstream), rank
                       (downstream results), both through          0 (the driver's results, for its trackers),
                       :class:`LineAppender`                    trackers, benchmarks: :func:`read_records`,
                                                                   :class:`RecordFollower`
``summary.json``       rank 0, then the driver (wall time,         the driver, benchmarks, tests:
                       downstream): :func:`write_summary`          :func:`read_summary`
``worker_starts.jsonl``  rank 0 of each worker group start:        the driver (restarts used), rank 0 (resizes),
                       :func:`append_worker_start`                 benchmarks: :func:`read_worker_starts`
``stop_request.json``  the driver (Ctrl-C, ``ray job stop``):      every worker: :meth:`StopRequest.read`
                       :meth:`StopRequest.write`
=====================  ==========================================  ===========================================

``config.yaml``, ``tokenizer.json`` and ``driver.lock`` are the driver's own (``cluster.launcher``,
``cluster.run_lease``). Every record of ``metrics.jsonl`` is a JSON object with an ``event`` among
:data:`RECORD_KINDS` and the keys of that kind's TypedDict (:func:`check_record`); a reader skips a torn
last line (a writer killed mid-line) and keeps kinds it does not know (a newer writer).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict

from meshtrain.config import RunConfig
from meshtrain.data.local_files import write_atomically
from meshtrain.observe.goodput import GoodputReport

Record = dict[str, Any]

# --- the records of metrics.jsonl: one TypedDict per kind, with exactly the keys its writer writes ---


class FlopsPerToken(TypedDict, total=False):
    flops_per_token: float  # when the steps count the attention they compute
    flops_per_token_full_attention: float


class _ReplicaWait(FlopsPerToken, total=False):
    replica_wait_s: float  # fault_tolerance.mode=replica: mean per step in the quorum and in uncommitted attempts
    replicas: int  # fault_tolerance.mode=replica: the replica groups that trained the record's step


class TrainRecord(_ReplicaWait):
    event: Literal["train"]
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    data_wait_s: float
    interval_steps: int  # the steps since the writer's previous record: step_time_s is their mean
    elapsed_s: float
    skipped_steps: int
    world_size: int
    time: float
    samples: list[int]  # the global samples the step read: [first, end)


class SourceEval(TypedDict):
    loss: float | None
    tokens: int


class EvalRecord(TypedDict):
    event: Literal["eval"]
    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    sources: dict[str, SourceEval]
    seconds: float


class CheckpointSaveRecord(TypedDict):
    event: Literal["checkpoint_save"]
    step: int
    path: str
    blocking_s: float
    total_s: float
    bytes: int
    mode: Literal["async", "sync"]


class CheckpointLoadRecord(TypedDict):
    event: Literal["checkpoint_load"]
    step: int
    path: str
    load_s: float
    rng_restored: bool


class CheckpointSkippedRecord(TypedDict):
    event: Literal["checkpoint_skipped"]
    step: int
    reason: str


class StoppedRecord(TypedDict):
    event: Literal["stopped"]
    step: int
    reason: str


class WarningRecord(TypedDict):
    event: Literal["warning"]
    step: int
    setting: str
    message: str


class _PreemptedRequired(TypedDict):
    event: Literal["preempted"]
    step: int
    reason: str
    ranks: list[int]
    saved: bool
    save_s: float


class PreemptedRecord(_PreemptedRequired, total=False):
    notice_to_commit_s: float  # when some rank knows its notice's age
    replica_peers_live: int  # fault_tolerance.mode=replica: live replica groups it left the training to (no save then)


class Interrupted(TypedDict):
    """Where the driver's stop request left the run (also ``summary.json``'s ``interrupted``)."""

    step: int
    saved: bool
    reason: str | None


class InterruptedRecord(Interrupted):
    event: Literal["interrupted"]


class ResizeRecord(TypedDict):
    event: Literal["resize"]
    time: float
    from_workers: int
    to_workers: int
    reason: str


class ResizeSaveRecord(TypedDict):
    event: Literal["resize_save"]
    step: int
    saved: bool
    save_s: float


class StragglerRecord(TypedDict):
    event: Literal["straggler"]
    step: int
    rank: int
    node: str
    slowdown: float
    compute_s: float
    median_others_s: float
    logged_steps: int


class _EvictionRequired(TypedDict):
    event: Literal["eviction"]
    step: int
    rank: int
    node: str
    evicted: bool
    reason: str


class EvictionRecord(_EvictionRequired, total=False):
    node_id: str  # when Ray knows the node


class ProfileRecord(TypedDict):
    event: Literal["profile"]
    step: int
    rank: int
    first_step: int
    device: Literal["cuda", "cpu"]
    top_ms_per_step: list[list[str | float]]  # [op name, ms per step]
    trace: str


class MemorySnapshotRecord(TypedDict):
    event: Literal["memory_snapshot"]
    step: int
    rank: int
    path: str


class DownstreamEvalRecord(TypedDict):
    """Besides these keys, one float per lm-evaluation-harness metric (``acc``, ``acc_norm``, ...)."""

    event: Literal["downstream_eval"]
    step: int
    task: str
    samples: int | None
    seconds: float
    time: float


class DownstreamEvalFailedRecord(TypedDict):
    event: Literal["downstream_eval_failed"]
    step: int
    error: str
    time: float


class TextSample(TypedDict):
    prompt: str
    continuation: str
    new_tokens: int
    stopped_at_eos: bool


class TextSamplesRecord(TypedDict):
    event: Literal["text_samples"]
    step: int
    samples: list[TextSample]
    seconds: float
    time: float


class GroupStartRecord(TypedDict):
    event: Literal["group_start"]
    restarts: int
    workers: int
    time: float


class ReplicaJoinedRecord(TypedDict):
    event: Literal["replica_joined"]
    step: int  # the step it joined at: the steps committed before it
    replica: int  # the joining replica group's index
    participants: int  # live replica groups with it
    seconds: float  # from its first quorum request to its state received
    source: int  # the live replica group it received the state from
    bytes: int  # the tensor bytes its workers received, all together
    time: float


class ReplicaLostRecord(TypedDict):
    event: Literal["replica_lost"]
    step: int  # the first step trained without it
    participants: int  # live replica groups left
    replicas: int  # the run's replica groups
    # What the loss cost the survivors: from their first attempt at the step (the discarded attempts included)
    # to the quorum that went on without the lost group, and of that, the wait for that quorum (how long the
    # lighthouse took to drop the lost group: about fault_tolerance.heartbeat_timeout_s after its last heartbeat).
    stall_s: float
    quorum_s: float
    time: float


class MixtureRecord(TypedDict):
    event: Literal["mixture"]
    step: int
    samples: list[int]  # the global samples [from, to) it counts: those trained since the previous record
    sources: dict[str, float]  # each source's share of them (data.sources' weights are what they aim at)


MetricsRecord = (
    TrainRecord | EvalRecord | CheckpointSaveRecord | CheckpointLoadRecord | CheckpointSkippedRecord | StoppedRecord
    | WarningRecord | PreemptedRecord | InterruptedRecord | ResizeRecord | ResizeSaveRecord | StragglerRecord
    | EvictionRecord | ProfileRecord | MemorySnapshotRecord | DownstreamEvalRecord | DownstreamEvalFailedRecord
    | TextSamplesRecord | GroupStartRecord | ReplicaJoinedRecord | ReplicaLostRecord | MixtureRecord
)


class RecordKind(NamedTuple):
    writer: str
    description: str
    schema: type  # the kind's TypedDict
    extra_values: type | None = None  # the type of any other key's value, where a kind allows others


# Every kind of metrics.jsonl record: who writes it, what it says, and its keys.
RECORD_KINDS: dict[str, RecordKind] = {
    "train": RecordKind("rank 0", "a logged step: loss, lr, grad norm, tokens, throughput, step and data-wait time, FLOPs",
                        TrainRecord),
    "eval": RecordKind("rank 0", "validation loss and perplexity, overall and per source", EvalRecord),
    "checkpoint_save": RecordKind("rank 0", "a committed checkpoint: path, blocking and total seconds, bytes, mode",
                                  CheckpointSaveRecord),
    "checkpoint_load": RecordKind("rank 0", "the checkpoint a start resumed from, and how long the load took",
                                  CheckpointLoadRecord),
    "checkpoint_skipped": RecordKind("rank 0", "a save step the step guard skipped", CheckpointSkippedRecord),
    "stopped": RecordKind("rank 0", "the step guard stopped the run, and why", StoppedRecord),
    "warning": RecordKind("rank 0", "a setting that measurement shows cannot work, named", WarningRecord),
    "preempted": RecordKind("rank 0", "a preemption notice: the ranks, the save and its seconds", PreemptedRecord),
    "interrupted": RecordKind("rank 0", "the driver's stop request: the step saved", InterruptedRecord),
    "resize": RecordKind("rank 0", "the worker group changed size: from, to, why", ResizeRecord),
    "resize_save": RecordKind("rank 0", "the save made before Ray grows the group", ResizeSaveRecord),
    "straggler": RecordKind("rank 0", "a rank slower than its peers: rank, node, slowdown", StragglerRecord),
    "eviction": RecordKind("rank 0", "a straggler's node drained: accepted or why not", EvictionRecord),
    "profile": RecordKind("rank 0", "a profiler window: its trace and top ops", ProfileRecord),
    "memory_snapshot": RecordKind("rank 0", "a CUDA allocator snapshot written at the end of the steps",
                                  MemorySnapshotRecord),
    "downstream_eval": RecordKind("the driver", "one checkpoint's lm-evaluation-harness scores per task",
                                  DownstreamEvalRecord, extra_values=float),
    "downstream_eval_failed": RecordKind("the driver", "one checkpoint's evaluation failed, and why",
                                         DownstreamEvalFailedRecord),
    "text_samples": RecordKind("the driver", "one checkpoint's continuations of the fixed prompts", TextSamplesRecord),
    "group_start": RecordKind("rank 0", "a worker group started: how many times Ray restarted this launch's group "
                              "before", GroupStartRecord),
    "replica_joined": RecordKind("rank 0", "fault_tolerance.mode=replica (rank 0 of the joining group): a replica "
                                 "group joined by receiving a live peer's state", ReplicaJoinedRecord),
    "replica_lost": RecordKind("rank 0", "fault_tolerance.mode=replica (rank 0 of the first live group): a step "
                               "trained with fewer live replica groups than the one before", ReplicaLostRecord),
    "mixture": RecordKind("rank 0", "a logged step of a data mixture: each source's share of the samples trained "
                          "since the previous one", MixtureRecord),
}


def check_record(record: Mapping[str, Any]) -> list[str]:
    """Where one record departs from the protocol: an unknown kind, a missing key of its kind, a key its
    kind does not have; [] when it conforms. Values are not checked, but for a kind's other keys."""
    event = record.get("event")
    kind = RECORD_KINDS.get(event) if isinstance(event, str) else None
    if kind is None:
        return [f"unknown kind {event!r}"]
    schema: Any = kind.schema
    known = schema.__required_keys__ | schema.__optional_keys__
    return [f"{event}: missing {key!r}" for key in sorted(schema.__required_keys__ - record.keys())] + [
        f"{event}: unknown {key!r}" for key, value in record.items()
        if key not in known and (kind.extra_values is None or not isinstance(value, kind.extra_values))
    ]


@dataclass(frozen=True)
class RunPaths:
    """Where one run's files are: ``{storage_path}/{name}/``."""

    name: str
    storage_path: Path

    @classmethod
    def of(cls, run: RunConfig) -> RunPaths:
        """The paths of a resolved run (``run.name`` set, as the launcher does)."""
        if run.name is None:
            raise ValueError("run.name must be resolved first (meshtrain.cluster.launcher.resolve_run)")
        return cls(run.name, Path(run.storage_path))

    @property
    def run_dir(self) -> Path:
        return self.storage_path / self.name

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.run_dir / "tokenizer.json"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def worker_starts(self) -> Path:
        return self.run_dir / "worker_starts.jsonl"

    @property
    def stop_request(self) -> Path:
        """Where the driver asks the workers to save and stop (Ctrl-C, ``ray job stop``)."""
        return self.run_dir / "stop_request.json"


# --- metrics.jsonl -------------------------------------------------------------------------------


class LineAppender:
    """The one writer of the append-only files (``metrics.jsonl``, ``worker_starts.jsonl``): each record
    one JSON line in one ``write`` on an append-only descriptor, so rank 0's lines and the driver's never
    interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if _ends_torn(path):  # a writer killed mid-line: end it, or this writer's first line joins it
            os.write(self._fd, b"\n")

    def record(self, record: Mapping[str, Any]) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ends_torn(path: Path) -> bool:
    with path.open("rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return False
        file.seek(-1, os.SEEK_END)
        return file.read(1) != b"\n"


def append_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    appender = LineAppender(path)
    try:
        for record in records:
            appender.record(record)
    finally:
        appender.close()


def _json_objects(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of whole lines; a torn line of a killed writer is skipped."""
    for line in lines:
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(document, dict):
            yield document


def _parsed(lines: Iterable[bytes | str], events: Iterable[str] | None) -> list[Record]:
    wanted = set(events) if events is not None else None
    return [record for record in _json_objects(lines)
            if "event" in record and (wanted is None or record["event"] in wanted)]


def read_records(path: Path, events: Iterable[str] | None = None) -> list[Record]:
    """Every record of a run's ``metrics.jsonl`` (of ``events`` only, when given), in order; [] before
    the first one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parsed(data.split(b"\n"), events)


class RecordFollower:
    """The records of some kinds appended since the last call (another process's): the driver's progress
    line and tracker relay, and rank 0 passing the driver's downstream results to TensorBoard."""

    def __init__(self, path: Path, events: Iterable[str] | None = None, from_end: bool = False) -> None:
        """``from_end``: only records appended after now (a resumed run's earlier lines are not new)."""
        self.path, self.events = path, events
        self._offset = path.stat().st_size if from_end and path.exists() else 0
        self._partial = b""

    def new_records(self) -> list[Record]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return _parsed(lines, self.events)


# --- summary.json --------------------------------------------------------------------------------


class Summary(TypedDict, total=False):
    """``summary.json``: rank 0 writes it when training ends; the driver adds ``wall_time_s``,
    ``goodput`` and ``downstream`` and writes it again."""

    run: str
    steps: int
    final_loss: float | None
    eval_loss: float | None
    eval_loss_by_source: dict[str, float | None]
    skipped_steps: int
    stopped: str | None
    interrupted: Interrupted | None
    mean_tokens_per_s: float | None
    tokens: int
    train_time_s: float
    mesh_shape: list[int]
    world_size: int
    parameters: int
    run_dir: str
    workers: list[dict[str, Any]]
    resizes: list[dict[str, Any]]
    device: str
    peak_device_memory_bytes: int
    num_alloc_retries: int
    peak_host_rss_bytes: int
    wall_time_s: float
    downstream: dict[str, Any]
    replica_groups: int  # fault_tolerance.mode=replica (the driver's): mesh_shape and world_size are one group's
    goodput: GoodputReport  # the driver's, from this launch's records (meshtrain.observe.goodput)


def write_summary(paths: RunPaths, summary: Summary) -> None:
    write_atomically(paths.summary, json.dumps(summary, indent=2) + "\n")


def read_summary(paths: RunPaths) -> Summary:
    return json.loads(paths.summary.read_text())


# --- worker_starts.jsonl -------------------------------------------------------------------------


class Placement(TypedDict):
    rank: int
    node_rank: int
    local_rank: int
    node_ip: str
    pid: int


class WorkerStart(TypedDict, total=False):
    """One start of the worker group (a launch, or Ray Train restarting the group)."""

    launch: str
    time: float
    world_size: int
    workers: list[Placement]
    resized_from: int  # when this start's size differs from the run's previous one
    resize_reason: str
    replica: int  # fault_tolerance.mode=replica: the replica group that started


def append_worker_start(paths: RunPaths, start: WorkerStart) -> None:
    append_records(paths.worker_starts, [start])


def read_worker_starts(paths: RunPaths) -> list[WorkerStart]:
    try:
        data = paths.worker_starts.read_bytes()
    except FileNotFoundError:
        return []
    return [start for start in _json_objects(data.split(b"\n")) if "launch" in start]  # type: ignore[misc]


# --- stop_request.json ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StopRequest:
    """The driver's request that one launch's workers save and stop: a small JSON file in the run
    directory (storage every node sees), naming the launch so a later launch of the run ignores it."""

    path: str
    launch_id: str

    def write(self, reason: str) -> None:
        write_atomically(self.path, json.dumps({"launch": self.launch_id, "reason": reason, "time": time.time()}))

    def read(self) -> str | None:
        """The reason of a request for this launch, or None."""
        try:
            request = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(request, dict) or request.get("launch") != self.launch_id:
            return None
        return str(request.get("reason") or "interrupted")

    def clear(self) -> None:
        Path(self.path).unlink(missing_ok=True)
