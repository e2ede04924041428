"""Loopback ports for the servers and process groups tests start."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A port nothing listens on now (closed again: until someone binds it, connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, timeout: float, what: str) -> None:
    """Until something accepts connections on ``port``; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} on port {port}") from None
            time.sleep(0.1)
