"""Loopback ports for the servers and process groups tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (closed again: until someone binds it, connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

