"""The fault matrix: each fault a careless or hostile user can cause, injected into a real job, and
what the run did about it.

Every row runs ``jobs/pretrain.py`` as a user would (a local Ray, two CPU workers) and prints: the
fault; the worker-group restarts it used; the seconds from launch to the driver's final line; that
line; the steps lost (committed steps the run could not resume from); and whether the outcome is
right: one line with the cause, no restart for a deterministic fault, resumption from the newest
loadable checkpoint with final weights bitwise equal to an unbroken run, nothing committed lost, no
payload run, no secret in any file.

The checkpoint rows start from copies of one base run (30 steps, committed at 10, 20 and 30) and
continue it to step 40; the unbroken continuation is the reference for their final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.data import expand_local_source
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    DownstreamEvalFailedRecord,
    InterruptedRecord,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    ReplicaStragglerRecord,
    RunPaths,
    TextSamplesRecord,
    TrainRecord,
    read_records,
    read_worker_starts,
)

REPO = Path(__file__).resolve().parents[2]
RUN = "r"
SETTINGS = (
    f"run.name={RUN}", "train.log_every=5", "checkpoint.interval=10", "data.max_documents=40",
    "optim.schedule_steps=40", "run.max_failures=2", "metrics.progress_interval_s=0",
)
SECRET = "meshtrain-bench-secret-7f3a9c"
PAYLOAD_SENTINEL = "payload-ran"


@dataclass
class Job:
    returncode: int
    seconds: float
    output: str

    @property
    def final_line(self) -> str:
        ours = [line for line in self.output.splitlines() if line.startswith(("meshtrain:", "[meshtrain] done"))]
        return ours[-1] if ours else (self.output.strip().splitlines() or [""])[-1]


@dataclass
class Row:
    fault: str
    restarts: int | None
    seconds: float
    final_line: str
    steps_lost: int | None
    right: bool
    wrong: str = ""  # which check failed, when not right


def run_job(storage: Path, *overrides: str, interrupt_at_step: int | None = None, timeout_s: float = 600,
            env: dict[str, str] | None = None) -> Job:
    """``jobs/pretrain.py`` with ``overrides`` on storage ``storage`` (its output in a file: a full pipe
    would stall the driver); with ``interrupt_at_step``, SIGINT to the driver once that step is logged."""
    log = Path(tempfile.mkstemp(prefix="meshtrain-bench-faults-", suffix=".log")[1])
    job_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
    command = [sys.executable, "jobs/pretrain.py", f"run.storage_path={storage}", *SETTINGS, *overrides]
    started = time.perf_counter()
    with log.open("w") as output:
        driver = subprocess.Popen(command, cwd=REPO, env=job_env, stdout=output, stderr=output, text=True)
        try:
            if interrupt_at_step is not None:
                while driver.poll() is None and logged_step(storage / RUN) < interrupt_at_step:
                    time.sleep(0.1)
                driver.send_signal(signal.SIGINT)
            driver.wait(timeout=timeout_s)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    seconds = time.perf_counter() - started
    text = log.read_text()
    log.unlink()
    return Job(driver.returncode, seconds, text)


def logged_step(run_dir: Path) -> int:
    return max((r.step for r in read_records(run_dir / "metrics.jsonl", TrainRecord)), default=0)


def restarts(run_dir: Path) -> int | None:
    """Restarts of the run's last launch (worker-group starts beyond its first)."""
    starts = read_worker_starts(RunPaths(run_dir.name, run_dir.parent))
    return sum(start.launch == starts[-1].launch for start in starts) - 1 if starts else None


def loads(run_dir: Path) -> list[int]:
    return [r.step for r in read_records(run_dir / "metrics.jsonl", CheckpointLoadRecord)]


def step_dir(storage: Path, step: int) -> Path:
    return storage / RUN / "checkpoints" / f"step-{step:08d}"


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from meshtrain.checkpoint.reading import load_model_state

    state, _, _ = load_model_state(str(checkpoint))
    return state


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def flip_bit(path: Path, offset: int, bit: int) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def flip_tokens(shard: Path, dtype: np.dtype, high_byte: bool, bit: int, every_bytes: int = 16 << 10) -> None:
    """Flip ``bit`` of one token every ``every_bytes`` (so the first batches surely read one): in its
    most significant byte (``high_byte``, an id far past a small vocabulary) or its least."""
    byte = dtype.itemsize - 1 if high_byte else 0  # little-endian
    for offset in range(every_bytes // 2, shard.stat().st_size - dtype.itemsize, every_bytes):
        flip_bit(shard, offset - offset % dtype.itemsize + byte, bit)


def largest_shard(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


class Crafted:
    """What a hostile writer of checkpoint storage would put in ``.metadata``: unpickling it runs
    its payload (here: writing a sentinel file), then returns the real metadata so nothing looks wrong."""

    def __init__(self, real: bytes, sentinel: Path) -> None:
        self.real, self.sentinel = real, sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        code = f"open({str(self.sentinel)!r}, 'w').write('ran') or __import__('pickle').loads({self.real!r})"
        return (eval, (code,))


def rewrite_marker_for(checkpoint: Path, name: str) -> None:
    """What a writer of the storage who knows the checksum scheme would do after replacing ``name``:
    its sidecar says the new bytes are one item, and ``COMMITTED`` records the new sidecar checksum,
    file sizes and its own checksum. The file must then be refused for what it is, not for a checksum."""
    from meshtrain.checkpoint.checksums import MARKER_CHECKSUM, SIDECAR_SUFFIX, digest, encode_sidecar, seal_marker
    from meshtrain.checkpoint.storage import BAD_MARKER, COMMIT_MARKER

    data = (checkpoint / name).read_bytes()
    sidecar = encode_sidecar(name, [(0, len(data), digest(data))])
    (checkpoint / f"{name}{SIDECAR_SUFFIX}").write_bytes(sidecar)
    marker = json.loads((checkpoint / COMMIT_MARKER).read_text())
    marker.pop(MARKER_CHECKSUM, None)  # and the marker's checksum of itself, recomputed below
    marker["checksums"]["sidecars"][name] = digest(sidecar)
    marker["files"] = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name not in (COMMIT_MARKER, BAD_MARKER)}
    marker["bytes"] = sum(marker["files"].values())
    (checkpoint / COMMIT_MARKER).write_text(json.dumps(seal_marker(marker), indent=1))


def s3_client(s3: Any) -> Any:
    import boto3

    return boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                        **s3.storage_options["client_kwargs"])


def token_shard(storage: Path) -> tuple[Path, np.dtype]:
    (index,) = storage.glob("token_stores/*/index.json")
    dtype = np.dtype(json.loads(index.read_text())["dtype"])
    return max(index.parent.glob("shard-*.bin"), key=lambda p: p.stat().st_size), dtype


class Matrix:
    """The rows, sharing a base run and its unbroken continuation."""

    def __init__(self, root: Path, log: Callable[[str], None]) -> None:
        self.root, self.log = root, log
        self.base = root / "base"
        self.reference: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        job = run_job(self.base, "train.steps=30")
        if job.returncode != 0:
            raise SystemExit(f"the base run failed: {job.final_line}")
        unbroken = self.copy("unbroken")
        job = run_job(unbroken, "train.steps=40")
        if job.returncode != 0:
            raise SystemExit(f"the unbroken continuation failed: {job.final_line}")
        self.reference = model_weights(step_dir(unbroken, 40))

    def copy(self, name: str) -> Path:
        target = self.root / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.base, target)
        return target

    # --- rows -------------------------------------------------------------------------------------

    def resumed_row(self, fault: str, storage: Path, *overrides: str, resume_from: int, expect_bad: list[int]) -> Row:
        """Continue a damaged copy to step 40: it must resume from ``resume_from`` without a restart, say
        why it skipped the newer ones, and end with the unbroken run's weights."""
        job = run_job(storage, "train.steps=40", *overrides)
        run_dir = storage / RUN
        checks = {
            "exit 0": job.returncode == 0,
            "no restart": restarts(run_dir) == 0,
            f"resumed from step {resume_from}": loads(run_dir)[-1:] == [resume_from],
            "a line per skipped checkpoint": all(f"step-{step:08d}" in job.output for step in expect_bad),
            "final weights equal the unbroken run's": job.returncode == 0
            and same_weights(model_weights(step_dir(storage, 40)), self.reference),
        }
        return self.row(fault, job, run_dir, 30 - resume_from, checks)

    def row(self, fault: str, job: Job, run_dir: Path, steps_lost: int | None, checks: dict[str, bool]) -> Row:
        wrong = [name for name, ok in checks.items() if not ok]
        row = Row(fault, restarts(run_dir), job.seconds, job.final_line, steps_lost, not wrong, "; ".join(wrong))
        self.log(format_row(row))
        return row

    def checkpoint_of_another_shape(self) -> Row:
        other = self.root / "other-shape"
        shutil.rmtree(other, ignore_errors=True)
        job = run_job(other, "train.steps=10", "model.n_layers=1")
        if job.returncode != 0:
            raise SystemExit(f"the other-shape run failed: {job.final_line}")
        storage = self.copy("shape")
        shutil.rmtree(step_dir(storage, 30))
        shutil.copytree(step_dir(other, 10), step_dir(storage, 30))
        return self.resumed_row("1. newest checkpoint of another model shape", storage, resume_from=20, expect_bad=[30])

    def truncated_with_keep_1(self) -> Row:
        storage = self.copy("keep1")
        shard = largest_shard(step_dir(storage, 30))
        os.truncate(shard, shard.stat().st_size // 2)
        row = self.resumed_row("2. truncated newest, checkpoint.keep=1", storage, "checkpoint.keep=1",
                               resume_from=20, expect_bad=[30])
        kept = sorted(p.parent.name for p in (storage / RUN / "checkpoints").glob("step-*/COMMITTED"))
        if "step-00000040" not in kept:
            row.right, row.wrong = False, "; ".join(filter(None, [row.wrong, f"newest loadable pruned ({kept})"]))
        return row

    def flipped_checkpoint_shard(self) -> Row:
        storage = self.copy("shard-flip")
        shard = largest_shard(step_dir(storage, 30))
        flip_bit(shard, shard.stat().st_size // 2 + 3, 6)  # a high exponent bit of an fp32 value, little-endian
        return self.resumed_row("3a. bit flip in a checkpoint shard", storage, resume_from=20, expect_bad=[30])

    def flipped_metadata(self) -> Row:
        storage = self.copy("metadata-flip")
        metadata = step_dir(storage, 30) / ".metadata"
        flip_bit(metadata, metadata.stat().st_size // 2, 2)
        return self.resumed_row("3b. bit flip in .metadata", storage, resume_from=20, expect_bad=[30])

    def crafted_metadata(self) -> Row:
        storage = self.copy("crafted")
        sentinel = storage / PAYLOAD_SENTINEL
        checkpoint = step_dir(storage, 30)
        metadata = checkpoint / ".metadata"
        metadata.write_bytes(pickle.dumps(Crafted(metadata.read_bytes(), sentinel)))
        rewrite_marker_for(checkpoint, ".metadata")
        export = subprocess.run(
            [sys.executable, "jobs/export.py", str(checkpoint), "--out", str(self.root / "crafted-export")],
            cwd=REPO, capture_output=True, text=True,
        )
        export_refused = export.returncode != 0 and len(export.stderr.strip().splitlines()) == 1 and not sentinel.exists()
        row = self.resumed_row("4. crafted .metadata (marker edited to match)", storage, resume_from=20, expect_bad=[30])
        extra = {"payload never ran": not sentinel.exists(), "export refused in one line": export_refused}
        return self.amend(row, extra)

    @staticmethod
    def amend(row: Row, checks: dict[str, bool]) -> Row:
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            row.right, row.wrong = False, "; ".join(filter(None, [row.wrong, *wrong]))
        return row

    def stopped_row(self, fault: str, storage: Path, *overrides: str, expect: list[str], exit_code: int = 1,
                    steps_lost: int | None = 0, env: dict[str, str] | None = None) -> Row:
        """A deterministic fault: the run must stop at once (no restart) with one line naming the cause."""
        job = run_job(storage, *overrides, env=env)
        run_dir = storage / RUN
        ours = [line for line in job.output.splitlines() if line.startswith("meshtrain:")]
        checks = {
            f"exit {exit_code}": job.returncode == exit_code,
            "no restart": restarts(run_dir) in (0, None),
            "one final line": len(ours) == 1,
            **{f"the line names {text!r}": text in job.final_line for text in expect},
        }
        return self.row(fault, job, run_dir, steps_lost, checks)

    def no_loadable_checkpoint(self) -> Row:
        storage = self.copy("none-loadable")
        for step in (10, 20, 30):
            shard = largest_shard(step_dir(storage, step))
            flip_bit(shard, shard.stat().st_size // 2, 0)
        before = sorted(p.name for p in (storage / RUN / "checkpoints").iterdir())
        row = self.stopped_row("1'. no loadable checkpoint left", storage, "train.steps=40",
                               expect=["step-00000030", "step-00000020", "step-00000010"], steps_lost=None)
        after = sorted(p.name for p in (storage / RUN / "checkpoints").iterdir())
        return self.amend(row, {"nothing committed removed": before == after})

    def flipped_token(self, fault: str, name: str, high_byte: bool, bit: int) -> Row:
        storage = self.copy(name)
        shard, dtype = token_shard(storage)
        flip_tokens(shard, dtype, high_byte, bit)
        for checkpoint in (storage / RUN / "checkpoints").iterdir():
            shutil.rmtree(checkpoint)  # a fresh start: the run reads its first batches again
        return self.stopped_row(fault, storage, "train.steps=40", expect=[shard.name, "offset"], steps_lost=None)

    def flipped_token_on_s3(self) -> Row:
        """The base run's token store on S3 (a local endpoint), one bit flipped: read back, refused."""
        from meshtrain_bench.s3 import SlowS3

        storage = self.root / "token-s3"
        shutil.rmtree(storage, ignore_errors=True)
        store = self.root / "token-s3-store"
        shutil.rmtree(store, ignore_errors=True)
        shard, dtype = token_shard(self.base)
        shutil.copytree(shard.parent, store)
        flip_tokens(store / shard.name, dtype, high_byte=False, bit=0)
        with SlowS3(0.0) as s3:
            url = s3.upload(store, "tokens", "store")
            options = json.dumps(s3.storage_options)
            return self.stopped_row("3e. bit flip in a token shard on S3", storage, "train.steps=40", f"data.source={url}",
                                    f"data.storage_options={options}", f"data.tokenizer={store / 'tokenizer.json'}",
                                    expect=[shard.name], steps_lost=None,
                                    env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})

    def storage_path_is_a_file(self) -> Row:
        storage = self.root / "storage-file"
        storage.mkdir(parents=True, exist_ok=True)
        blocker = storage / "file"
        blocker.write_text("not a directory")
        job = run_job(storage, "train.steps=40", f"checkpoint.path={blocker}")
        checks = {"exit 2": job.returncode == 2, "the line names checkpoint.path": "checkpoint.path" in job.final_line}
        return self.row("6. checkpoint.path is a file", job, storage / RUN, 0, checks)

    def run_storage_is_a_file(self) -> Row:
        storage = self.root / "run-storage-file"
        storage.parent.mkdir(parents=True, exist_ok=True)
        storage.write_text("not a directory")
        job = run_job(storage, "train.steps=40")
        checks = {"exit 2": job.returncode == 2, "the line names run.storage_path": "run.storage_path" in job.final_line}
        return self.row("6. run.storage_path is a file", job, storage / RUN, 0, checks)

    def read_only_checkpoints(self) -> Row | None:
        """checkpoint.path on a read-only mount (root writes through file modes, not through this)."""
        mount = self.root / "read-only"
        mount.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
            self.log("6. read-only checkpoint directory: skipped (mounting needs root)")
            return None
        try:
            storage = self.root / "read-only-run"
            shutil.rmtree(storage, ignore_errors=True)
            job = run_job(storage, "train.steps=40", f"checkpoint.path={mount}")
            checks = {"exit 2": job.returncode == 2, "the line names checkpoint.path": "checkpoint.path" in job.final_line}
            return self.row("6. read-only checkpoint directory", job, storage / RUN, 0, checks)
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)

    def killed_worker(self) -> Row:
        """For contrast, a fault a restart does fix: Ray restarts the group, which resumes and matches."""
        storage = self.copy("killed")
        job = run_job(storage, "train.steps=40", "fault.kill_rank=1", "fault.at_step=35")
        run_dir = storage / RUN
        checks = {
            "exit 0": job.returncode == 0,
            "one restart": restarts(run_dir) == 1,
            "resumed from step 30": loads(run_dir)[-1:] == [30],
            "final weights equal the unbroken run's": job.returncode == 0
            and same_weights(model_weights(step_dir(storage, 40)), self.reference),
        }
        return self.row("6''. a killed worker (a restart fixes it)", job, run_dir, 5, checks)

    def replica_fault(self, kind: str) -> Row:
        """Replica mode, two groups of one worker: at step 6 worker 1 freezes for 30 s (SIGSTOP), hangs
        (sleeps forever inside the step) or computes 2x slower from then on (``evicted``: with
        scaling.evict_stragglers, so its peer ends it and Ray replaces it). The other group must stall at
        most max(10 s, 3 x the median step) + the heartbeat timeout, the record must name the cause (no
        record for the slow one), every step must be logged once with the unbroken replica run's losses."""
        heartbeat_s = 2.0
        replica = ("fault_tolerance.mode=replica", "parallel.strategy=hybrid_shard", "parallel.shard=1",
                   f"fault_tolerance.heartbeat_timeout_s={heartbeat_s}", "train.steps=40",
                   "train.log_every=1")  # a record per step: each step is seen to be trained once
        if not hasattr(self, "replica_losses"):
            unbroken = self.root / "replica-unbroken"
            shutil.rmtree(unbroken, ignore_errors=True)
            if run_job(unbroken, *replica).returncode != 0:
                raise SystemExit("the unbroken replica-mode run failed")
            self.replica_losses = {r.step: r.loss for r in read_records(unbroken / RUN / "metrics.jsonl", TrainRecord)}
        storage = self.root / f"replica-{kind}"
        shutil.rmtree(storage, ignore_errors=True)
        fault = {"frozen": ["fault.kind=freeze", "fault.freeze_s=30"], "hung": ["fault.kind=hang"],
                 "slow": ["fault.kind=slow", "fault.slow_factor=2"],
                 "evicted": ["fault.kind=slow", "fault.slow_factor=2", "scaling.evict_stragglers=true"]}[kind]
        job = run_job(storage, *replica, "fault.kill_rank=1", "fault.at_step=6", *fault)
        run_dir = storage / RUN
        trained = list(read_records(run_dir / "metrics.jsonl", TrainRecord))
        lost = list(read_records(run_dir / "metrics.jsonl", ReplicaLostRecord))
        median_s = float(np.median([r.step_time_s for r in trained if r.step < 6])) if trained else 0.0
        bound_s = max(10.0, 3 * median_s) + heartbeat_s
        checks = {
            "exit 0": job.returncode == 0,
            "every step logged once": [r.step for r in trained] == list(range(1, 41)),
            "the unbroken run's losses": all(abs(r.loss - self.replica_losses[r.step]) <= 1e-4 * abs(self.replica_losses[r.step])
                                             for r in trained),
        }
        stragglers = list(read_records(run_dir / "metrics.jsonl", ReplicaStragglerRecord))
        if kind == "slow":
            checks["not declared hung"] = not lost
            # once per episode: on a loaded machine one logged step may end an episode and a later one start another
            checks["reported as a straggler group"] = {r.replica for r in stragglers} == {1}
        elif kind == "evicted":
            # its replacement is as slow (the fault follows the rank): reported, never ended a second time
            checks["ended once as slow"] = [r.cause for r in lost] == ["slow"] and [r.replaced for r in stragglers][:1] == [True]
            checks["its replacement healed from a peer"] = bool(read_records(run_dir / "metrics.jsonl", ReplicaJoinedRecord))
            checks[f"stall within {bound_s:.1f}s"] = bool(lost) and lost[0].stall_s <= bound_s
        else:
            checks[f"replica_lost names {kind}"] = [r.cause for r in lost][:1] == [kind]
            checks[f"stall within {bound_s:.1f}s"] = bool(lost) and lost[0].stall_s <= bound_s
        starts = read_worker_starts(RunPaths(run_dir.name, run_dir.parent))
        slow = [f"group {r.replica} a straggler at step {r.step} ({r.slowdown:.1f}x{', ended' if r.replaced else ''})"
                for r in stragglers]
        slow += [f"group {r.replica} joined at step {r.step}" for r in read_records(run_dir / "metrics.jsonl", ReplicaJoinedRecord)]
        happened = "; ".join([f"{lost[0].cause} at step {lost[0].step}: stall {lost[0].stall_s:.1f}s (quorum {lost[0].quorum_s:.1f}s)"
                              if lost else "no replica lost", *slow, job.final_line])
        wrong = [name for name, ok in checks.items() if not ok]
        row = Row(f"R. replica group {kind} at step 6", len(starts) - 2 if starts else None, job.seconds, happened,
                  0, not wrong, "; ".join(wrong))
        self.log(format_row(row))
        return row

    def disk_full(self) -> Row | None:
        """checkpoint.path on a 12 MiB tmpfs: the first save fills it (needs root to mount)."""
        mount = self.root / "small-disk"
        mount.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True).returncode:
            self.log("6'. full disk: skipped (mounting a small tmpfs needs root)")
            return None
        try:
            storage = self.root / "disk-full"
            shutil.rmtree(storage, ignore_errors=True)
            row = self.stopped_row("6'. disk full during a save", storage, "train.steps=40", f"checkpoint.path={mount}",
                                   expect=[str(mount), "free"], steps_lost=None)
            leftovers = [p.name for p in mount.glob(f"{RUN}/step-*") if not (p / "COMMITTED").exists()]
            return self.amend(row, {"the partial step is removed": not leftovers})
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)

    def ctrl_c(self) -> Row:
        storage = self.copy("ctrl-c")
        job = run_job(storage, "train.steps=40", interrupt_at_step=33)
        run_dir = storage / RUN
        interrupted = read_records(run_dir / "metrics.jsonl", InterruptedRecord)
        step = interrupted[0].step if interrupted else None
        checks = {
            "exit 130": job.returncode == 130,
            "saved where it stopped": bool(interrupted) and interrupted[0].saved,
            "the line names the step": step is not None and f"checkpoint step {step} committed" in job.final_line,
        }
        row = self.row("7. Ctrl-C (SIGINT to the driver)", job, run_dir, 0 if checks["saved where it stopped"] else None,
                       checks)
        resumed = run_job(storage, "train.steps=40")
        return self.amend(row, {
            "the re-run resumes there": loads(run_dir)[-1:] == [step],
            "and ends with the unbroken run's weights": resumed.returncode == 0
            and same_weights(model_weights(step_dir(storage, 40)), self.reference),
        })

    def secrets(self) -> Row:
        """Credentials in checkpoint.storage_options (S3 on a local endpoint): in no file and no log line."""
        from meshtrain_bench.s3 import SlowS3

        storage = self.root / "secrets"
        shutil.rmtree(storage, ignore_errors=True)
        with SlowS3(0.0) as s3:
            client = s3_client(s3)
            client.create_bucket(Bucket="ckpt")
            options = json.dumps({"key": "testing", "secret": SECRET, "token": SECRET,
                                  "client_kwargs": s3.storage_options["client_kwargs"]})
            job = run_job(storage, "train.steps=10", "checkpoint.path=s3://ckpt/runs",
                          f"checkpoint.storage_options={options}")
            listed = client.list_objects_v2(Bucket="ckpt").get("Contents", [])
            stored = [obj["Key"] for obj in listed if obj["Key"].endswith("COMMITTED")]
            in_markers = any(SECRET.encode() in client.get_object(Bucket="ckpt", Key=key)["Body"].read() for key in stored)
        leaked = [str(p) for p in storage.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        checks = {"exit 0": job.returncode == 0, "a checkpoint was committed on S3": bool(stored),
                  "no secret in the log": SECRET not in job.output, "no secret in any file": not leaked,
                  "no secret in the markers": not in_markers}
        return self.row("5. secrets in checkpoint.storage_options", job, storage / RUN, 0, checks)

    def input_errors(self) -> Iterator[Row]:
        """Finding 8: bad input that must be one line, exit 2, before anything is trained."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = self.root / "bad-data"
        data.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": [1, 2, 3]}), data / "ints.parquet")
        pq.write_table(pa.table({"text": ["a document", None, "another"]}), data / "nulls.parquet")
        (data / "empty").mkdir(exist_ok=True)
        (data / "empty" / "empty.txt").write_text("")
        for fault, storage, overrides, expect in (
            ("8a. parquet text column of integers", "ints", [f"data.source={data / 'ints.parquet'}"], "text"),
            ("8b. a null text row", "nulls", [f"data.source={data / 'nulls.parquet'}"], "text"),
            ("8c. run.name token_stores", "reserved", ["run.name=token_stores"], "run.name"),
        ):
            target = self.root / storage
            shutil.rmtree(target, ignore_errors=True)
            job = run_job(target, "train.steps=10", *overrides)
            yield self.row(fault, job, target / RUN, 0, {"exit 2": job.returncode == 2, f"names {expect}": expect in job.final_line})
        target = self.root / "relaunch"
        shutil.rmtree(target, ignore_errors=True)
        failed = run_job(target, "train.steps=10", f"data.source={data / 'empty'}")
        job = run_job(target, "train.steps=10")
        yield self.row("8d. relaunch after a failed launch with another data.source", job, target / RUN, 0,
                       {"the failed launch exits 2": failed.returncode == 2, "the relaunch trains": job.returncode == 0})

    def downstream_not_waited_for(self) -> Row:
        """Finding 4: text samples of every checkpoint with eval.downstream.final_wait_s=0: what the driver
        does not wait for is cancelled, its leases released, and the last line names the steps."""
        storage = self.root / "downstream-0"
        shutil.rmtree(storage, ignore_errors=True)
        job = run_job(storage, "train.steps=20", "eval.samples.prompts=['def ']", "eval.samples.max_new_tokens=8",
                      "eval.downstream.final_wait_s=0")
        run_dir = storage / RUN
        leases = sorted(str(p) for p in (run_dir / "checkpoints").glob("*/LEASED"))
        unscored = [r.step for r in read_records(run_dir / "metrics.jsonl", DownstreamEvalFailedRecord)]
        scored = [r.step for r in read_records(run_dir / "metrics.jsonl", TextSamplesRecord)]
        checks = {"exit 0": job.returncode == 0, "no lease left": not leases,
                  "every checkpoint scored or named unscored": sorted(unscored + scored) == [10, 20],
                  "the unscored steps in one line": not unscored or "not scored" in job.output}
        return self.row("4. eval.downstream.final_wait_s=0", job, run_dir, 0, checks)

    def oversized_document(self) -> Row:
        """Finding 8: one JSONL line of 20 million characters is prepared in bounded memory, in pieces."""
        data = self.root / "oversized"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        words = " ".join(f"word{i % 997}" for i in range(2_500_000))[:20_000_000]
        (data / "one-line.jsonl").write_text(json.dumps({"text": words}) + "\n")
        started = time.perf_counter()
        prepare = subprocess.run([sys.executable, "jobs/prepare_data.py", f"data.source={data / 'one-line.jsonl'}",
                                  f"run.storage_path={data / 'runs'}", "data.vocab_size=512"],
                                 cwd=REPO, capture_output=True, text=True, timeout=900)
        job = Job(prepare.returncode, time.perf_counter() - started, prepare.stdout + prepare.stderr)
        return self.row("8. one JSONL line of 20M characters", job, data, 0, {
            "exit 0": prepare.returncode == 0, "no retry": "killed" not in job.output})



    def round_two(self) -> Iterator[Row]:
        """Round two's findings: bad input and a busy run folder, each refused in one line with exit 2
        before Ray starts, with nothing of the run's written or replaced."""
        from meshtrain.cluster.run_lease import RunLease

        def refused(fault: str, name: str, *overrides: str, expect: str, prepare: Callable[[Path], None] | None = None,
                    env: dict[str, str] | None = None) -> Row:
            storage = self.root / "round-two" / name
            shutil.rmtree(storage, ignore_errors=True)
            storage.mkdir(parents=True)
            if prepare is not None:
                prepare(storage / RUN)
            def files() -> list[str]:  # the driver's lock file aside (it is how a run owns its folder)
                return sorted(str(p.relative_to(storage)) for p in storage.rglob("*") if p.name != "driver.lock")

            before = files()
            job = run_job(storage, "train.steps=10", *overrides, env=env)
            after = files()
            ours = [line for line in job.output.splitlines() if line.startswith("meshtrain:")]
            checks = {"exit 2": job.returncode == 2, "one line": len(ours) == 1, f"names {expect!r}": expect in job.final_line,
                      "Ray never started": "Started a local Ray instance" not in job.output,
                      "nothing written or replaced": before == after}
            return self.row(fault, job, storage / RUN, 0, checks)

        def committed(*steps: int) -> Callable[[Path], None]:
            def make(run_dir: Path) -> None:
                for step in steps:
                    folder = run_dir / "checkpoints" / f"step-{step:08d}"
                    folder.mkdir(parents=True)
                    (folder / "COMMITTED").write_text(json.dumps({"step": step, "files": {}}))
            return make

        def with_file(name: str, text: str, *steps: int) -> Callable[[Path], None]:
            def make(run_dir: Path) -> None:
                committed(*steps)(run_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / name).write_text(text)
            return make

        busy = self.root / "round-two" / "busy"
        shutil.rmtree(busy, ignore_errors=True)
        with RunLease.take(busy / RUN, RUN, "the first driver"):
            job = run_job(busy, "train.steps=10")
            ours = [line for line in job.output.splitlines() if line.startswith("meshtrain:")]
            yield self.row("R1. a second driver on a live run name", job, busy / RUN, 0, {
                "exit 2": job.returncode == 2, "one line": len(ours) == 1,
                "names the holder": f"PID {os.getpid()}" in job.final_line,
                "nothing written": sorted(p.name for p in (busy / RUN).iterdir()) == ["driver.lock"]})
        yield refused("R2. checkpoint.resume=false over committed checkpoints", "fresh", "checkpoint.resume=false",
                      expect="checkpoint.resume=false", prepare=committed(10, 20, 30))
        yield refused("R3a. a truncated config.yaml", "config", expect="config.yaml is damaged",
                      prepare=with_file("config.yaml", "model:\n  preset: debug\ndata:\n  seq_l", 10))
        yield refused("R3b. a truncated tokenizer.json", "tokenizer", expect="tokenizer.json is damaged",
                      prepare=with_file("tokenizer.json", '{"version": "1.0", "trunc'))
        yield refused("R6a. metrics.port=65535 with two workers", "port", "metrics.port=65535", expect="metrics.port=65535")
        yield refused("R6b. metrics.bind_address this machine lacks", "bind", "metrics.bind_address=192.0.2.77",
                      expect="metrics.bind_address=192.0.2.77", env={"RAY_ADDRESS": ""})
        options = json.dumps({"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}})
        yield refused("R7. an s3 token store at an endpoint that refuses", "s3", "data.source=s3://bucket/store",
                      f"data.storage_options={options}", expect="data.source: cannot reach",
                      env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        configs = self.root / "round-two" / "configs"
        configs.mkdir(parents=True, exist_ok=True)
        bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        (configs / "bomb.yaml").write_text("\n".join(bomb) + "\ntrain:\n  steps: *a8\n")
        (configs / "twice.yaml").write_text("train:\n  steps: 10\n  steps: 20\n")
        yield refused("R9a. a YAML alias bomb (10^9 leaves)", "bomb", "--config", str(configs / "bomb.yaml"),
                      expect="expands to more than 100,000 values")
        yield refused("R9b. a YAML key set twice", "twice", "--config", str(configs / "twice.yaml"),
                      expect="twice in one mapping")
        yield refused("R10a. run.name of 300 characters", "long-name", "run.name=" + "n" * 300, expect="run.name")
        yield refused("R10b. run.name with a control character", "control-name", "run.name=r\tun",
                      expect="control character")

        weights = self.root / "round-two" / "hf-negative-hidden"
        shutil.rmtree(weights, ignore_errors=True)
        _tiny_llama(weights, hidden_size=-64)
        yield refused("R5. model.init_from whose config.json says hidden_size -64", "init-from",
                      f"model.init_from={weights}", expect="config.json: hidden_size=-64 must be positive")

        versions = self.root / "round-two" / "glob" / "ver"
        shutil.rmtree(versions.parent, ignore_errors=True)
        (versions / "v2").mkdir(parents=True)
        (versions / "v2" / "a.jsonl").write_text('{"text": "one document"}\n')
        (versions / "latest").symlink_to("v2")
        (versions / "v2" / "loop").symlink_to("..")
        started = time.perf_counter()
        listed = expand_local_source(str(versions / "**" / "*.jsonl"))
        job = Job(0, time.perf_counter() - started, f"listed {len(listed)} file(s): {', '.join(map(str, listed))}")
        yield self.row("R11. a ** glob through a folder link and a link loop", job, versions, 0,
                       {"each file once": len(listed) == 1})

        generate = subprocess.run([sys.executable, "jobs/generate.py", str(self.root / "no-run"), "def ",
                                   "--temperature", "nan"], cwd=REPO, capture_output=True, text=True)
        job = Job(generate.returncode, 0.0, generate.stderr)
        yield self.row("R12. generate --temperature nan", job, self.root / "no-run", 0, {
            "exit 2": generate.returncode == 2, "one line": len(generate.stderr.strip().splitlines()) == 1,
            "names --temperature": "--temperature=nan" in generate.stderr})



def _tiny_llama(folder: Path, **config_overrides: Any) -> None:
    """A two-layer Hugging Face Llama saved by transformers, then its config.json edited as a user might."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_overrides}))


def format_row(row: Row) -> str:
    restarts_text = "-" if row.restarts is None else str(row.restarts)
    lost = "-" if row.steps_lost is None else str(row.steps_lost)
    verdict = "right" if row.right else f"WRONG ({row.wrong})"
    return f"| {row.fault} | {restarts_text} | {row.seconds:.0f} | {row.final_line} | {lost} | {verdict} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/meshtrain-bench-faults"), help="scratch folder")
    parser.add_argument("--only", nargs="*", default=None, help="row methods to run (default: all)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    print("| fault | restarts | seconds | final line | steps lost | outcome |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    matrix = Matrix(args.dir, lambda line: print(line, flush=True))
    if args.only is None or set(args.only) - {"round_two", "downstream_not_waited_for", "oversized_document",
                                               "replica_frozen", "replica_hung", "replica_slow", "replica_evicted"}:
        matrix.prepare()
    rows: list[Row | None] = []
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("checkpoint_of_another_shape", matrix.checkpoint_of_another_shape),
        ("no_loadable_checkpoint", matrix.no_loadable_checkpoint),
        ("truncated_with_keep_1", matrix.truncated_with_keep_1),
        ("flipped_checkpoint_shard", matrix.flipped_checkpoint_shard),
        ("flipped_metadata", matrix.flipped_metadata),
        ("flipped_token_low", lambda: matrix.flipped_token("3c. low bit flips in a local token shard", "token-low", False, 0)),
        ("flipped_token_high", lambda: matrix.flipped_token("3d. high bit flips in a local token shard", "token-high", True, 7)),
        ("flipped_token_on_s3", matrix.flipped_token_on_s3),
        ("crafted_metadata", matrix.crafted_metadata),
        ("secrets", matrix.secrets),
        ("checkpoint_path_is_a_file", matrix.storage_path_is_a_file),
        ("run_storage_is_a_file", matrix.run_storage_is_a_file),
        ("read_only_checkpoints", matrix.read_only_checkpoints),
        ("disk_full", matrix.disk_full),
        ("killed_worker", matrix.killed_worker),
        ("ctrl_c", matrix.ctrl_c),
        ("input_errors", lambda: list(matrix.input_errors())),
        ("downstream_not_waited_for", matrix.downstream_not_waited_for),
        ("oversized_document", matrix.oversized_document),
        ("round_two", lambda: list(matrix.round_two())),
        ("replica_frozen", lambda: matrix.replica_fault("frozen")),
        ("replica_hung", lambda: matrix.replica_fault("hung")),
        ("replica_slow", lambda: matrix.replica_fault("slow")),
        ("replica_evicted", lambda: matrix.replica_fault("evicted")),
    ]
    for name, step in steps:
        if args.only is None or name in args.only:
            result = step()
            rows.extend(result if isinstance(result, list) else [result])
    done = [row for row in rows if row is not None]
    print(f"{sum(row.right for row in done)}/{len(done)} rows right", flush=True)
    return 0 if all(row.right for row in done) else 1
