"""Step records: the progress line in the job log and ``metrics.jsonl`` in the run directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    if record["event"] == "checkpoint_save":
        return (
            f"[meshtrain] checkpoint step {record['step']} committed: {record['bytes'] / 2**20:,.1f} MiB, "
            f"loop blocked {record['blocking_s']:.2f}s, written in {record['total_s']:.2f}s -> {record['path']}"
        )
    if record["event"] == "checkpoint_load":
        return f"[meshtrain] resumed from {record['path']} (step {record['step']}) in {record['load_s']:.2f}s"
    eta = (total_steps - record["step"]) * record["step_time_s"]
    return (
        f"[meshtrain] step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.2e} | grad_norm {record['grad_norm']:.3f} | "
        f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1000:.0f} ms/step | "
        f"ETA {format_duration(eta)}"
    )


class StepRecorder:
    """Rank 0's sink for logged steps: appends to metrics.jsonl and prints the progress line."""

    def __init__(self, metrics_path: Path | None, total_steps: int, stream: TextIO = sys.stdout) -> None:
        self.total_steps, self.stream = total_steps, stream
        self._file = None
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = metrics_path.open("a", encoding="utf-8")

    def record(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        # Written to the stream directly: Ray Train patches print() on workers and would echo it twice.
        self.stream.write(progress_line(record, self.total_steps) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
