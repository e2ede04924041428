"""What a lost worker costs in each fault-tolerance mode: measured on this machine, and by arithmetic at
16,384 GPUs (meshtrain_bench.recovery_scale).

The real part runs ``jobs/pretrain.py`` through a local Ray on two CPU workers of one model each
(``parallel.shard=1``), in restart mode and in replica mode (two replica groups of one worker), and
SIGKILLs rank 1 before step ``--kill-at``; and once more in each mode without a fault. Per run, from its
``metrics.jsonl`` and ``summary.json``:

* wall: the driver's ``wall_time_s`` (Ray's start, data preparation, every worker-group start included);
* stall: from the last ``train`` record before the kill to the next ``train`` record, in the records'
  ``time`` (restart mode: the first step trained after the resume, a redone one; replica mode: the
  survivors' next step); to new step: the same up to the first step past the last one before the kill;
  rejoined (replica mode): the same up to the replacement's ``replica_joined`` record;
* steps redone: ``train`` records of a step already logged;
* bytes read: per ``checkpoint_load`` record, the loaded checkpoint folder's bytes times the ranks that
  read it whole (the mesh's replicate size: with ``parallel.shard=1`` each rank holds a full copy);
  replica mode's replacement reads nothing;
* goodput: committed steps x the mode's unbroken step time, over the wall time (job) or over the
  training window (the first step's start to the last step's end). The unbroken step time is the mean
  ``step_time_s`` of the first-time steps after warm-up of the same mode's run without a fault (with
  ``--quick``: of the run's own steps before the kill). So a run's stall, its redone steps and its steps
  slowed by a missing replica group all count as lost. Summing each first-time step's own ``step_time_s``
  would count the survivors' stall as productive: it lies inside the next step's time;
* goodput (run's account): ``summary.json``'s ``goodput``, which the driver keeps from the records
  (meshtrain.observe.goodput: productive step time less data, replica, evaluation and checkpoint waits,
  over the wall time to the end of training), printed with its lost time by cause;
* fault cost: the run's wall time, and its training window, less those of the same mode's run without
  a fault;
* tokens/s: the step tokens of the first-time steps after warm-up (and before the kill, in a run with
  one) over their summed ``step_time_s``. Replica over restart, from the runs without a fault (with
  ``--quick``, from the steps before the kill), is the cost of the per-step quorum and the explicit
  gradient sum.

    python jobs/bench_recovery.py                    # both parts, JSON to --out
    python jobs/bench_recovery.py --only scale       # the arithmetic alone, in a second
    python jobs/bench_recovery.py --quick            # 25 steps, no runs without a fault
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshtrain.observe.goodput import goodput_line
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    ReadRecord,
    ReplicaJoinedRecord,
    TrainRecord,
    read_records,
)
from meshtrain_bench.recovery_scale import scale

REPO = Path(__file__).resolve().parents[2]
RUN = "r"
WARMUP_STEPS = 3
SETTINGS = (
    f"run.name={RUN}", "train.log_every=1", "checkpoint.interval=10", "checkpoint.keep=100", "data.max_documents=40",
    "run.max_failures=2", "parallel.shard=1", "metrics.progress_interval_s=0",
)
HEARTBEAT_S = 2.0
MODES: dict[str, tuple[str, ...]] = {
    "restart": (),
    "replica": ("fault_tolerance.mode=replica", f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_S:g}"),
}
KILLED_RANK = 1



@dataclass
class RealRow:
    mode: str
    kill_at: int | None
    exit_code: int
    process_s: float
    wall_s: float | None = None
    stall_s: float | None = None
    to_new_step_s: float | None = None
    steps_redone: int | None = None
    bytes_read: int | None = None
    goodput_job: float | None = None
    goodput_training: float | None = None
    goodput_run: dict[str, Any] | None = None  # the run's own account: summary.json's goodput
    rejoined_s: float | None = None
    fault_cost_s: float | None = None  # wall time over the run without a fault
    window_cost_s: float | None = None  # training window over the run without a fault
    tokens_per_s: float | None = None
    error: str = ""


# --- what a run's records say -------------------------------------------------------------------------


def train_records(records: list[ReadRecord]) -> list[TrainRecord]:
    return [r for r in records if isinstance(r, TrainRecord)]


def first_time_steps(records: list[ReadRecord]) -> list[TrainRecord]:
    """Each step's first ``train`` record (a step trained again after a restart logs again)."""
    seen: set[int] = set()
    firsts = []
    for record in train_records(records):
        if record.step not in seen:
            seen.add(record.step)
            firsts.append(record)
    return firsts


def steps_redone(records: list[ReadRecord]) -> int:
    return len(train_records(records)) - len(first_time_steps(records))


def kill_gap(records: list[ReadRecord], kill_at: int) -> tuple[float, float]:
    """(stall, to new step): seconds from the last ``train`` record before the kill to the next one, and
    to the first one past the steps trained before the kill. The kill strikes before step ``kill_at``:
    its mark is the first record of step ``kill_at`` or later, or a step logged again."""
    trained = train_records(records)
    for index in range(1, len(trained)):
        step, previous = trained[index].step, trained[index - 1]
        if step >= kill_at or step <= previous.step:
            new = next(r for r in trained[index:] if r.step > previous.step)
            return trained[index].time - previous.time, new.time - previous.time
    raise ValueError(f"no train record at or after step {kill_at}")


def rejoin_s(records: list[ReadRecord], kill_at: int) -> float | None:
    """Replica mode: seconds from the last ``train`` record before the kill to the replacement's
    ``replica_joined`` record (its group's restart and the state it received); None without one."""
    before = [r for r in first_time_steps(records) if r.step < kill_at]
    joined = [r for r in records if isinstance(r, ReplicaJoinedRecord) and r.step >= kill_at - 1]
    return joined[0].time - before[-1].time if before and joined else None


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def bytes_read(records: list[ReadRecord], readers: int) -> int:
    """Bytes the loads read from storage: each loaded checkpoint's folder (or, if pruned since, its save
    record's bytes) times the ranks that read it whole."""
    saved = {r.step: r.bytes for r in records if isinstance(r, CheckpointSaveRecord)}
    total = 0
    for load in (r for r in records if isinstance(r, CheckpointLoadRecord)):
        folder = Path(load.path)
        total += folder_bytes(folder) if folder.is_dir() else saved.get(load.step, 0)
    return total * readers


def steady(records: list[ReadRecord], before: int | None) -> list[TrainRecord]:
    """First-time steps after warm-up, and before step ``before`` when given."""
    return [r for r in first_time_steps(records)
            if r.step > WARMUP_STEPS and (before is None or r.step < before)]


def unbroken_step_s(records: list[ReadRecord], before: int | None) -> float:
    return statistics.fmean(r.step_time_s for r in steady(records, before))


def goodput(records: list[ReadRecord], step_s: float, wall_s: float) -> tuple[float, float]:
    """(over the job's wall time, over the training window) at an unbroken step time of ``step_s``: see
    the module's docstring."""
    productive = len(first_time_steps(records)) * step_s
    return productive / wall_s, productive / training_window(records)


def training_window(records: list[ReadRecord]) -> float:
    """Seconds from the first logged step's start to the last one's end."""
    trained = train_records(records)
    return trained[-1].time - (trained[0].time - trained[0].step_time_s)


def tokens_per_s(records: list[ReadRecord], before: int | None) -> float:
    steps = steady(records, before)
    return sum(r.tokens_per_s * r.step_time_s for r in steps) / sum(r.step_time_s for r in steps)


# --- running a job -------------------------------------------------------------------------------------


def run_job(storage: Path, overrides: list[str], timeout_s: float) -> tuple[int, float, str]:
    """``jobs/pretrain.py`` on ``storage``, its output in a file (a full pipe would stall the driver)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_TRAIN_")}
    storage.mkdir(parents=True, exist_ok=True)
    log = storage / "job.log"
    command = [sys.executable, "jobs/pretrain.py", f"run.storage_path={storage}", *SETTINGS, *overrides]
    started = time.perf_counter()
    with log.open("w") as output:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=output, stderr=output,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, time.perf_counter() - started, log.read_text()


def measure(root: Path, mode: str, steps: int, kill_at: int | None, timeout_s: float) -> tuple[RealRow, list[ReadRecord]]:
    """One run; its row lacks goodput and fault cost, which need the same mode's run without a fault."""
    storage = root / f"{mode}-{'kill' if kill_at else 'clean'}"
    shutil.rmtree(storage, ignore_errors=True)
    fault = [f"fault.kill_rank={KILLED_RANK}", f"fault.at_step={kill_at}"] if kill_at else []
    code, seconds, output = run_job(storage, [f"train.steps={steps}", *MODES[mode], *fault], timeout_s)
    row = RealRow(mode, kill_at, code, seconds)
    expected = f"fault injection: rank {KILLED_RANK} sends itself SIGKILL at step {kill_at}"
    if code != 0 or (kill_at and expected not in output):
        row.error = "exit %d; %s" % (code, (output.strip().splitlines() or ["no output"])[-1][:300])
        return row, []
    records = read_records(storage / RUN / "metrics.jsonl")
    summary = json.loads((storage / RUN / "summary.json").read_text())
    row.wall_s = summary["wall_time_s"]
    row.goodput_run = summary.get("goodput")
    row.steps_redone = steps_redone(records)
    row.bytes_read = bytes_read(records, readers=summary["mesh_shape"][0])
    row.tokens_per_s = tokens_per_s(records, kill_at)
    if kill_at:
        row.stall_s, row.to_new_step_s = kill_gap(records, kill_at)
        row.rejoined_s = rejoin_s(records, kill_at)
    return row, records


def real(root: Path, steps: int, kill_at: int, clean: bool, timeout_s: float) -> dict[str, Any]:
    """Kill rank 1 before ``kill_at`` in each mode (and, with ``clean``, run each without a fault)."""
    runs = []
    for failure in [kill_at, None] if clean else [kill_at]:
        for mode in MODES:
            print(f"  {mode} mode, {f'kill before step {failure}' if failure else 'no fault'} ...", flush=True)
            runs.append(measure(root, mode, steps, failure, timeout_s))
    reference = {row.mode: (row, records) for row, records in runs if row.kill_at is None and not row.error}
    for row, records in runs:
        if row.error or row.wall_s is None:
            continue
        unbroken = reference.get(row.mode)
        step_s = unbroken_step_s(unbroken[1], None) if unbroken else unbroken_step_s(records, row.kill_at)
        row.goodput_job, row.goodput_training = goodput(records, step_s, row.wall_s)
        if unbroken and row.kill_at is not None and unbroken[0].wall_s is not None:
            row.fault_cost_s = row.wall_s - unbroken[0].wall_s
            row.window_cost_s = training_window(records) - training_window(unbroken[1])
    rows = [row for row, _ in runs]
    print("\n".join([*format_real_header(), *map(format_real_row, rows)]), flush=True)
    for row in rows:
        if row.goodput_run is not None:
            fault = f"rank {KILLED_RANK} killed before step {row.kill_at}" if row.kill_at else "no fault"
            print(f"{row.mode} mode, {fault}: {goodput_line(row.goodput_run)}", flush=True)
    for row in rows:
        if row.rejoined_s is not None:
            print(f"\n{row.mode} mode: the replacement group joined {row.rejoined_s:.1f} s after the kill", flush=True)
    speed = {row.mode: row.tokens_per_s for row in rows if row.kill_at is None or not clean}
    ratio = None if None in (speed.get("replica"), speed.get("restart")) else speed["replica"] / speed["restart"]
    source = "runs without a fault" if clean else f"steps {WARMUP_STEPS + 1}-{kill_at - 1} of the runs with one"
    print(f"\ntokens/s replica / restart: {ratio:.2f} ({source})" if ratio else "\ntokens/s ratio: not measured",
          flush=True)
    settings = [*SETTINGS, f"train.steps={steps}", f"fault.kill_rank={KILLED_RANK}", f"fault.at_step={kill_at}"]
    return {"settings": settings, "modes": MODES, "rows": [asdict(row) for row in rows],
            "tokens_per_s_ratio": ratio, "tokens_per_s_from": source}


def format_real_header() -> list[str]:
    return ["| mode | fault | wall s | fault cost s (wall / training) | stall s | to new step s | steps redone | "
            "bytes read | goodput (job) | goodput (training) | goodput (run's account) | tokens/s |", "|---" * 12 + "|"]


def format_real_row(row: RealRow) -> str:
    fault = f"rank {KILLED_RANK} killed before step {row.kill_at}" if row.kill_at else "none"
    if row.error:
        return f"| {row.mode} | {fault} | - | - | - | - | - | - | - | - | - | FAILED: {row.error} |"

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    cost = "-" if row.fault_cost_s is None else f"{row.fault_cost_s:.1f} / {number(row.window_cost_s, '.1f')}"
    return (f"| {row.mode} | {fault} | {number(row.wall_s, '.1f')} | {cost} | "
            f"{number(row.stall_s, '.1f')} | "
            f"{number(row.to_new_step_s, '.1f')} | {row.steps_redone} | {(row.bytes_read or 0) / 2**20:.1f} MiB | "
            f"{number(row.goodput_job, '.1%')} | {number(row.goodput_training, '.1%')} | "
            f"{number(row.goodput_run['goodput'] if row.goodput_run else None, '.1%')} | "
            f"{number(row.tokens_per_s, ',.0f')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["real", "scale"], help="one part (default: both)")
    parser.add_argument("--steps", type=int, default=40, help="steps per real run (default 40)")
    parser.add_argument("--kill-at", type=int, default=15, help="rank 1 is killed before this step (default 15)")
    parser.add_argument("--quick", action="store_true", help="25 steps, and no runs without a fault")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/meshtrain-bench-recovery"), help="scratch folder")
    parser.add_argument("--out", type=Path, help="write recovery.json here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per real run (default 300)")
    args = parser.parse_args(argv)
    steps = 25 if args.quick else args.steps  # more than optim.warmup_steps (20)
    if not WARMUP_STEPS + 1 < args.kill_at <= steps:  # some steps after warm-up come before the kill
        parser.error(f"--kill-at must be in {WARMUP_STEPS + 2}..{steps}")
    result: dict[str, Any] = {}
    failed = False
    if args.only in (None, "real"):
        print(f"real runs: 2 CPU workers on a local Ray, {steps} steps, rank {KILLED_RANK} SIGKILLed before step "
              f"{args.kill_at}; replica mode's heartbeat timeout {HEARTBEAT_S:g} s", flush=True)
        result["real"] = real(args.dir, steps, args.kill_at, not args.quick, args.timeout)
        failed = any(row["error"] for row in result["real"]["rows"])
        print(flush=True)
    if args.only in (None, "scale"):
        lines, result["scale"] = scale()
        print("\n".join(lines), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "recovery.json").write_text(json.dumps(result, indent=1))
    return 1 if failed else 0
