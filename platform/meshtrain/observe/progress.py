"""Step records: ``metrics.jsonl`` in the run directory, and the progress the driver prints from it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    CheckpointSkippedRecord,
    DownstreamEvalFailedRecord,
    DownstreamEvalRecord,
    EvalRecord,
    EvictionRecord,
    GroupStartRecord,
    MixtureRecord,
    LineAppender,
    PreemptedRecord,
    ReadRecord,
    RecordFollower,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    ReplicaStragglerRecord,
    ResizeRecord,
    ResizeSaveRecord,
    RollbackRecord,
    StoppedRecord,
    StragglerRecord,
    TextSamplesRecord,
    TrainRecord,
    WarningRecord,
    record_items,
)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


_LOST_WHY = {
    "hung": "missed the step's deadline while heartbeating; its peers ended it",
    "frozen": "missed the step's deadline and could not be reached; its peers ended it",
    "slow": "stepped slower than the others; its peers ended it",
}


def _lost_groups(record: ReplicaLostRecord) -> str:
    """Which replica groups a step went on without, and why."""
    if record.cause == "lost" or not record.groups:
        return "a replica group was lost"
    names = " and ".join(str(group) for group in record.groups)
    return f"replica group{'s' if len(record.groups) > 1 else ''} {names} {_LOST_WHY[record.cause]}"


def progress_line(record: ReadRecord, total_steps: int) -> str:
    match record:
        case CheckpointSaveRecord():
            return (
                f"[meshtrain] checkpoint step {record.step} committed: {record.bytes / 2**20:,.1f} MiB, "
                f"loop blocked {record.blocking_s:.2f}s, written in {record.total_s:.2f}s -> {record.path}"
            )
        case CheckpointLoadRecord():
            return f"[meshtrain] resumed from {record.path} (step {record.step}) in {record.load_s:.2f}s"
        case ResizeRecord():
            return (
                f"[meshtrain] worker group resized from {record.from_workers} to {record.to_workers} workers: "
                f"{record.reason}"
            )
        case CheckpointSkippedRecord():
            return f"[meshtrain] checkpoint step {record.step} not saved: {record.reason}"
        case EvalRecord():
            return (
                f"[meshtrain] eval step {record.step}: validation loss {record.loss:.4f}, "
                f"perplexity {record.perplexity:,.2f} ({record.samples} sequences)"
            )
        case StoppedRecord():
            return f"[meshtrain] stopped at step {record.step}: {record.reason}"
        case StragglerRecord():
            return (
                f"[meshtrain] straggler: rank {record.rank} on node {record.node} computes {record.slowdown:.2f}x "
                f"slower than the median of the other ranks for {record.logged_steps} logged steps (step {record.step}); "
                "every step waits for it"
            )
        case ReplicaStragglerRecord():
            return (
                f"[meshtrain] straggler: replica group {record.replica} computes {record.slowdown:.2f}x slower than "
                f"the median of the other groups for {record.logged_steps} logged steps (step {record.step}"
                + (f", slowest worker on {record.node}" if record.node else "") + "); "
                + ("its peers end it and Ray replaces it (scaling.evict_stragglers)" if record.replaced
                   else "every step's cross-replica sum waits for it")
            )
        case EvictionRecord():
            verb = "evicting" if record.evicted else "not evicting"
            return f"[meshtrain] {verb} straggler rank {record.rank}'s node {record.node}: {record.reason}"
        case PreemptedRecord():
            kept = "saved and committed" if record.saved else "not saved"
            return (f"[meshtrain] preemption notice ({record.reason}): step {record.step} {kept} in "
                    f"{record.save_s:.1f}s; the group restarts from it")
        case ResizeSaveRecord():
            return f"[meshtrain] growing the group: step {record.step} saved in {record.save_s:.1f}s, waiting for Ray to restart it"
        case ReplicaLostRecord():
            return (f"[meshtrain] step {record.step} trains on {record.participants} of {record.replicas} replica "
                    f"groups: {_lost_groups(record)} ({record.stall_s:.1f}s stall, {record.quorum_s:.1f}s of it "
                    "waiting for the quorum); Ray replaces it while the others go on")
        case ReplicaJoinedRecord():
            return (f"[meshtrain] replica group {record.replica} joined at step {record.step} with replica group "
                    f"{record.source}'s state ({record.bytes / 2**20:,.1f} MiB in {record.seconds:.1f}s); "
                    f"{record.participants} replica groups train")
        case RollbackRecord():
            ranges = ", ".join(f"[{r['start']}, {r['stop']})" + (f" of stage {r['stage']}" if r["stage"] else "")
                               for r in record.left_out)
            return (f"[meshtrain] steps {', '.join(map(str, record.skipped_steps))} spiked: rolled back from step "
                    f"{record.step} to the checkpoint of step {record.to_step} in {record.seconds:.1f}s, leaving out "
                    f"samples {ranges}")
        case WarningRecord():
            return f"[meshtrain] warning: {record.message}"
        case DownstreamEvalRecord():
            values = ", ".join(f"{key} {value:.4g}" for key, value in record.scores.items())
            return (f"[meshtrain] downstream step {record.step} {record.task} ({record.samples} examples, "
                    f"{record.seconds:.1f}s): {values}")
        case TextSamplesRecord():
            return "\n".join(f"[meshtrain] sample step {record.step}: {sample['prompt']!r} -> {sample['continuation']!r}"
                             for sample in record.samples)
        case MixtureRecord():
            target = record.target or {}
            shares = ", ".join(f"{source} {share:.1%}" + (f" (aims at {target[source]:.1%})" if source in target else "")
                               for source, share in record.sources.items())
            stage = f" (stage {record.stage})" if record.stage else ""
            return f"[meshtrain] mixture of steps to {record.step}{stage}: {shares}"
        case DownstreamEvalFailedRecord():
            return f"[meshtrain] downstream evaluation of step {record.step} failed ({record.error}); training is not affected"
        case TrainRecord():
            eta = (total_steps - record.step) * record.step_time_s
            return (
                f"[meshtrain] step {record.step}/{total_steps} | loss {record.loss:.4f} | "
                f"lr {record.lr:.2e} | grad_norm {record.grad_norm:.3f} | "
                f"{record.tokens_per_s:,.0f} tok/s on {record.world_size} workers"
                f" | {record.step_time_s * 1000:.0f} ms/step | "
                f"ETA {format_duration(eta)}" + (f" | skipped {record.skipped_steps}" if record.skipped_steps else "")
                + (f" | stage {record.stage}" if record.stage else "")
            )
    # A kind without a line of its own, or one this driver does not know (a newer worker's): shown as it is.
    kind, fields = record_items(record)
    details = ", ".join(f"{key}={value}" for key, value in fields.items() if key != "step")
    return f"[meshtrain] {kind} at step {fields.get('step', '?')}: {details}"


class StepRecorder(LineAppender):
    """Rank 0's sink for logged steps and checkpoint events: appends them to metrics.jsonl."""


class ProgressMonitor:
    """The driver's view of a run: follows metrics.jsonl and prints progress to the job log.

    On a terminal one status line is rewritten in place. Otherwise (a Ray job log, a file, CI) a
    line is printed at most every ``interval_s`` seconds, plus the first and last step and every
    checkpoint or resume, so a long run does not flood the log. Records come from whichever worker
    group is alive, so progress continues across worker restarts.
    """

    def __init__(
        self,
        path: Path,
        total_steps: int,
        interval_s: float,
        stream: TextIO = sys.stdout,
        poll_s: float = 1.0,
        listeners: Sequence[Callable[[ReadRecord], None]] = (),
    ) -> None:
        """``listeners`` see every record this launch's workers write, in order (the goodput ledger)."""
        self.path, self.total_steps, self.interval_s = path, total_steps, interval_s
        self.listeners = listeners
        self.stream, self.poll_s = stream, poll_s
        self.tty = stream.isatty()
        self._records = RecordFollower(path, from_end=True)  # a resumed run's earlier lines stay unprinted
        self._last_printed_at: float | None = None
        self._unprinted: TrainRecord | None = None
        self._status_shown = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="meshtrain-progress", daemon=True)

    def __enter__(self) -> "ProgressMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        if self._unprinted is not None:
            self._print(progress_line(self._unprinted, self.total_steps))
        if self._status_shown:
            self.stream.write("\n")
            self.stream.flush()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Show what the records appended since the last poll say."""
        for record in self._records.new_records():
            for listener in self.listeners:
                listener(record)
            self.show(record)

    def show(self, record: ReadRecord) -> None:
        if isinstance(record, GroupStartRecord):  # for the trackers; Ray's own log tells of a restart
            return
        line = progress_line(record, self.total_steps)
        if not isinstance(record, TrainRecord):
            self._print(line)
        elif self.tty:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
            self._status_shown = True
        else:
            now = time.monotonic()
            due = self._last_printed_at is None or now - self._last_printed_at >= self.interval_s
            if due or record.step >= self.total_steps:
                self._print(line)
                self._last_printed_at = now
            else:
                self._unprinted = record

    def _print(self, line: str) -> None:
        prefix = "\r\033[K" if self._status_shown else ""
        self.stream.write(prefix + line + "\n")
        self.stream.flush()
        self._status_shown = False
        self._unprinted = None
