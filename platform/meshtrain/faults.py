"""Fault injection for tests and demos: a worker that kills itself once with SIGKILL, or hangs."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from meshtrain.config import FaultConfig


def maybe_kill_self(fault: FaultConfig, rank: int, step: int, during_checkpoint: bool, marker_dir: Path) -> None:
    """SIGKILL this process (``fault.kind=hang``: sleep forever) if ``fault`` names this rank and
    step, unless it already happened.

    A marker file in the run directory records the fault, so the restarted worker passes the same
    step without failing again.
    """
    if (fault.kill_rank, fault.at_step, fault.during_checkpoint) != (rank, step, during_checkpoint):
        return
    marker = marker_dir / f"killed-rank{rank}-step{step}"
    if marker.exists():
        return
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{os.getpid()}\n")
    where = "while its checkpoint is being written" if during_checkpoint else "before the step"
    if fault.kind == "hang":
        sys.stdout.write(f"[meshtrain] fault injection: rank {rank} hangs at step {step} {where}\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
    sys.stdout.write(f"[meshtrain] fault injection: rank {rank} sends itself SIGKILL at step {step} {where}\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
