"""The run folder is how the driver and the workers talk: this module is the one place that writes and
reads each of its shared files, so both sides (and the trackers, the benchmarks and the tests) read
the same thing.

=====================  ==========================================  ===========================================
file                   written by                                  read by
=====================  ==========================================  ===========================================
``metrics.jsonl``      rank 0 (its records), the driver            the driver (progress line, downstream), rank
                       (downstream results), both through          0 (the driver's results, for its trackers),
                       :class:`LineAppender`                       trackers, benchmarks: :func:`read_records`,
                                                                   :class:`RecordFollower`
``result.json``        rank 0, when training ends:                 the driver: :func:`read_result`
                       :func:`write_result`
``summary.json``       the driver alone: rank 0's result, wall     benchmarks, tests, you: :func:`read_summary`
                       time, goodput, downstream:
                       :func:`write_summary`
``worker_starts.jsonl``  rank 0 of each worker group start:        the driver (restarts used), rank 0 (resizes),
                       :func:`append_worker_start`                 benchmarks: :func:`read_worker_starts`
``stop_request.json``  the driver (Ctrl-C, ``ray job stop``):      every worker: :meth:`StopRequest.read`
                       :meth:`StopRequest.write`
=====================  ==========================================  ===========================================

``config.yaml``, ``tokenizer.json`` and ``driver.lock`` are the driver's own (``cluster.launcher``,
``cluster.run_lease``).

Every record of ``metrics.jsonl`` is a JSON object with an ``event`` among :data:`RECORD_KINDS` and the
keys of that kind's class: each kind is a frozen dataclass (:class:`Record`) whose ``event`` is a class
variable. Writers build the class and hand it to :meth:`LineAppender.record`, which encodes it
(:meth:`Record.to_json`: a field that defaults to None is an optional key, left out while None); every
reader parses lines with :func:`parse_record`, the one place that looks at ``event``, and tells kinds
apart by class (``isinstance``, ``match``). A reader skips a torn last line (a writer killed mid-line)
and a record of a known kind that lacks one of its keys (malformed: the writer's class has it); it
drops keys a kind does not have and keeps a kind it does not know (a newer writer's) as an
:class:`UnknownRecord`. Values are not checked.

A new kind of record is a class here (and a member of :data:`MetricsRecord`), its entry in
:data:`RECORD_KINDS`, its writer, and the record reference regenerated (``python jobs/record_reference.py
--write``): three files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, TypedDict, TypeVar, cast, overload

from meshtrain.config import ConfigError, RunConfig, one_line
from meshtrain.data.local_files import write_atomically

if TYPE_CHECKING:  # goodput reads the records defined here
    from meshtrain.observe.goodput import GoodputReport

# --- encoding: dataclass <-> JSON object ---------------------------------------------------------

FLAT: Mapping[str, bool] = {"flat": True}  # field metadata: a dict whose items are the object's own keys

_ALWAYS, _UNLESS_NONE, _FLAT = 0, 1, 2


class _Codec:
    """One dataclass's fields, in order, and how each is written: always, left out while None (a field
    that defaults to None: an optional key), or its items as the object's own keys (``FLAT``).

    ``encode`` is compiled once per class, as dataclasses compile ``__init__``: one dict display and a
    statement per optional field, about three times faster than a loop over the fields (rank 0 writes a
    record at every logged step)."""

    def __init__(self, cls: type) -> None:
        fields = dataclasses.fields(cls)
        self.cls = cls
        event = getattr(cls, "event", None)
        self.head: dict[str, str] = {"event": event} if isinstance(event, str) else {}
        ways = [(item.name, _FLAT if item.metadata.get("flat") else _UNLESS_NONE if item.default is None else _ALWAYS)
                for item in fields]
        self.known = frozenset(name for name, _ in ways)
        self.required = frozenset(item.name for item in fields if item.default is dataclasses.MISSING
                                  and item.default_factory is dataclasses.MISSING)
        self.flat = next((name for name, way in ways if way == _FLAT), None)
        self.encode: Callable[[Any], dict[str, Any]] = _compiled_encoder(cls.__name__, self.head, ways)

    def decode(self, document: Mapping[str, Any]) -> Any:
        """The instance, or None when ``document`` lacks a key the class requires. Keys the class does
        not have are dropped; a flattened field gathers those with a float value."""
        values = {key: value for key, value in document.items() if key in self.known}
        if self.flat is not None:
            values[self.flat] = {key: value for key, value in document.items()
                                 if key not in self.known and key not in self.head and isinstance(value, float)}
        if not self.required <= values.keys():
            return None
        return self.cls(**values)


def _compiled_encoder(name: str, head: dict[str, str], ways: list[tuple[str, int]]) -> Callable[[Any], dict[str, Any]]:
    """``def encode(value): out = {"event": "train", "a": value.a, ...}; if value.b is not None: out["b"] =
    value.b; ...``: the fields in their order (dataclass field names are identifiers)."""
    leading = 0
    while leading < len(ways) and ways[leading][1] == _ALWAYS:
        leading += 1
    items = [f"{key!r}: {value!r}" for key, value in head.items()] + [f"{key!r}: value.{key}" for key, _ in ways[:leading]]
    lines = [f"    out = {{{', '.join(items)}}}"]
    for key, way in ways[leading:]:
        if way == _ALWAYS:
            lines.append(f"    out[{key!r}] = value.{key}")
        elif way == _UNLESS_NONE:
            lines.append(f"    item = value.{key}\n    if item is not None:\n        out[{key!r}] = item")
        else:
            lines.append(f"    out.update(value.{key})")
    namespace: dict[str, Any] = {}
    exec(compile("def encode(value):\n" + "\n".join(lines) + "\n    return out\n", f"<{name} encoder>", "exec"), namespace)
    encode: Callable[[Any], dict[str, Any]] = namespace["encode"]
    return encode


_CODECS: dict[type, _Codec] = {}


def _codec(cls: type) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _Codec(cls)
    return codec


class JsonObject:
    """A dataclass written as one JSON object of the run folder (a record, a worker start, a result)."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every field by name, those that default to None only when set, flattened
        fields' items as keys of their own (and a record's ``event`` first)."""
        return _codec(type(self)).encode(self)


# --- the records of metrics.jsonl: one frozen dataclass per kind, with exactly the keys its writer writes ---


class Record(JsonObject):
    """A record of ``metrics.jsonl``; each kind is a subclass whose ``event`` names it."""

    __slots__ = ()
    event: ClassVar[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainRecord(Record):
    event: ClassVar[str] = "train"
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
    flops_per_token: float | None = None  # when the steps count the attention they compute
    flops_per_token_full_attention: float | None = None
    replica_wait_s: float | None = None  # fault_tolerance.mode=replica: mean per step in the quorum and in uncommitted attempts
    replicas: int | None = None  # fault_tolerance.mode=replica: the replica groups that trained the record's step
    stage: str | None = None  # data.stages: the stage of the step's samples


class SourceEval(TypedDict):
    loss: float | None
    tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalRecord(Record):
    event: ClassVar[str] = "eval"
    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    sources: dict[str, SourceEval]
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSaveRecord(Record):
    event: ClassVar[str] = "checkpoint_save"
    step: int
    path: str
    blocking_s: float
    total_s: float
    bytes: int
    mode: Literal["async", "sync"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointLoadRecord(Record):
    event: ClassVar[str] = "checkpoint_load"
    step: int
    path: str
    load_s: float
    rng_restored: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSkippedRecord(Record):
    event: ClassVar[str] = "checkpoint_skipped"
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class StoppedRecord(Record):
    event: ClassVar[str] = "stopped"
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WarningRecord(Record):
    event: ClassVar[str] = "warning"
    step: int
    setting: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptedRecord(Record):
    event: ClassVar[str] = "preempted"
    step: int
    reason: str
    ranks: list[int]
    saved: bool
    save_s: float
    notice_to_commit_s: float | None = None  # when some rank knows its notice's age
    replica_peers_live: int | None = None  # fault_tolerance.mode=replica: live replica groups it left the training to (no save then)


class Interrupted(TypedDict):
    """Where the driver's stop request left the run (``result.json``'s and ``summary.json``'s ``interrupted``)."""

    step: int
    saved: bool
    reason: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class InterruptedRecord(Record):
    event: ClassVar[str] = "interrupted"
    step: int
    saved: bool
    reason: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ResizeRecord(Record):
    event: ClassVar[str] = "resize"
    time: float
    from_workers: int
    to_workers: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ResizeSaveRecord(Record):
    event: ClassVar[str] = "resize_save"
    step: int
    saved: bool
    save_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerRecord(Record):
    event: ClassVar[str] = "straggler"
    step: int
    rank: int
    node: str
    slowdown: float
    compute_s: float
    median_others_s: float
    logged_steps: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaStragglerRecord(Record):
    """fault_tolerance.mode=replica: a replica group whose compute stays slower than the other groups'."""

    event: ClassVar[str] = "replica_straggler"
    step: int
    replica: int  # the slow group's index
    slowdown: float  # its block compute per step over the median of the other live groups'
    compute_s: float  # its block compute per step (its slowest worker's)
    median_others_s: float
    logged_steps: int  # logged steps in a row at or above metrics.straggler_factor
    node: str = ""  # the node of its slowest worker
    # scaling.evict_stragglers: its peers ended it for Ray to replace (once per group index in a launch)
    replaced: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class EvictionRecord(Record):
    event: ClassVar[str] = "eviction"
    step: int
    rank: int
    node: str
    evicted: bool
    reason: str
    node_id: str | None = None  # when Ray knows the node


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileRecord(Record):
    event: ClassVar[str] = "profile"
    step: int
    rank: int
    first_step: int
    device: Literal["cuda", "cpu"]
    top_ms_per_step: list[list[str | float]]  # [op name, ms per step]
    trace: str


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshotRecord(Record):
    event: ClassVar[str] = "memory_snapshot"
    step: int
    rank: int
    path: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DownstreamEvalRecord(Record):
    """``scores``: one float per lm-evaluation-harness metric (``acc``, ``acc_norm``, ...), each a key of
    the JSON object of its own."""

    event: ClassVar[str] = "downstream_eval"
    step: int
    task: str
    scores: dict[str, float] = field(default_factory=dict, metadata=FLAT)
    samples: int | None
    seconds: float
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class DownstreamEvalFailedRecord(Record):
    event: ClassVar[str] = "downstream_eval_failed"
    step: int
    error: str
    time: float


class TextSample(TypedDict):
    prompt: str
    continuation: str
    new_tokens: int
    stopped_at_eos: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class TextSamplesRecord(Record):
    event: ClassVar[str] = "text_samples"
    step: int
    samples: list[TextSample]
    seconds: float
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupStartRecord(Record):
    event: ClassVar[str] = "group_start"
    restarts: int
    workers: int
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaJoinedRecord(Record):
    event: ClassVar[str] = "replica_joined"
    step: int  # the step it joined at: the steps committed before it
    replica: int  # the joining replica group's index
    participants: int  # live replica groups with it
    seconds: float  # from its first quorum request to its state received
    source: int  # the live replica group it received the state from
    bytes: int  # the tensor bytes its workers received, all together
    time: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaLostRecord(Record):
    event: ClassVar[str] = "replica_lost"
    step: int  # the first step trained without it
    participants: int  # live replica groups left
    replicas: int  # the run's replica groups
    # What the loss cost the survivors: from their first attempt at the step (the discarded attempts included)
    # to the quorum that went on without the lost group, and of that, the wait for that quorum (how long the
    # lighthouse took to drop the lost group: about fault_tolerance.heartbeat_timeout_s after its last heartbeat).
    stall_s: float
    quorum_s: float
    time: float
    # Why: hung (it heartbeat but missed the step's deadline; its peers had the lighthouse end it), frozen (it
    # missed the deadline and could not be reached: a stopped process or node), lost (it failed, left or
    # stopped heartbeating on its own), slow (a straggler group its peers replaced).
    cause: Literal["lost", "hung", "frozen", "slow"] = "lost"
    groups: list[int] | None = None  # the replica groups its peers ended (none for a lost group)


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureRecord(Record):
    event: ClassVar[str] = "mixture"
    step: int
    samples: list[int]  # the global samples [from, to) it counts: those trained since the previous record
    sources: dict[str, float]  # each source's share of them (data.sources' weights are what they aim at)
    stage: str | None = None  # data.stages: the stage of the last of them (whose weights the shares aim at)
    target: dict[str, float] | None = None  # the shares the mixture (of that stage) aims at


@dataclass(frozen=True, kw_only=True, slots=True)
class StartedFromRecord(Record):
    event: ClassVar[str] = "started_from"
    run: str | None  # the run that saved the checkpoint
    step: int
    path: str
    fingerprint: str  # its commit marker's digest
    lr: float  # the learning rate its schedule gave its next step
    optimizer: bool  # its optimizer state was taken too
    load_s: float


class LeftOutRange(TypedDict):
    """A range a rollback left out, as the record and left_out_samples.json write it (:class:`LeftOutSamples`)."""

    stage: str | None
    start: int
    stop: int
    rollback: int
    step: int
    rolled_back_to: int
    sources: dict[str, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class RollbackRecord(Record):
    event: ClassVar[str] = "rollback"
    step: int  # the step whose guard reading called for it
    to_step: int  # the checkpoint the run went back to
    skipped_steps: list[int]  # the steps skipped within train.rollback_window
    left_out: list[LeftOutRange]  # the samples left out from now on
    seconds: float  # the reload: waiting for the save in flight, loading the checkpoint, re-reading data
    time: float


MetricsRecord = (
    TrainRecord | EvalRecord | CheckpointSaveRecord | CheckpointLoadRecord | CheckpointSkippedRecord | StoppedRecord
    | WarningRecord | PreemptedRecord | InterruptedRecord | ResizeRecord | ResizeSaveRecord | StragglerRecord
    | ReplicaStragglerRecord | EvictionRecord | ProfileRecord | MemorySnapshotRecord | DownstreamEvalRecord | DownstreamEvalFailedRecord
    | TextSamplesRecord | GroupStartRecord | ReplicaJoinedRecord | ReplicaLostRecord | MixtureRecord | RollbackRecord
    | StartedFromRecord
)


@dataclass(frozen=True)
class UnknownRecord:
    """A record of a kind this reader does not know (a newer writer's), kept as it is: its kind and its
    other keys."""

    kind: str
    fields: dict[str, Any]


ReadRecord = MetricsRecord | UnknownRecord  # what a reader gets


class RecordKind(NamedTuple):
    record: type[Record]  # the kind's class: its event, its fields
    writer: str
    description: str


def _registry(*kinds: RecordKind) -> dict[str, RecordKind]:
    return {kind.record.event: kind for kind in kinds}


# Every kind of metrics.jsonl record: its class, who writes it, what it says.
RECORD_KINDS: dict[str, RecordKind] = _registry(
    RecordKind(TrainRecord, "rank 0", "a logged step: loss, lr, grad norm, tokens, throughput, step and data-wait "
               "time, FLOPs"),
    RecordKind(EvalRecord, "rank 0", "validation loss and perplexity, overall and per source"),
    RecordKind(CheckpointSaveRecord, "rank 0", "a committed checkpoint: path, blocking and total seconds, bytes, mode"),
    RecordKind(CheckpointLoadRecord, "rank 0", "the checkpoint a start resumed from, and how long the load took"),
    RecordKind(CheckpointSkippedRecord, "rank 0", "a save step the step guard skipped"),
    RecordKind(StoppedRecord, "rank 0", "the step guard stopped the run, and why"),
    RecordKind(WarningRecord, "rank 0", "a setting that measurement shows cannot work, named"),
    RecordKind(PreemptedRecord, "rank 0", "a preemption notice: the ranks, the save and its seconds"),
    RecordKind(InterruptedRecord, "rank 0", "the driver's stop request: the step saved"),
    RecordKind(ResizeRecord, "rank 0", "the worker group changed size: from, to, why"),
    RecordKind(ResizeSaveRecord, "rank 0", "the save made before Ray grows the group"),
    RecordKind(StragglerRecord, "rank 0", "a rank slower than its peers: rank, node, slowdown"),
    RecordKind(ReplicaStragglerRecord, "rank 0", "fault_tolerance.mode=replica (rank 0 of the first live group): a "
               "replica group slower than the others: its index, slowdown"),
    RecordKind(EvictionRecord, "rank 0", "a straggler's node drained: accepted or why not"),
    RecordKind(ProfileRecord, "rank 0", "a profiler window: its trace and top ops"),
    RecordKind(MemorySnapshotRecord, "rank 0", "a CUDA allocator snapshot written at the end of the steps"),
    RecordKind(DownstreamEvalRecord, "the driver", "one checkpoint's lm-evaluation-harness scores per task"),
    RecordKind(DownstreamEvalFailedRecord, "the driver", "one checkpoint's evaluation failed, and why"),
    RecordKind(TextSamplesRecord, "the driver", "one checkpoint's continuations of the fixed prompts"),
    RecordKind(GroupStartRecord, "rank 0", "a worker group started: how many times Ray restarted this launch's "
               "group before"),
    RecordKind(ReplicaJoinedRecord, "rank 0", "fault_tolerance.mode=replica (rank 0 of the joining group): a "
               "replica group joined by receiving a live peer's state"),
    RecordKind(ReplicaLostRecord, "rank 0", "fault_tolerance.mode=replica (rank 0 of the first live group): a step "
               "trained with fewer live replica groups than the one before"),
    RecordKind(MixtureRecord, "rank 0", "a logged step of a data mixture: each source's share of the samples "
               "trained since the previous one"),
    RecordKind(StartedFromRecord, "rank 0", "checkpoint.start_from: the checkpoint a new run started from (its run, "
               "step, fingerprint, learning rate)"),
    RecordKind(RollbackRecord, "rank 0", "repeated spikes rolled the run back to a checkpoint: the steps skipped, "
               "the samples left out from now on"),
)


def _kind_of(document: Mapping[str, Any]) -> tuple[object, RecordKind | None]:
    """A JSON object's ``event`` and the kind it names (None: no kind, or one this reader does not know)."""
    event = document.get("event")
    return event, RECORD_KINDS.get(event) if isinstance(event, str) else None


def parse_record(document: Mapping[str, Any]) -> ReadRecord | None:
    """The record a JSON object of ``metrics.jsonl`` holds: its kind's class, an :class:`UnknownRecord`
    for a kind this reader does not know, None for an object without a kind or a record of a known kind
    that lacks a key of it (malformed). With :func:`check_record`, the one place that reads ``event``."""
    event, kind = _kind_of(document)
    if kind is not None:
        record: MetricsRecord | None = _codec(kind.record).decode(document)
        return record
    if isinstance(event, str):
        return UnknownRecord(event, {key: value for key, value in document.items() if key != "event"})
    return None


def check_record(document: Mapping[str, Any]) -> list[str]:
    """Where one JSON object departs from the protocol: an unknown kind, a missing key of its kind, a key
    its kind does not have; [] when it conforms. Values are not checked, but for a flattened field's keys
    (floats)."""
    event, kind = _kind_of(document)
    if kind is None:
        return [f"unknown kind {event!r}"]
    codec = _codec(kind.record)
    return [f"{event}: missing {key!r}" for key in sorted(codec.required - document.keys())] + [
        f"{event}: unknown {key!r}" for key, value in document.items()
        if key not in codec.head and key not in codec.known and (codec.flat is None or not isinstance(value, float))
    ]


def record_items(record: ReadRecord) -> tuple[str, dict[str, Any]]:
    """A record's kind and its other keys as its JSON object has them: for a reader that shows a record
    it has no use of its own for (the progress line)."""
    if isinstance(record, UnknownRecord):
        return record.kind, record.fields
    fields = record.to_json()
    del fields["event"]
    return record.event, fields


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
    def result(self) -> Path:
        """Rank 0's account of the training, for the driver's summary."""
        return self.run_dir / "result.json"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def worker_starts(self) -> Path:
        return self.run_dir / "worker_starts.jsonl"

    @property
    def left_out(self) -> Path:
        """The samples rollbacks left out (:class:`LeftOutSamples`), honoured by every later start."""
        return self.run_dir / "left_out_samples.json"

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

    def record(self, record: JsonObject) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record.to_json()) + "\n").encode())

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


def append_records(path: Path, records: Iterable[JsonObject]) -> None:
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


R = TypeVar("R", bound=Record)
Kinds = type[Record] | tuple[type[Record], ...]


def _parsed(lines: Iterable[bytes | str], kinds: Kinds | None) -> list[Any]:
    records = (parse_record(document) for document in _json_objects(lines))
    if kinds is None:
        return [record for record in records if record is not None]
    return [record for record in records if isinstance(record, kinds)]


@overload
def read_records(path: Path, kinds: None = None) -> list[ReadRecord]: ...
@overload
def read_records(path: Path, kinds: type[R] | tuple[type[R], ...]) -> list[R]: ...
def read_records(path: Path, kinds: Kinds | None = None) -> list[Any]:
    """Every record of a run's ``metrics.jsonl`` (of the classes ``kinds`` only, when given), in order;
    [] before the first one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parsed(data.split(b"\n"), kinds)


class RecordFollower:
    """The records of some kinds appended since the last call (another process's): the driver's progress
    line and tracker relay, and rank 0 passing the driver's downstream results to TensorBoard."""

    def __init__(self, path: Path, kinds: Kinds | None = None, from_end: bool = False) -> None:
        """``kinds``: the classes to return (all, with unknown kinds, when None). ``from_end``: only records
        appended after now (a resumed run's earlier lines are not new)."""
        self.path, self.kinds = path, kinds
        self._offset = path.stat().st_size if from_end and path.exists() else 0
        self._partial = b""

    def new_records(self) -> list[ReadRecord]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return _parsed(lines, self.kinds)


# --- left_out_samples.json ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LeftOutSamples(JsonObject):
    """Samples a rollback left out: ``[start, stop)`` of stage ``stage``'s own sequence (None: a run
    without data.stages), with the source counts among them."""

    stage: str | None
    start: int
    stop: int
    rollback: int  # which of the run's rollbacks left it out (1, 2, ...)
    step: int  # the step whose reading called for the rollback
    rolled_back_to: int
    sources: dict[str, int]  # the samples of each source among them


def read_left_out(path: Path) -> list[LeftOutSamples]:
    """The ranges rollbacks left out ([] before the first); a damaged file is one line (ConfigError)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        document = exc
    entries: list[LeftOutSamples] = []
    for item in document if isinstance(document, list) else [None]:
        entry = _codec(LeftOutSamples).decode(item) if isinstance(item, dict) else None
        if not (entry is not None and type(entry.start) is int and type(entry.stop) is int
                and 0 <= entry.start < entry.stop and (entry.stage is None or isinstance(entry.stage, str))):
            shown = one_line(document, 120) if isinstance(document, Exception) else "an entry is not a left-out range"
            raise ConfigError(
                f"{path} is damaged ({shown}); restore it from the rollback records in metrics.jsonl (their left_out "
                "lists), or list the ranges in data.skip_samples and delete the file"
            )
        entries.append(entry)
    return entries


def write_left_out(path: Path, entries: Iterable[LeftOutSamples]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps([entry.to_json() for entry in entries], indent=1) + "\n")


# --- result.json and summary.json ----------------------------------------------------------------


class Placement(TypedDict):
    rank: int
    node_rank: int
    local_rank: int
    node_ip: str
    pid: int


class Resize(TypedDict):
    time: float
    from_workers: int
    to_workers: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult(JsonObject):
    """``result.json``: what rank 0's training did, written by rank 0 when training ends; the driver's
    ``summary.json`` is it and the driver's own keys."""

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
    workers: list[Placement]
    resizes: list[Resize]
    device: str
    peak_device_memory_bytes: int | None = None  # GPU workers
    num_alloc_retries: int | None = None  # GPU workers
    peak_host_rss_bytes: int | None = None  # CPU workers


def write_result(paths: RunPaths, result: RunResult) -> None:
    write_atomically(paths.result, json.dumps(result.to_json(), indent=2) + "\n")


def read_result(paths: RunPaths) -> RunResult:
    """Rank 0's result; ValueError when the file lacks a key (not written by this version)."""
    result: RunResult | None = _codec(RunResult).decode(json.loads(paths.result.read_text()))
    if result is None:
        raise ValueError(f"{paths.result} lacks keys of a training result")
    return result


class Summary(TypedDict, total=False):
    """``summary.json``: rank 0's :class:`RunResult` (its keys), and the driver's: ``wall_time_s``,
    ``goodput``, ``replica_groups`` and ``downstream``. Written by the driver alone (:func:`write_summary`)."""

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
    workers: list[Placement]
    resizes: list[Resize]
    device: str
    peak_device_memory_bytes: int
    num_alloc_retries: int
    peak_host_rss_bytes: int
    wall_time_s: float
    goodput: GoodputReport  # the driver's, from this launch's records (meshtrain.observe.goodput)
    replica_groups: int  # fault_tolerance.mode=replica (the driver's): mesh_shape and world_size are one group's
    downstream: dict[str, Any]  # the newest downstream_eval record per task
    left_out_samples: list[dict[str, Any]]  # the driver's: data.skip_samples and the rollbacks' ranges
    started_from: dict[str, Any]  # the driver's: checkpoint.start_from's run, step, path, fingerprint, lr


def write_summary(
    paths: RunPaths,
    result: RunResult,
    wall_time_s: float,
    goodput: GoodputReport,
    replica_groups: int | None = None,
    downstream: Mapping[str, DownstreamEvalRecord] | None = None,
    left_out: Sequence[Mapping[str, Any]] = (),
    started_from: dict[str, Any] | None = None,
) -> Summary:
    """The driver's ``summary.json``: rank 0's result and the driver's keys (``replica_groups`` and
    ``downstream`` when given); returns it."""
    summary = cast(Summary, result.to_json())  # rank 0's keys first, as they were written
    summary["wall_time_s"], summary["goodput"] = wall_time_s, goodput
    if replica_groups is not None:
        summary["replica_groups"] = replica_groups
    if downstream is not None:
        summary["downstream"] = {task: record.to_json() for task, record in downstream.items()}
    if left_out:
        summary["left_out_samples"] = [dict(entry) for entry in left_out]
    if started_from is not None:
        summary["started_from"] = started_from
    write_atomically(paths.summary, json.dumps(summary, indent=2) + "\n")
    return summary


def read_summary(paths: RunPaths) -> Summary:
    summary: Summary = json.loads(paths.summary.read_text())
    return summary


# --- worker_starts.jsonl -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerStart(JsonObject):
    """One start of the worker group (a launch, or Ray Train restarting the group)."""

    launch: str
    time: float
    world_size: int
    workers: list[Placement]
    replica: int | None = None  # fault_tolerance.mode=replica: the replica group that started
    resized_from: int | None = None  # when this start's size differs from the run's previous one
    resize_reason: str | None = None


def append_worker_start(paths: RunPaths, start: WorkerStart) -> None:
    append_records(paths.worker_starts, [start])


def read_worker_starts(paths: RunPaths) -> list[WorkerStart]:
    """Every start so far, in order; a torn line and a line without a start's keys are skipped."""
    try:
        data = paths.worker_starts.read_bytes()
    except FileNotFoundError:
        return []
    codec = _codec(WorkerStart)
    return [start for start in map(codec.decode, _json_objects(data.split(b"\n"))) if start is not None]


# --- stop_request.json ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _StopRequestFile(JsonObject):
    launch: str
    reason: str | None = None
    time: float | None = None


@dataclass(frozen=True)
class StopRequest:
    """The driver's request that one launch's workers save and stop: a small JSON file in the run
    directory (storage every node sees), naming the launch so a later launch of the run ignores it."""

    path: str
    launch_id: str

    def write(self, reason: str) -> None:
        request = _StopRequestFile(launch=self.launch_id, reason=reason, time=time.time())
        write_atomically(self.path, json.dumps(request.to_json()))

    def read(self) -> str | None:
        """The reason of a request for this launch, or None."""
        try:
            document = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            return None
        request: _StopRequestFile | None = _codec(_StopRequestFile).decode(document) if isinstance(document, dict) else None
        if request is None or request.launch != self.launch_id:
            return None
        return str(request.reason or "interrupted")

    def clear(self) -> None:
        Path(self.path).unlink(missing_ok=True)
