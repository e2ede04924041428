"""Hang watchdog and its diagnosis from torch's flight recorder, the memory snapshot of a step that
runs out of CUDA memory, Ray Train reports spaced by time but taken at the same steps, TensorBoard files."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshtrain.train.parts as parts_module
import meshtrain.train.trainer as trainer_module
from corpora import stdlib_plan
from meshtrain.cluster.failures import root_failure
from meshtrain.config.loading import load_config
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.distributed.plan import GIB, memory_plan, planned_mesh
from meshtrain.model.args import model_args
from meshtrain.observe.reporting import RayTrainReporter, TensorBoardWriter
from meshtrain.observe.run_folder import EvalRecord, MemorySnapshotRecord, Record, TrainRecord
from meshtrain.train.hangs import DIAGNOSIS, HangReport, RankDump, diagnose
from meshtrain.train.memory_snapshot import DeviceOutOfMemory
from meshtrain.train.trainer import train
from meshtrain.train.watchdog import HangWatchdog
from meshtrain.cluster.worker_plan import worker_plan
from ranks import run_on_ranks
from record_samples import make


def test_the_watchdog_fires_once_armed_and_silent_and_not_while_progress_continues() -> None:
    fired: list[str] = []
    watchdog = HangWatchdog(0.4, rank=3, on_hang=fired.append)
    try:
        time.sleep(0.8)
        assert fired == []  # not armed before the first step ends
        for step in range(8):
            watchdog.beat(f"training step {step}", arm=True)
            time.sleep(0.1)
        assert fired == []
        watchdog.beat("saving the checkpoint of step 8")
        time.sleep(1.0)
    finally:
        watchdog.close()
    assert len(fired) == 1
    assert fired[0].startswith("[meshtrain] rank 3: no progress for ")
    assert "while saving the checkpoint of step 8 (run.hang_timeout_s=0.4)" in fired[0]


def test_a_firing_watchdog_reports_before_it_exits_even_when_the_report_fails() -> None:
    calls: list[tuple[str, Any]] = []

    def report(doing: str, silent_s: float) -> None:
        calls.append(("report", (doing, silent_s)))
        raise OSError("storage full")

    watchdog = HangWatchdog(0.2, rank=1, on_hang=lambda message: calls.append(("exit", message)),
                            report=report)  # type: ignore[arg-type]
    try:
        watchdog.beat("training step 3", arm=True)
        time.sleep(0.6)
    finally:
        watchdog.close()
    assert [kind for kind, _ in calls] == ["report", "exit"]
    assert calls[0][1][0] == "training step 3" and calls[0][1][1] > 0.2


def test_an_excused_wait_never_fires_and_a_firing_watchdog_first_runs_on_fire() -> None:
    """A replica group's worker waits in the quorum under the quorum's own timeout (excused), and when its
    watchdog fires it first leaves the quorum (on_fire), then reports and exits."""
    calls: list[str] = []
    watchdog = HangWatchdog(0.2, rank=0, on_hang=lambda message: calls.append("exit"),
                            report=lambda doing, silent_s: calls.append(f"report {doing}"),  # type: ignore[arg-type]
                            on_fire=lambda: calls.append("leave"))
    try:
        watchdog.beat("training step 3", arm=True)
        with watchdog.excused("waiting for the replica quorum"):
            time.sleep(0.7)
        assert calls == []  # the wait took 3.5 timeouts, and the clock restarted after it
        time.sleep(0.6)
    finally:
        watchdog.close()
    assert calls == ["leave", "report waiting for the replica quorum", "exit"]


# --- where a hang is stuck: the flight recorder's collectives -------------------------------------


def _hang_in_an_all_reduce(rank: int, world_size: int, folder: str) -> list[str]:
    """Rank 1 stops before the fourth all-reduce of a group; rank 0 enters it and its watchdog
    thread reports; rank 1 reports too (a sleeping rank's watchdog runs), then lets rank 0 go."""
    group = dist.new_group([0, 1], group_desc="mesh_dp_shard")
    tensor = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(tensor, group=group)
    lines: list[str] = []
    report = HangReport(Path(folder), rank, world_size, wait_s=30, log=lines.append)
    if rank == 0:
        watchdog = threading.Thread(target=lambda: (time.sleep(1.0), report("training step 4", 1.0)))
        watchdog.start()
        dist.all_reduce(tensor, group=group)
        watchdog.join()
    else:
        time.sleep(1.0)
        report("training step 4", 1.0)
        dist.all_reduce(tensor, group=group)
    return lines


def test_the_flight_recorder_names_the_gloo_collective_and_the_rank_that_never_entered_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13 records gloo's collectives too: a real two-process group, as Ray's workers run it."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the spawned ranks inherit it
    lines = run_on_ranks(_hang_in_an_all_reduce, 2, str(tmp_path))
    assert lines[1] == []  # the lowest rank that wrote a dump reports
    [line] = lines[0]
    assert re.fullmatch(
        r"\[meshtrain\] hang: gloo:all_reduce #4 on process group \S+ \(mesh_dp_shard, ranks 0-1\) never completed: "
        r"rank 0 waits in it; rank 1 never entered it \(last there: #3, while training step 4\); "
        rf"dumps in {re.escape(str(tmp_path))}", line), line
    assert (tmp_path / DIAGNOSIS).read_text() == line + "\n"
    dumps = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    retired = [e["retired"] for e in dumps[0]["entries"] if e["process_group"][1] == "mesh_dp_shard"]
    assert retired == [True, True, True, False]
    assert dumps[1]["groups"]["0"] == {"desc": "default_pg", "ranks": [0, 1]}


def _entry(group: str, seq: int, done: bool = True, op: str = "gloo:all_gather", created: int = 0) -> dict[str, Any]:
    return {"process_group": [group, ""], "collective_seq_id": seq, "profiling_name": op, "retired": done,
            "state": "scheduled", "is_p2p": False, "time_created_ns": created}


def _dump(rank: int, groups: dict[str, list[int]], *entries: dict[str, Any]) -> RankDump:
    return RankDump.parse({"rank": rank, "doing": "training step 7", "entries": list(entries),
                           "groups": {name: {"desc": f"g{name}", "ranks": ranks} for name, ranks in groups.items()}})


def test_the_diagnosis_follows_a_chain_of_waits_to_the_rank_that_waits_in_nothing() -> None:
    """Four ranks on a 2x2 mesh: rank 0 waits in a replicate all-reduce for rank 2, which waits in a
    shard all-gather for rank 3, which is in no collective; rank 1 wrote nothing."""
    groups = {"2": [0, 1], "3": [2, 3], "4": [0, 2], "5": [1, 3]}
    dumps = {
        0: _dump(0, {n: groups[n] for n in ("2", "4")}, _entry("2", 19), _entry("4", 8),
                 _entry("4", 9, done=False, op="gloo:all_reduce")),
        2: _dump(2, {n: groups[n] for n in ("3", "4")}, _entry("4", 8), _entry("3", 19), _entry("3", 20, done=False)),
        3: _dump(3, {n: groups[n] for n in ("3", "5")}, _entry("3", 18), _entry("3", 19), _entry("5", 8)),
    }
    assert diagnose(dumps, 4, Path("/runs/r/hangs")) == (
        "[meshtrain] hang: gloo:all_gather #20 on process group 3 (g3, ranks 2-3) never completed: rank 2 waits in "
        "it; rank 3 never entered it (last there: #19, while training step 7); no dump from rank 1 (frozen, "
        "gone, or still making progress); dumps in /runs/r/hangs"
    )
    # Without rank 3's dump, the all-gather is still where the group is stuck: its member left no trace.
    del dumps[3]
    line = diagnose(dumps, 4, Path("/h"))
    assert "gloo:all_gather #20 on process group 3" in line and "no dump from ranks 1, 3" in line
    # Seen from ranks 0 and 2 alone, the all-reduce (the older wait) is where it stuck; the rank that
    # never entered it waits elsewhere, and the line says where.
    pair = {0: _dump(0, {"4": [0, 2]}, _entry("4", 8), _entry("4", 9, done=False, created=1)),
            2: _dump(2, {"4": [0, 2]}, _entry("4", 8), _entry("3", 20, done=False, created=2))}
    assert diagnose(pair, 3, Path("/h")) == (
        "[meshtrain] hang: gloo:all_gather #9 on process group 4 (g4, ranks 0, 2) never completed: rank 0 waits in "
        "it; rank 2 never entered it (waits in gloo:all_gather #20 on process group 3, while training step 7); no "
        "dump from rank 1 (frozen, gone, or still making progress); dumps in /h"
    )


def test_the_diagnosis_when_no_rank_is_in_a_collective_or_every_member_entered_it() -> None:
    idle = {rank: _dump(rank, {"2": [0, 1]}, _entry("2", 5)) for rank in (0, 1)}
    assert diagnose(idle, 2, Path("/h")) == (
        "[meshtrain] hang: no collective was in flight on the ranks that wrote a dump (rank 0 while training step 7; "
        "rank 1 while training step 7): stuck outside collectives; dumps in /h"
    )
    behind = {rank: _dump(rank, {"2": [0, 1, 2, 3]}, _entry("2", 5), _entry("2", 6, done=False)) if rank == 0
              else _dump(rank, {"2": [0, 1, 2, 3]}, _entry("2", 5)) for rank in range(4)}
    assert diagnose(behind, 4, Path("/h")) == (
        "[meshtrain] hang: gloo:all_gather #6 on process group 2 (g2, ranks 0-3) never completed: rank 0 waits in it; "
        "ranks 1-3 never entered it (last there: #5, while training step 7); dumps in /h"
    )
    entered = {rank: _dump(rank, {"2": [0, 1]}, _entry("2", 6, done=False)) for rank in (0, 1)}
    assert "ranks 0-1 wait in it; every member entered it" in diagnose(entered, 2, Path("/h"))
    with pytest.raises(ValueError, match="not a hang dump"):
        RankDump.parse({"rank": 0, "doing": "x", "groups": {}, "entries": [{"retired": True}]})


def test_a_hang_report_skips_an_earlier_hangs_dumps_and_reports_for_a_frozen_lower_rank(tmp_path: Path) -> None:
    def report(rank: int, lines: list[str], wait_s: float = 0.6) -> HangReport:
        return HangReport(tmp_path, rank, 3, wait_s, log=lines.append,
                          groups=lambda: {"2": {"desc": "", "ranks": [0, 1, 2]}},
                          collectives=lambda: [_entry("2", 4, done=False) if rank == 2 else _entry("2", 3)])

    lines: list[str] = []
    (tmp_path / "rank0.json").write_text("{}")  # an earlier hang's, by its time
    os.utime(tmp_path / "rank0.json", (time.time() - 100, time.time() - 100))
    (tmp_path / "rank1.json").write_text("not json")
    # Rank 0's is an earlier hang's; rank 1's is not a dump, and no diagnosis follows it: rank 2 reports.
    report(2, lines)("training step 5", 10.0)
    assert lines == ["[meshtrain] hang: gloo:all_gather #4 on process group 2 (ranks 0-2) never completed: rank 2 "
                     "waits in it; no dump from ranks 0-1 (frozen, gone, or still making progress); dumps in "
                     f"{tmp_path}"]
    lines.clear()
    report(0, lines)("training step 5", 10.0)  # rank 0 now writes one: it reports
    report(2, lines, wait_s=5.0)("training step 5", 10.0)  # the diagnosis exists: rank 2 adds none of its own
    assert lines == [(tmp_path / DIAGNOSIS).read_text().strip()]
    assert lines[0].startswith("[meshtrain] hang: gloo:all_gather #4 on process group 2 (ranks 0-2) never completed: "
                               "rank 2 waits in it; rank 0 never entered it (last there: #3, while training step 5); "
                               "no dump from rank 1")


def test_reports_are_spaced_by_time_but_always_include_the_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train

    reports: list[dict[str, Any]] = []
    monkeypatch.setattr(ray.train, "report", reports.append)
    record = make(TrainRecord, step=0, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=0, tokens_per_s=9.0, step_time_s=0.1,
                  skipped_steps=0, elapsed_s=1.0)
    spaced = RayTrainReporter(3600.0, rank=0, device=torch.device("cpu"))
    spaced.evaluated(make(EvalRecord, step=2, loss=1.5, perplexity=4.48))
    for step in range(1, 6):
        spaced.logged(replace(record, step=step), last=step == 5)
    assert [r["step"] for r in reports] == [1, 5]
    assert reports[-1]["eval_loss"] == 1.5 and "event" not in reports[-1] and "elapsed_s" not in reports[-1]
    reports.clear()
    every = RayTrainReporter(0.0, rank=0, device=torch.device("cpu"))
    for step in range(1, 4):
        every.logged(replace(record, step=step), last=False)
    assert [r["step"] for r in reports] == [1, 2, 3]
    reports.clear()
    RayTrainReporter(0.0, rank=1, device=torch.device("cpu")).logged(record, last=True)
    assert reports == []  # rank 0 decides; alone, another rank never reports


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalar summaries of TensorBoard event files (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    values: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                values.setdefault(value.tag, []).append((event.step, value.simple_value))
    return values


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path: Path) -> None:
    corpus = stdlib_plan(tmp_path / "stores", validation={"fraction": 0.1})
    cfg = load_config(None, [
        "train.steps=4", "train.log_every=2", "train.global_batch_size=4", "train.micro_batch_size=2",
        "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=1",
        "scaling.num_workers=1", "checkpoint.enabled=false", "eval.interval=2", "eval.batches=1",
    ])
    writer = TensorBoardWriter(tmp_path / "tb")
    records: list[Record] = []

    def both(record: Record) -> None:
        records.append(record)
        writer.record(record)

    train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"), both)
    writer.close()
    found = scalars(tmp_path / "tb")
    train_records = [r for r in records if isinstance(r, TrainRecord)]
    assert found["train/loss"] == [(r.step, pytest.approx(r.loss)) for r in train_records]
    assert [step for step, _ in found["eval/loss"]] == [2, 4]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/perplexity"} <= found.keys()


def test_ray_callbacks_are_checked_with_one_line_errors() -> None:
    from meshtrain.cluster.ray_trainer import load_ray_callbacks
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: expected 'module:Class' entries"):
        load_config(None, ["metrics.ray_callbacks=[WandbCallback]"])
    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: cannot import 'no_such_module:Logger' "):
        load_ray_callbacks(["no_such_module:Logger"])
    with pytest.raises(ConfigError, match=r"^metrics.ray_callbacks: 'json:JSONDecoder' is not a ray.train.UserCallback"):
        load_ray_callbacks(["json:JSONDecoder"])
    [callback] = load_ray_callbacks(["reportlog:ReportLog"])
    assert type(callback).__name__ == "ReportLog"


# --- a step that runs out of CUDA memory -------------------------------------------------------


class FakeCudaAllocator:
    """Stands in for meshtrain.train.memory_snapshot.CudaAllocator on a CPU worker."""

    def __init__(self) -> None:
        self.history: list[int] = []

    def record_history(self, max_entries: int) -> None:
        self.history.append(max_entries)

    def dump_snapshot(self, path: Path) -> None:
        path.write_bytes(b"snapshot")

    def peak_allocated(self) -> int:
        return 3 * GIB // 2


def test_a_step_out_of_cuda_memory_writes_a_snapshot_and_fails_the_run_and_a_run_that_fits_writes_one_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = stdlib_plan(tmp_path / "stores")
    cfg = load_config(None, [
        "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "data.seq_len=32",
        "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=1", "scaling.num_workers=1",
        "scaling.use_gpu=true", "memory.history_entries=5000", "checkpoint.enabled=false", "eval.interval=null",
        f"run.storage_path={tmp_path}", "run.name=oom",
    ])
    allocator = FakeCudaAllocator()
    monkeypatch.setattr(parts_module, "cuda_allocator", lambda device: allocator)
    real_step = trainer_module.train_step
    steps: list[int] = []

    def step_that_runs_out(*args: Any, **kwargs: Any) -> Any:
        steps.append(len(steps) + 1)
        if len(steps) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", step_that_runs_out)
    with pytest.raises(DeviceOutOfMemory) as failed:
        train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
    assert allocator.history == [5000] and steps == [1, 2]
    snapshot = tmp_path / "oom" / "memory" / "rank0.step2.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    planned = memory_plan(model_args(cfg.model, corpus.vocab_size), planned_mesh(cfg.scaling, cfg.parallel)[0], cfg.parallel, cfg.train, cfg.data.seq_len, False, cfg.model.document_mask).total
    assert str(failed.value) == (
        f"rank 0 ran out of CUDA memory at step 2 (plan estimate {planned / GIB:.2f} GiB per rank, real peak 1.50 GiB "
        f"allocated); memory snapshot {snapshot} (open it at https://pytorch.org/memory_viz); lower "
        "train.micro_batch_size, set parallel.activation_checkpointing=selective or full, or shard over more workers "
        "(python jobs/pretrain.py --dry-run prints the plan); a restart would run out at the same step"
    )
    # The resumed group would replay step 2 on the same batch: Ray Train must not restart it.
    assert isinstance(failed.value.__context__, torch.OutOfMemoryError)
    assert root_failure(failed.value).permanent

    # A run that fits, with the history on: its snapshot when the steps are done (the timeline of the
    # last allocations, peaks included), named in a record.
    monkeypatch.setattr(trainer_module, "train_step", real_step)
    records: list[Record] = []
    train(worker_plan(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "fits"})}), corpus), WorkerLayout(),
          torch.device("cpu"), records.append)
    end = tmp_path / "fits" / "memory" / "rank0.step3.end.pickle"
    assert end.read_bytes() == b"snapshot" and allocator.history == [5000, 5000]
    assert [r for r in records if isinstance(r, MemorySnapshotRecord)] == [
        MemorySnapshotRecord(step=3, rank=0, path=str(end))]


def test_the_cuda_alloc_retries_gauge_reads_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import generate_latest

    from meshtrain.observe.metrics import TrainingMetrics

    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 7})
    # The step clock marks steps with CUDA events.
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: SimpleNamespace(record=lambda: None))
    metrics = TrainingMetrics(run="r", rank=0, node="n", device=torch.device("cuda", 0), flops_per_token=1.0,
                              peak_flops_per_s=None)
    exposed = generate_latest(metrics.registry).decode()
    assert 'meshtrain_cuda_alloc_retries{node="n",rank="0",replica="0",run="r"} 7.0' in exposed
    cpu = TrainingMetrics(run="r", rank=0, node="n", device=torch.device("cpu"), flops_per_token=1.0,
                          peak_flops_per_s=None)
    assert "meshtrain_cuda_alloc_retries" not in generate_latest(cpu.registry).decode()


def test_the_run_summary_carries_the_cuda_peak_and_allocator_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshtrain.cluster.worker import PeakMemory, peak_memory

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 2})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert peak_memory(torch.device("cuda", 0)) == PeakMemory(
        device="NVIDIA H100 80GB HBM3", peak_device_memory_bytes=5 * GIB, num_alloc_retries=2)
