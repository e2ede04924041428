"""The run folder's protocol: every shared file has one writer and one reader, and both sides agree."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from meshtrain.config.loading import load_config
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.progress import StepRecorder
from meshtrain.observe import run_folder
from meshtrain.observe.run_folder import (
    RECORD_KINDS,
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    CheckpointSkippedRecord,
    DownstreamEvalFailedRecord,
    DownstreamEvalRecord,
    EvalRecord,
    GroupStartRecord,
    InterruptedRecord,
    MemorySnapshotRecord,
    MixtureRecord,
    Placement,
    PreemptedRecord,
    ProfileRecord,
    Record,
    RecordFollower,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    ResizeRecord,
    ResizeSaveRecord,
    RunPaths,
    RunResult,
    StopRequest,
    StoppedRecord,
    StragglerRecord,
    TextSample,
    TextSamplesRecord,
    TrainRecord,
    UnknownRecord,
    WarningRecord,
    WorkerStart,
    append_records,
    append_worker_start,
    check_record,
    parse_record,
    read_records,
    read_result,
    read_summary,
    read_worker_starts,
    write_result,
    write_summary,
)
from meshtrain.observe.trackers import DRIVER_RECORDS
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from record_samples import example, make
from test_step_guard import corrupt_losses

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "meshtrain"


def test_every_record_kind_written_anywhere_is_in_the_protocol() -> None:
    """Every record class is a registered kind, and every kind is constructed by some writer in the package."""
    classes = {name for name, value in vars(run_folder).items()
               if isinstance(value, type) and issubclass(value, Record) and value is not Record}
    assert classes == {kind.record.__name__ for kind in RECORD_KINDS.values()}, classes
    sources = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py") if path.name != "run_folder.py")
    unwritten = [name for name in classes if not re.search(rf"\b{name}\(", sources)]
    assert unwritten == []
    assert {*DRIVER_RECORDS, GroupStartRecord} <= {kind.record for kind in RECORD_KINDS.values()}
    assert all(RECORD_KINDS[kind.event].writer == "the driver" for kind in DRIVER_RECORDS)


def test_readers_skip_a_torn_line_and_keep_kinds_they_do_not_know(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    stopped = StoppedRecord(step=1, reason="why")
    append_records(path, [stopped])
    with path.open("a") as file:  # a newer writer's kind; a known kind lacking a key of it
        file.write('{"event": "from_a_newer_writer", "step": 1}\n{"event": "stopped", "step": 2}\n')
    with path.open("ab") as file:
        file.write(b'{"event": "stopped", "st')  # a writer killed mid-line
    newer = UnknownRecord("from_a_newer_writer", {"step": 1})
    assert read_records(path) == [stopped, newer]
    assert read_records(path, StoppedRecord) == [stopped]
    assert read_records(path, (StoppedRecord, TrainRecord)) == [stopped]
    assert read_records(tmp_path / "absent.jsonl") == []
    assert parse_record({"step": 1}) is None
    assert parse_record({**stopped.to_json(), "from_a_newer_writer": 1}) == stopped  # a key it does not know


def test_a_follower_sees_each_appended_record_once_and_a_line_only_when_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first, second = StoppedRecord(step=1, reason="a"), StoppedRecord(step=2, reason="b")
    append_records(path, [first])
    resumed, everything = RecordFollower(path, from_end=True), RecordFollower(path, StoppedRecord)
    assert resumed.new_records() == [] and everything.new_records() == [first]
    with path.open("ab") as file:
        file.write(b'{"event": "stopped", "step": 2')
    assert resumed.new_records() == everything.new_records() == []
    with path.open("ab") as file:
        file.write(b', "reason": "b"}\n')
    assert resumed.new_records() == everything.new_records() == [second]


def test_records_encode_to_the_keys_of_their_kind_and_parse_back() -> None:
    """Each kind's JSON object: ``event`` first, its keys in its fields' order, an optional key only when
    set, a downstream evaluation's scores as keys of their own; parsing gives the same record back."""
    for kind in RECORD_KINDS.values():
        full, bare = example(kind.record), make(kind.record)
        for record in (full, bare):
            document = json.loads(json.dumps(record.to_json()))
            assert check_record(document) == [] and parse_record(document) == record, document
            assert next(iter(document)) == "event" and document["event"] == kind.record.event
    train = make(TrainRecord, step=3)
    assert list(train.to_json())[-1] == "samples"  # no FLOPs, not replica mode: those keys are left out
    assert list(example(TrainRecord).to_json())[-5:] == [
        "flops_per_token", "flops_per_token_full_attention", "replica_wait_s", "replicas", "stage"]
    scored = DownstreamEvalRecord(step=4, task="hellaswag", scores={"acc": 0.25}, samples=None, seconds=1.0, time=2.0)
    assert scored.to_json() == {"event": "downstream_eval", "step": 4, "task": "hellaswag", "acc": 0.25,
                                "samples": None, "seconds": 1.0, "time": 2.0}


def test_summary_worker_starts_and_stop_requests_round_trip(tmp_path: Path) -> None:
    paths = RunPaths("r", tmp_path)
    paths.run_dir.mkdir()
    result = example(RunResult)
    write_result(paths, result)
    assert read_result(paths) == result
    goodput = {"goodput": 0.5, "wall_s": 2.0, "productive_s": 1.0, "lost_s": {"start_up": 1.0}}
    scored = example(DownstreamEvalRecord)
    summary = write_summary(paths, result, wall_time_s=3.0, goodput=goodput, replica_groups=2,
                            downstream={scored.task: scored})
    assert read_summary(paths) == summary == {**result.to_json(), "wall_time_s": 3.0, "goodput": goodput,
                                              "replica_groups": 2, "downstream": {scored.task: scored.to_json()}}
    assert list(summary)[:2] == ["run", "steps"]  # rank 0's keys first, then the driver's
    assert write_summary(paths, result, 3.0, goodput).keys() == {*result.to_json(), "wall_time_s", "goodput"}
    placement = Placement(rank=0, node_rank=0, local_rank=0, node_ip="10.0.0.1", pid=7)
    append_worker_start(paths, WorkerStart(launch="a", time=1.0, world_size=1, workers=[placement]))
    with paths.worker_starts.open("ab") as file:
        file.write(b'{"launch": "b", "ti')
    assert read_worker_starts(paths) == [WorkerStart(launch="a", time=1.0, world_size=1, workers=[placement])]
    request, later = StopRequest(str(paths.stop_request), "a"), StopRequest(str(paths.stop_request), "b")
    assert request.read() is None
    request.write("Ctrl-C")
    assert request.read() == "Ctrl-C" and later.read() is None  # a later launch ignores an earlier request
    assert json.loads(paths.stop_request.read_text()).keys() == {"launch", "reason", "time"}
    request.clear()
    assert request.read() is None


def test_every_record_kind_is_a_frozen_dataclass_whose_event_is_the_kind() -> None:
    for kind, entry in RECORD_KINDS.items():
        params = entry.record.__dataclass_params__
        assert dataclasses.is_dataclass(entry.record) and params.frozen, kind
        assert entry.record.event == kind and "event" not in {field.name for field in dataclasses.fields(entry.record)}
        assert entry.writer in ("rank 0", "the driver"), kind


def test_check_record_names_missing_and_unknown_keys() -> None:
    assert check_record({"event": "stopped", "step": 6, "reason": "why"}) == []
    assert check_record({"event": "stopped", "step": 6, "why": "?"}) == ["stopped: missing 'reason'", "stopped: unknown 'why'"]
    assert check_record({"event": "from_a_newer_writer", "step": 1}) == ["unknown kind 'from_a_newer_writer'"]
    assert check_record({"step": 1}) == ["unknown kind None"]
    scored = {"event": "downstream_eval", "step": 4, "task": "hellaswag", "samples": 8, "seconds": 1.0, "time": 1.0}
    assert check_record({**scored, "acc": 0.25}) == []  # a harness metric: any other key with a float
    assert check_record({**scored, "note": "text"}) == ["downstream_eval: unknown 'note'"]


def test_the_records_a_trainer_writes_to_metrics_jsonl_conform(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU run in this process, with the StepRecorder the worker gives it: logged steps, evaluations, a
    profile window, a save budget warning, saves, a skipped save and a stop (NaN losses from step 4),
    then a resume."""
    paths = RunPaths("protocol", tmp_path)

    def run(steps: int) -> None:
        cfg = load_config(None, [
            f"train.steps={steps}", "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.max_bad_steps=3", "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24",
            "optim.warmup_steps=2", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.document_mask=false", "scaling.num_workers=1", "checkpoint.interval=2", "checkpoint.mode=sync",
            "eval.interval=3", "eval.batches=1", "profile.start_step=1", "profile.active_steps=1",
            "run.preemption_save_s=0.000001", f"run.storage_path={tmp_path}", f"run.name={paths.name}",
        ])
        recorder = StepRecorder(paths.metrics)
        try:
            train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"), recorder.record)
        finally:
            recorder.close()

    with monkeypatch.context() as patched:
        corrupt_losses(patched, math.nan, None, from_step=4)
        run(6)
    run(3)
    records = read_records(paths.metrics)
    assert {type(record) for record in records} >= {  # and any kind added since, which the lines below check too
        TrainRecord, EvalRecord, ProfileRecord, WarningRecord, CheckpointSaveRecord, CheckpointSkippedRecord,
        StoppedRecord, CheckpointLoadRecord}
    assert not [record for record in records if isinstance(record, UnknownRecord)]
    lines = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [problem for line in lines for problem in check_record(line)] == []
    assert [parse_record(line) for line in lines] == records


def test_the_kinds_a_cpu_run_does_not_write_conform() -> None:
    """One record of each other kind, as its writer builds it (every kind's encoding and parsing:
    test_records_encode_to_the_keys_of_their_kind_and_parse_back)."""
    from meshtrain.cluster.eviction import StragglerEviction
    from meshtrain.evaluate.harness import downstream_records
    from meshtrain.train.records import LoopOutputs
    from meshtrain.train.stragglers import ComputeTimer, StragglerWatch

    records: list[Record] = []
    watch = StragglerWatch(ComputeTimer([], torch.device("cpu")), 1.5, 1, 0, "10.0.0.1",
                           LoopOutputs(records.append, None, None), None)
    watch.observe(5, [(1.0, "10.0.0.1"), (3.0, "10.0.0.2")])
    workers = [Placement(rank=0, node_rank=0, local_rank=0, node_ip="10.0.0.1", pid=1),
               Placement(rank=1, node_rank=1, local_rank=0, node_ip="10.0.0.2", pid=2)]
    straggler = records[0]
    assert isinstance(straggler, StragglerRecord)
    StragglerEviction(workers, 1, records.append, drain=lambda *_: (True, ""), find_node=lambda ip: f"id-{ip}")(straggler)
    StragglerEviction(workers, 2, records.append)(straggler)  # refused: no node_id
    results = {"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.1,
                                         "acc_norm,none": 0.5}},
               "n-samples": {"hellaswag": {"original": 100, "effective": 8}}}
    now = time.time()
    records += downstream_records(results, 4, 2.5)
    rows = [TextSample(prompt="def", continuation=" main():", new_tokens=3, stopped_at_eos=False)]
    records += [
        TextSamplesRecord(step=4, samples=rows, seconds=0.5, time=now),
        DownstreamEvalFailedRecord(step=4, error="RuntimeError: injected", time=now),
        PreemptedRecord(step=6, reason="SIGTERM", ranks=[1], saved=True, save_s=0.2),
        PreemptedRecord(step=6, reason="SIGTERM", ranks=[1], saved=True, save_s=0.2, notice_to_commit_s=1.5),
        InterruptedRecord(step=4, saved=True, reason="SIGINT to the driver"),
        ResizeSaveRecord(step=8, saved=True, save_s=0.3),
        ResizeRecord(time=now, from_workers=4, to_workers=2, reason="capacity lost"),
        GroupStartRecord(restarts=1, workers=2, time=now),
        ReplicaJoinedRecord(step=7, replica=1, participants=2, seconds=1.5, source=0, bytes=4096, time=now),
        ReplicaLostRecord(step=5, participants=1, replicas=2, stall_s=3.1, quorum_s=1.2, time=now),
        MemorySnapshotRecord(step=3, rank=0, path="memory/rank0.step3.end.pickle"),
        MixtureRecord(step=10, samples=[0, 80], sources={"web": 0.75, "code": 0.25}),
        MixtureRecord(step=20, samples=[80, 160], sources={"web": 0.5, "code": 0.5}, stage="late",
                      target={"web": 0.5, "code": 0.5}),
    ]
    documents = [json.loads(json.dumps(record.to_json())) for record in records]
    assert [problem for document in documents for problem in check_record(document)] == []
    assert [parse_record(document) for document in documents] == records
    assert documents[1]["node_id"] == "id-10.0.0.2" and "node_id" not in documents[2]
    assert documents[3] == {"event": "downstream_eval", "step": 4, "task": "hellaswag", "acc": 0.25, "acc_norm": 0.5,
                            "samples": 8, "seconds": 2.5, "time": documents[3]["time"]}
