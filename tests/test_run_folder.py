"""The run folder's protocol: every shared file has one writer and one reader, and both sides agree."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any, get_args, get_type_hints, is_typeddict

import pytest
import torch

from meshtrain.config.loading import load_config
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.progress import StepRecorder
from meshtrain.observe.run_folder import (
    RECORD_KINDS,
    RecordFollower,
    RunPaths,
    StopRequest,
    append_records,
    append_worker_start,
    check_record,
    read_records,
    read_summary,
    read_worker_starts,
    write_summary,
)
from meshtrain.observe.trackers import DRIVER_EVENTS
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from test_step_guard import corrupt_losses

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "meshtrain"


def test_every_record_kind_written_anywhere_is_in_the_protocol() -> None:
    written = {match for path in PACKAGE.rglob("*.py")
               for match in re.findall(r'(?:"event": |\bevent=)"([a-z_]+)"', path.read_text())}
    assert written == RECORD_KINDS.keys(), written ^ RECORD_KINDS.keys()
    assert {*DRIVER_EVENTS, "group_start"} <= RECORD_KINDS.keys()
    assert all(RECORD_KINDS[kind].writer == "the driver" for kind in DRIVER_EVENTS)


def test_readers_skip_a_torn_line_and_keep_kinds_they_do_not_know(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append_records(path, [{"event": "train", "step": 1}, {"event": "from_a_newer_writer", "step": 1}])
    with path.open("ab") as file:
        file.write(b'{"event": "train", "st')  # a writer killed mid-line
    assert read_records(path) == [{"event": "train", "step": 1}, {"event": "from_a_newer_writer", "step": 1}]
    assert read_records(path, ["train"]) == [{"event": "train", "step": 1}]
    assert read_records(tmp_path / "absent.jsonl") == []


def test_a_follower_sees_each_appended_record_once_and_a_line_only_when_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append_records(path, [{"event": "train", "step": 1}])
    resumed, everything = RecordFollower(path, from_end=True), RecordFollower(path, ["train"])
    assert resumed.new_records() == [] and everything.new_records() == [{"event": "train", "step": 1}]
    with path.open("ab") as file:
        file.write(b'{"event": "train", "step": 2')
    assert resumed.new_records() == everything.new_records() == []
    with path.open("ab") as file:
        file.write(b"}\n")
    assert resumed.new_records() == everything.new_records() == [{"event": "train", "step": 2}]


def test_summary_worker_starts_and_stop_requests_round_trip(tmp_path: Path) -> None:
    paths = RunPaths("r", tmp_path)
    paths.run_dir.mkdir()
    write_summary(paths, {"run": "r", "steps": 10, "final_loss": 4.5})
    assert read_summary(paths) == {"run": "r", "steps": 10, "final_loss": 4.5}
    placement = {"rank": 0, "node_rank": 0, "local_rank": 0, "node_ip": "10.0.0.1", "pid": 7}
    append_worker_start(paths, {"launch": "a", "time": 1.0, "world_size": 1, "workers": [placement]})
    with paths.worker_starts.open("ab") as file:
        file.write(b'{"launch": "b", "ti')
    assert [start["launch"] for start in read_worker_starts(paths)] == ["a"]
    request, later = StopRequest(str(paths.stop_request), "a"), StopRequest(str(paths.stop_request), "b")
    assert request.read() is None
    request.write("Ctrl-C")
    assert request.read() == "Ctrl-C" and later.read() is None  # a later launch ignores an earlier request
    request.clear()
    assert request.read() is None


def test_every_record_kind_has_a_typed_dict_whose_event_is_the_kind() -> None:
    for kind, entry in RECORD_KINDS.items():
        assert is_typeddict(entry.schema), kind
        assert get_args(get_type_hints(entry.schema)["event"]) == (kind,), kind
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
    assert {record["event"] for record in records} == {
        "train", "eval", "profile", "warning", "checkpoint_save", "checkpoint_skipped", "stopped", "checkpoint_load"}
    assert [problem for record in records for problem in check_record(record)] == []


def test_the_kinds_a_cpu_run_does_not_write_conform() -> None:
    """One record of each other kind, as its writer builds it."""
    from meshtrain.cluster.eviction import StragglerEviction
    from meshtrain.evaluate.harness import downstream_records
    from meshtrain.train.records import LoopOutputs
    from meshtrain.train.stragglers import ComputeTimer, StragglerWatch

    records: list[dict[str, Any]] = []
    watch = StragglerWatch(ComputeTimer([], torch.device("cpu")), 1.5, 1, 0, "10.0.0.1",
                           LoopOutputs(records.append, None, None), None)
    watch.observe(5, [(1.0, "10.0.0.1"), (3.0, "10.0.0.2")])
    workers = [{"rank": 0, "node_ip": "10.0.0.1"}, {"rank": 1, "node_ip": "10.0.0.2"}]
    StragglerEviction(workers, 1, records.append, drain=lambda *_: (True, ""), find_node=lambda ip: f"id-{ip}")(records[0])
    StragglerEviction(workers, 2, records.append)(records[0])  # refused: no node_id
    results = {"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.1,
                                         "acc_norm,none": 0.5}},
               "n-samples": {"hellaswag": {"original": 100, "effective": 8}}}
    now = time.time()
    records += [{**record, "time": now} for record in downstream_records(results, 4, 2.5)]
    rows = [{"prompt": "def", "continuation": " main():", "new_tokens": 3, "stopped_at_eos": False}]
    records += [
        {"event": "text_samples", "step": 4, "samples": rows, "seconds": 0.5, "time": now},
        {"event": "downstream_eval_failed", "step": 4, "error": "RuntimeError: injected", "time": now},
        {"event": "preempted", "step": 6, "reason": "SIGTERM", "ranks": [1], "saved": True, "save_s": 0.2},
        {"event": "preempted", "step": 6, "reason": "SIGTERM", "ranks": [1], "saved": True, "save_s": 0.2,
         "notice_to_commit_s": 1.5},
        {"event": "interrupted", "step": 4, "saved": True, "reason": "SIGINT to the driver"},
        {"event": "resize_save", "step": 8, "saved": True, "save_s": 0.3},
        {"event": "resize", "time": now, "from_workers": 4, "to_workers": 2, "reason": "capacity lost"},
        {"event": "group_start", "restarts": 1, "workers": 2, "time": now},
        {"event": "replica_joined", "step": 7, "replica": 1, "participants": 2, "seconds": 1.5, "source": 0,
         "bytes": 4096, "time": now},
        {"event": "replica_lost", "step": 5, "participants": 1, "replicas": 2, "stall_s": 3.1, "quorum_s": 1.2,
         "time": now},
        {"event": "memory_snapshot", "step": 3, "rank": 0, "path": "memory/rank0.step3.end.pickle"},
        {"event": "mixture", "step": 10, "samples": [0, 80], "sources": {"web": 0.75, "code": 0.25}},
    ]
    assert {record["event"] for record in records} | {
        "train", "eval", "profile", "warning", "checkpoint_save", "checkpoint_skipped", "stopped", "checkpoint_load"
    } == RECORD_KINDS.keys()
    assert [problem for record in records for problem in check_record(record)] == []
