"""The run folder's protocol: every shared file has one writer and one reader, and both sides agree."""

from __future__ import annotations

import re
from pathlib import Path

from meshtrain.observe.run_folder import (
    RECORD_KINDS,
    RecordFollower,
    RunPaths,
    StopRequest,
    append_records,
    append_worker_start,
    read_records,
    read_summary,
    read_worker_starts,
    write_summary,
)
from meshtrain.observe.trackers import DRIVER_EVENTS

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "meshtrain"


def test_every_record_kind_written_anywhere_is_in_the_protocol() -> None:
    written = {match for path in PACKAGE.rglob("*.py")
               for match in re.findall(r'"event": "([a-z_]+)"', path.read_text())}
    assert written and written <= RECORD_KINDS.keys(), written - RECORD_KINDS.keys()
    assert {*DRIVER_EVENTS, "group_start"} <= RECORD_KINDS.keys()
    assert all(RECORD_KINDS[kind][0] == "the driver" for kind in DRIVER_EVENTS)


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
