"""Ray nodes for tests, started with the ``ray`` CLI as an operator would, and stopped without
touching any other Ray on the machine."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs import job_env

RAY = str(Path(sys.executable).with_name("ray"))


def ray_env(**extra: str) -> dict[str, str]:
    """This test's environment with the venv first on PATH, so jobs run this interpreter's ``python``."""
    env = job_env(own_ray=True, **extra)
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


class SharedHead:
    """One Ray head for the session's jobs that neither size nor kill their Ray, started by the first job
    that asks for it and stopped when the session ends. Jobs join it as users join a cluster started with
    `ray start`: RAY_ADDRESS, and the cluster's token. It holds this machine's CPUs, as the local Ray a
    job starts for itself would."""

    node: RayNode | None = None
    env: dict[str, str] = {}
    dashboard = ""  # its job server, for `ray job submit --address`
    log = Path(tempfile.gettempdir()) / f"meshtrain-tests-head-{os.getpid()}.log"

    @classmethod
    def join(cls) -> dict[str, str]:
        """What a job's environment needs to join the head (started now if it is not running)."""
        from ports import free_port

        if cls.node is not None and cls.node.alive():
            return cls.env
        port, dashboard = free_port(), free_port()
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        cls.log.unlink(missing_ok=True)
        cls.dashboard = f"http://127.0.0.1:{dashboard}"
        cls.node = RayNode(
            ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={os.cpu_count()}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--metrics-export-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"],
            env=ray_env(**auth), log=cls.log,
        ).start()
        cls.env = {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth}
        probe = [sys.executable, "-c", "import ray; ray.init(); ray.shutdown()"]
        wait_until(lambda: cls.node is not None and cls.node.alive() and subprocess.run(
            probe, env={**ray_env(), **cls.env}, capture_output=True, timeout=60).returncode == 0,
            120, f"the session's Ray head at 127.0.0.1:{port} (its log: {cls.log})", interval=1)
        return cls.env

    @classmethod
    def stop(cls, keep_log: bool) -> None:
        """Stop it (every process of its node); its log is left only for a session that failed."""
        if cls.node is not None:
            cls.node.kill()
            cls.node = None
        if not keep_log:
            cls.log.unlink(missing_ok=True)
