"""A run owns its folder: one driver at a time per run name.

The driver holds an exclusive ``flock`` on ``{run}/driver.lock`` from before it reads or writes any
file of the run until it returns. The kernel (or, on a network file system, the lock server) drops
the lock when the holder dies, SIGKILL included, so a crashed driver never blocks a relaunch; two
drivers started together cannot both take it. The file also names the holder (host, PID, since,
launch), which a refused driver prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError

LOCK_FILE = "driver.lock"


class RunHeld(ConfigError):
    """Another driver holds the run's folder."""


class RunLease:
    """The held lock on one run's folder (``with RunLease.take(run_dir, name, launch):``)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def take(cls, run_dir: Path, name: str, launch_id: str) -> RunLease:
        """The lease, or :class:`RunHeld` naming the driver that has it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise RunHeld(
                f"run.name={name}: another driver is running this run ({holder}); wait for it, stop it, or choose "
                "another run.name"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "launch": launch_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        os.ftruncate(self._fd, 0)  # no holder to name; the file stays (removing it would race a new taker)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 4096, 0).decode()
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a driver that is starting"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {when}"
