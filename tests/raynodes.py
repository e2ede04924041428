"""Ray nodes for tests, started with the ``ray`` CLI as an operator would, and stopped without
touching any other Ray on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobs import job_env

RAY = str(Path(sys.executable).with_name("ray"))


def ray_env(**extra: str) -> dict[str, str]:
    """This test's environment with the venv first on PATH, so jobs run this interpreter's ``python``."""
    env = job_env(**extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class RayNode:
    """``ray start --block`` in its own session: stopping it kills exactly this node's processes."""

    def __init__(self, args: list[str], prefix: list[str] | None = None, env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.command = [*(prefix or []), RAY, "start", "--block", "--disable-usage-stats", *args]
        self.env = env or ray_env()
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "RayNode":
        output = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of this node at once (raylet, workers, GCS on a head): a node lost."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self.process = None


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
